"""The real loop with FSDP2 on 2 CPU ranks (gloo): the other shardings, bf16-pure and
activation checkpointing train. Stop + resume is bit-exact: test_resume_train.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers.train_run import metrics, tiny_spec, train_ok

pytestmark = pytest.mark.slow


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
