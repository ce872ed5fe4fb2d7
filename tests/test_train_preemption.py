"""A real preemption signal to ONE rank: every rank agrees at the step boundary,
saves the same step, exits with EXIT_PREEMPTED; the next run resumes there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.ckpt_run import ROOT, child_env, kill_group
from helpers.train_run import loop_argv, metrics, tiny_spec, train
from shardctl.train.preemption import EXIT_PREEMPTED

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _rank_pid(launcher: int, rank: int) -> int | None:
    for pid in _children(launcher):
        try:
            env = (Path(f"/proc/{pid}") / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def test_sigusr2_to_one_rank_saves_everywhere_and_resumes(tmp_path: Path) -> None:
    spec = tiny_spec(
        tmp_path, "pre", train={"steps": 5000, "warmup_steps": 0}, checkpoint={"every_steps": 5000}
    )
    run_dir = tmp_path / "pre"
    argv = loop_argv(spec)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "logs" / "metrics.jsonl").exists() or not metrics(run_dir):
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no step logged in time"
            time.sleep(0.2)
        rank1 = _rank_pid(proc.pid, 1)
        assert rank1 is not None
        os.kill(rank1, signal.SIGUSR2)  # only rank 1 hears it
        out, _ = proc.communicate(timeout=180)
    finally:
        kill_group(proc)
    assert proc.returncode != 0, out[-3000:]  # torchrun turns the ranks' 42 into 1
    assert "SIGUSR2" in out and f"exiting with code {EXIT_PREEMPTED}" in out
    marker = json.loads((run_dir / "PREEMPTED").read_text())
    step = marker["step"]
    assert 1 <= step < 5000 and marker["reason"] == "signal SIGUSR2"
    assert (marker["kind"], marker["signal"]) == ("preempted", "SIGUSR2")
    ckpt = run_dir / "checkpoints" / f"step-{step:08d}"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == step and manifest["world_size"] == 2
    assert {p.name for p in (ckpt / "train_state").iterdir()} == {
        "rank-00000.pt",
        "rank-00001.pt",
    }
    assert metrics(run_dir)[-1]["step"] == step

    # The next start resumes right there (stopped again after one step to stay quick).
    res = train(spec, env={"SHARDCTL_STOP_AFTER_STEP": str(step + 1)})
    assert f"resumed at step {step} (" in res.stdout, res.stdout[-3000:]
    assert json.loads((run_dir / "PREEMPTED").read_text())["step"] == step + 1
