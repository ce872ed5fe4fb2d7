"""End to end with the real loop (`torchrun -m shardctl.train`): a run stopped by the
preemption path (SHARDCTL_STOP_AFTER_STEP, exit 42) and resumed ends with weights
bit-for-bit equal to an uninterrupted run (FSDP2 bf16-mixed, async saves); and an
FSDP run resumes on another world size."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

import pytest
from helpers.ckpt_train import final_weights, train, write_spec
from helpers.train_run import assert_bit_equal

pytestmark = pytest.mark.slow

EXIT_PREEMPTED = 42


def ok(res) -> None:
    assert res.returncode == 0, res.stdout[-6000:]


def test_stop_and_resume_is_bit_exact(tmp_path: Path) -> None:
    """FSDP2 with async saves, stopped at a step that is not a periodic checkpoint step
    (every 4): the stop saves step 6 itself; the resumed run ends bit for bit like the
    uninterrupted one, logs the same losses, and a third start says it is complete.
    DeepSpeed's stop and resume through the loop: test_train_deepspeed.py (ZeRO-3)."""
    kw = {"backend": "fsdp", "async_save": True}
    ref = write_spec(tmp_path / "ref.yaml", tmp_path / "ref", **kw)
    ok(train(ref))
    run_dir = tmp_path / "run"
    spec = write_spec(tmp_path / "job.yaml", run_dir, **kw)
    res = train(spec, SHARDCTL_STOP_AFTER_STEP="6")
    assert res.returncode != 0  # torchrun reports the ranks' 42 as a failure
    assert f"exiting with code {EXIT_PREEMPTED}" in res.stdout
    marker = json.loads((run_dir / "PREEMPTED").read_text())
    assert marker["step"] == 6
    assert not (run_dir / "DONE").exists()
    manifest = json.loads((run_dir / "checkpoints" / "step-00000006" / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["world_size"] == 2
    assert manifest["backend"] == "fsdp" and manifest["model"]["source"] == "llama"
    res = train(spec)
    ok(res)
    assert "resumed at step 6 (" in res.stdout
    assert not (run_dir / "PREEMPTED").exists()
    assert json.loads((run_dir / "DONE").read_text())["step"] == 12
    assert_bit_equal(
        final_weights(tmp_path / "ref" / "checkpoints", 12),
        final_weights(run_dir / "checkpoints", 12),
    )
    # The logged losses of the steps after the resume equal the uninterrupted run's.
    assert _losses(run_dir) == _losses(tmp_path / "ref")
    # Running it again says it is complete and changes nothing.
    res = train(spec)
    ok(res)
    assert "run complete" in res.stdout


def _losses(run_dir: Path) -> dict[int, float]:
    rows = (
        json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    )
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_fsdp_resumes_on_three_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    two = write_spec(tmp_path / "two.yaml", run_dir, nproc=2, keep=5)
    res = train(two, SHARDCTL_STOP_AFTER_STEP="6")
    assert res.returncode != 0
    three = write_spec(tmp_path / "three.yaml", run_dir, nproc=3, keep=5)
    res = train(three, nproc=3)
    ok(res)
    assert "resumed at step 6" in res.stdout
    assert "resuming a world-size-2 checkpoint on 3 ranks" in res.stdout
    ckdir = run_dir / "checkpoints"
    sizes = {
        step: json.loads((ckdir / f"step-{step:08d}" / "manifest.json").read_text())["world_size"]
        for step in (6, 8, 12)
    }
    assert sizes == {6: 2, 8: 3, 12: 3}
    losses = [
        json.loads(line)["loss"]
        for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    # Steps 1-6 ran on 2 ranks, 7-12 on 3: training goes on, no jump after resharding.
    assert len(losses) == 12
    assert max(losses[6:]) < losses[0]
    assert mean(losses[6:]) < mean(losses[:6])
