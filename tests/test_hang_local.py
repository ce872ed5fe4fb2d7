"""A real hang on the local cluster: `shardctl submit`, a rank stopped with SIGSTOP
after the first checkpoint, the watchdog ends the job within its timeout with both
ranks' stacks, `status` says HUNG, and `submit` again resumes and finishes. A rank
stopped for less than the timeout (alive but slow) is never ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.ckpt_run import ROOT
from helpers.local_run import (
    ended,
    past_first_checkpoint,
    rank_pids,
    released,
    status,
    submit_tiny,
    succeeded,
    wait_for,
)
from helpers.train_run import script_spec, tiny_spec
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.rundir import EXIT_HUNG, HUNG_FILE

pytestmark = pytest.mark.slow

HANG_TIMEOUT_S = 15
PAUSE_S = 6  # a pause well under the timeout (a loaded machine continues a rank late)


def _last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
        return max(json.loads(line)["step"] for line in lines if line.strip())
    except (OSError, ValueError):
        return 0


@pytest.mark.timeout(900)
def test_a_stopped_rank_is_ended_named_and_the_run_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = submit_tiny(tmp_path, monkeypatch, "hang", steps=3000, hang_timeout_s=HANG_TIMEOUT_S)
    run_dir, ckpts = job.run_dir, job.checkpoints
    with past_first_checkpoint(job) as stopped:
        ranks = rank_pids(run_dir, 0)
        assert sorted(ranks) == [0, 1], ranks

        # Alive but slow: rank 1 paused for less than the timeout, then continued.
        os.kill(ranks[1], signal.SIGSTOP)
        stopped.append(ranks[1])
        time.sleep(PAUSE_S)
        os.kill(ranks[1], signal.SIGCONT)
        before = _last_step(run_dir)
        wait_for("a step after the pause", lambda: _last_step(run_dir) > before + 2, 120)
        assert status("hang")["state"] == "RUNNING"
        assert not (run_dir / HUNG_FILE).exists()

        # Hung: rank 1 stopped for good.
        os.kill(ranks[1], signal.SIGSTOP)
        took = wait_for("the end", ended("hang"), 180)
    # The timeout, a poll, the stacks (≤ 2 × 5 s) and the kill; generous on a busy box,
    # and far below the start-up allowance (900 s): the rank was past its first step.
    assert took < HANG_TIMEOUT_S + 60, took
    st = status("hang")
    assert st["state"] == "HUNG", st
    assert "stopped first: rank 1 at step" in st["detail"]

    marker = json.loads((run_dir / HUNG_FILE).read_text())
    step = marker["step"]
    assert marker["first"] == [1] and step >= 4
    report = Path(marker["report"]).read_text()
    assert report.count("Python stack, most recent call first") == 2
    for rank in (0, 1):
        assert f"---- rank {rank} (pid {ranks[rank]}), last at step" in report
    assert "loop.py" in report and "stopped (SIGSTOP)" in report
    # Continued only to print its stack (rank 0 frozen first), rank 1 finished no step.
    saved = [int(p.name.split("-")[1]) for p in ckpts.glob("step-*[0-9]")]
    assert max(saved) <= step, (saved, step)
    err = (run_dir / "logs" / "launcher.err").read_text()
    assert "HUNG" in err and "Python stack" in err  # the node's log has them too
    assert not any(rank_pids(run_dir, 0).values())  # every rank of attempt 0 ended

    res = CliRunner().invoke(cli, ["status", "hang", "--watch"])
    assert res.exit_code == EXIT_HUNG, res.output

    # Submit again: resumes from the newest complete checkpoint and finishes.
    newest = max(int(p.name.split("-")[1]) for p in ckpts.glob("step-*[0-9]"))
    steps = "train.steps=" + str(newest + 6)
    res = CliRunner().invoke(cli, ["submit", str(job.spec), "--set", steps])
    assert res.exit_code == 0, res.output
    with released("hang"):
        wait_for("the resumed run", ended("hang"), 400)
    _, out = succeeded(job)
    assert f"resumed at step {newest}" in out
    assert not (run_dir / HUNG_FILE).exists()
    assert json.loads((run_dir / "DONE").read_text())["step"] == newest + 6


def test_watchdog_off_runs_the_launcher_itself(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path, "nowd", watchdog={"enabled": False})
    res = CliRunner().invoke(cli, ["submit", str(spec), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "shardctl.train.watchdog" not in res.output
    # The launcher runs directly (under the wrapper that records each rank's end).
    launch = res.output[res.output.index("exec ") :]
    assert launch.startswith(
        'exec "${SHARDCTL_PYTHON:-python3}" -m shardctl.orchestrator.launch_wrapper'
    )
    assert "torchrun" in launch.split("\n", 2)[1], launch[:300]


def test_collective_timeout_reaches_the_process_group(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path, "coll", watchdog={"hang_timeout_s": 60})
    res = CliRunner().invoke(cli, ["render", str(spec), "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    env_sh = (tmp_path / "r" / "env.sh").read_text()
    assert "export SHARDCTL_HANG_TIMEOUT_S=60" in env_sh
    assert "export SHARDCTL_STARTUP_TIMEOUT_S=''" in env_sh  # derived by the watchdog
    # The start-up allowance (900 s: the hang timeout is shorter) + 120: a collective
    # waiting for a peer still starting up fails after the watchdog's verdict.
    assert "export SHARDCTL_COLLECTIVE_TIMEOUT_S=1020" in env_sh
    probe = (
        "import datetime, shardctl.train.distributed as d; "
        "assert d.collective_timeout() == datetime.timedelta(seconds=1020)"
    )
    script = f'source {tmp_path / "r" / "env.sh"} && "$0" -c "$1"'
    done = subprocess.run(
        ["bash", "-c", script, sys.executable, probe],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------ your own training code


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("script", "args", "progress"),
    [
        # A plain FSDP2 loop: heartbeats from the checkpoint library's step_done.
        ("fsdp2_script.py", ["--steps", "3000", "--log-every", "1"], r"^step \d+ loss"),
        # A Hugging Face Trainer: heartbeats from shardctl's callback.
        ("hf_trainer_script.py", ["--max-steps", "3000", "--save-steps", "1000"], r"'epoch'"),
    ],
)  # fmt: skip
def test_your_script_stopped_rank_is_ended_with_its_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, args: list[str], progress: str
) -> None:
    import re

    monkeypatch.chdir(tmp_path)
    # One start: the hang ends the run here.
    entrypoint = {"script": str(ROOT / "examples" / script), "args": args}
    spec = script_spec(tmp_path, "own", entrypoint, watchdog={"hang_timeout_s": HANG_TIMEOUT_S})
    run_dir = tmp_path / "own"
    res = CliRunner().invoke(cli, ["submit", str(spec)])
    assert res.exit_code == 0, res.output

    def logged() -> str:
        return "".join(
            (run_dir / "logs" / n).read_text() if (run_dir / "logs" / n).exists() else ""
            for n in ("launcher.out", "launcher.err")
        )

    with released("own") as stopped:
        wait_for("3 steps", lambda: len(re.findall(progress, logged(), re.M)) >= 3, 400)
        ranks = rank_pids(run_dir, 0)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped.append(ranks[1])
        took = wait_for("the end", ended("own"), 180)
    assert took < HANG_TIMEOUT_S + 60, took
    st = status("own")
    assert st["state"] == "HUNG", (st, logged()[-3000:])
    marker = json.loads((run_dir / HUNG_FILE).read_text())
    assert marker["first"] == [1]
    report = Path(marker["report"]).read_text()
    assert report.count("Python stack, most recent call first") == 2
    assert report.count(script) >= 2  # each rank's stack names the user's script
    assert not any(rank_pids(run_dir, 0).values())
