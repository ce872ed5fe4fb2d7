"""The real loop with FSDP2 on 2 CPU ranks (gloo): stop + resume is bit-exact, and
the other shardings, bf16-pure and activation checkpointing train."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers.train_run import assert_bit_equal, final_weights, metrics, tiny_spec, train, train_ok
from shardctl.train.preemption import EXIT_PREEMPTED

pytestmark = pytest.mark.slow


def test_stop_and_resume_ends_bit_for_bit_like_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = tiny_spec(tmp_path, "straight")
    train_ok(straight)
    resumed = tiny_spec(tmp_path, "resumed")
    # Step 3 is not a periodic checkpoint step (every 2): the stop must save it itself.
    stopped = train(resumed, env={"SHARDCTL_STOP_AFTER_STEP": "3"})
    assert stopped.returncode != 0  # torchrun reports a rank's exit 42 as its own 1
    assert f"exiting with code {EXIT_PREEMPTED}" in stopped.stdout
    marker = json.loads((tmp_path / "resumed" / "PREEMPTED").read_text())
    assert marker["step"] == 3
    assert not (tmp_path / "resumed" / "DONE").exists()
    assert (tmp_path / "resumed" / "checkpoints" / "step-00000003" / "manifest.json").is_file()

    again = train_ok(resumed)
    assert "resumed at step 3 (" in again.stdout
    assert not (tmp_path / "resumed" / "PREEMPTED").exists()
    assert json.loads((tmp_path / "resumed" / "DONE").read_text())["step"] == 4

    a = final_weights(tmp_path / "straight" / "checkpoints" / "step-00000004", tmp_path / "a")
    b = final_weights(tmp_path / "resumed" / "checkpoints" / "step-00000004", tmp_path / "b")
    assert_bit_equal(a, b)
    # The logged losses of the steps after the resume equal the uninterrupted run's.
    straight_loss = {r["step"]: r["loss"] for r in metrics(tmp_path / "straight")}
    resumed_loss = {r["step"]: r["loss"] for r in metrics(tmp_path / "resumed")}
    assert resumed_loss == straight_loss


@pytest.mark.parametrize(
    ("sharding", "precision", "ac"),
    [("no_shard", "fp32", True), ("shard_grad_op", "bf16-pure", False)],
)
def test_other_shardings_and_precisions_train(
    tmp_path: Path, sharding: str, precision: str, ac: bool
) -> None:
    spec = tiny_spec(
        tmp_path,
        "other",
        strategy={"sharding": sharding, "precision": precision, "activation_checkpointing": ac},
        train={"steps": 6, "lr": 3e-3},
        checkpoint={"every_steps": 6},
    )
    res = train_ok(spec)
    assert "finished 6 steps" in res.stdout
    rows = metrics(tmp_path / "other")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns (byte-level text, lr 3e-3)
    manifest = json.loads(
        (tmp_path / "other" / "checkpoints" / "step-00000006" / "manifest.json").read_text()
    )
    assert (manifest["sharding"], manifest["precision"]) == (sharding, precision)
    assert manifest["model"]["hf_config"]["hidden_size"] == 32
    # the names consolidation checks without rebuilding the model
    assert "model.embed_tokens.weight" in manifest["model"]["state_keys"]["names"]
