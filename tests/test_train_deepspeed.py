"""The real loop with DeepSpeed ZeRO 1/2/3 on 2 CPU ranks (gloo, torch AdamW)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.train_run import assert_bit_equal, final_weights, metrics, tiny_spec, train, train_ok

pytestmark = pytest.mark.slow

DS = {"backend": "deepspeed", "sharding": None, "precision": "bf16-mixed"}


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_stage_trains_and_checkpoints(tmp_path: Path, zero: int) -> None:
    spec = tiny_spec(tmp_path, f"z{zero}", strategy={**DS, "zero_stage": zero})
    res = train_ok(spec)
    assert "finished 4 steps" in res.stdout
    assert "built successfully" not in res.stdout  # no DeepSpeed op was compiled
    rows = metrics(tmp_path / f"z{zero}")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in rows)
    step = tmp_path / f"z{zero}" / "checkpoints" / "step-00000004"
    manifest = json.loads((step / "manifest.json").read_text())
    assert (manifest["backend"], manifest["zero_stage"]) == ("deepspeed", zero)
    assert (step / "deepspeed").is_dir()


def test_zero3_stop_and_resume_is_bit_exact(tmp_path: Path) -> None:
    strategy = {**DS, "zero_stage": 3}
    straight = tiny_spec(tmp_path, "straight", strategy=strategy)
    train_ok(straight)
    resumed = tiny_spec(tmp_path, "resumed", strategy=strategy)
    stopped = train(resumed, env={"SHARDCTL_STOP_AFTER_STEP": "1"})
    assert stopped.returncode != 0
    assert json.loads((tmp_path / "resumed" / "PREEMPTED").read_text())["step"] == 1
    again = train_ok(resumed)
    assert "resumed at step 1 (" in again.stdout
    a = final_weights(tmp_path / "straight" / "checkpoints" / "step-00000004", tmp_path / "a")
    b = final_weights(tmp_path / "resumed" / "checkpoints" / "step-00000004", tmp_path / "b")
    assert_bit_equal(a, b)
    straight_loss = {r["step"]: r["loss"] for r in metrics(tmp_path / "straight")}
    resumed_loss = {r["step"]: r["loss"] for r in metrics(tmp_path / "resumed")}
    assert resumed_loss == straight_loss
