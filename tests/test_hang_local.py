"""A real hang on the local cluster: `shardctl submit`, a rank stopped with SIGSTOP
after the first checkpoint, the watchdog ends the job within its timeout with both
ranks' stacks, `status` says HUNG, and `submit` again resumes and finishes. A rank
stopped for less than the timeout (alive but slow) is never ended."""

from __future__ import annotations

import contextlib
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
from helpers.train_run import tiny_spec
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.rundir import EXIT_HUNG, HUNG_FILE

pytestmark = pytest.mark.slow

HANG_TIMEOUT_S = 15
PAUSE_S = 6  # a pause well under the timeout (a loaded machine continues a rank late)


def rank_pids(run_dir: Path, attempt: int, restart: int | None = None) -> dict[int, int]:
    """{global rank: pid} of the ranks of `run_dir`'s attempt (and, given, of that
    restart inside it: SHARDCTL_RESTART), found in /proc."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(
                w.split(b"=", 1) for w in (entry / "environ").read_bytes().split(b"\0") if b"=" in w
            )
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (
            env.get(b"SHARDCTL_RUN_DIR") == str(run_dir).encode()
            and env.get(b"SHARDCTL_ATTEMPT") == str(attempt).encode()
            and (restart is None or env.get(b"SHARDCTL_RESTART") == str(restart).encode())
            and b"RANK" in env
            and _module(cmd.split(b"\0")) in (b"shardctl.train", b"shardctl.train.entry")
        ):
            found[int(env[b"RANK"])] = int(entry.name)
    return found


def _module(argv: list[bytes]) -> bytes:
    """The module a Python command line runs (`-m M`): the first word after the first
    `-m`. Words, not substrings: the checkout's path may hold "watchdog" or "torchrun"."""
    if len(argv) > 1 and argv[1].endswith(b"torchrun"):
        return b"torchrun"  # python .../bin/torchrun ... -m shardctl.train: the launcher
    return next((argv[i + 1] for i, word in enumerate(argv[:-1]) if word == b"-m"), b"")


def _status(name: str) -> dict:
    res = CliRunner().invoke(cli, ["status", name, "-o", "json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _release(stopped: list[int], name: str) -> None:
    """By PID: continue what the test stopped; cancel the job if it still runs."""
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    if _status(name)["state"] == "RUNNING":
        CliRunner().invoke(cli, ["cancel", name])


def _wait_for(what: str, check, timeout: float) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(0.3)
    return time.monotonic() - started


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
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    spec = tiny_spec(
        tmp_path, "hang",
        train={"steps": 3000, "log_every": 1},
        checkpoint={"every_steps": 4},
        watchdog={"hang_timeout_s": HANG_TIMEOUT_S},
    )  # fmt: skip
    run_dir = tmp_path / "hang"
    ckpts = run_dir / "checkpoints"
    res = CliRunner().invoke(cli, ["submit", str(spec)])
    assert res.exit_code == 0, res.output
    stopped: list[int] = []
    try:
        _wait_for("the first checkpoint", lambda: any(ckpts.glob("step-*[0-9]")), 400)
        ranks = rank_pids(run_dir, 0)
        assert sorted(ranks) == [0, 1], ranks

        # Alive but slow: rank 1 paused for less than the timeout, then continued.
        os.kill(ranks[1], signal.SIGSTOP)
        stopped.append(ranks[1])
        time.sleep(PAUSE_S)
        os.kill(ranks[1], signal.SIGCONT)
        before = _last_step(run_dir)
        _wait_for("a step after the pause", lambda: _last_step(run_dir) > before + 2, 120)
        assert _status("hang")["state"] == "RUNNING"
        assert not (run_dir / HUNG_FILE).exists()

        # Hung: rank 1 stopped for good.
        os.kill(ranks[1], signal.SIGSTOP)
        took = _wait_for("the end", lambda: _status("hang")["state"] != "RUNNING", 180)
    finally:
        _release(stopped, "hang")
    # The timeout, a poll, the stacks (≤ 2 × 5 s) and the kill; generous on a busy box,
    # and far below the start-up allowance (900 s): the rank was past its first step.
    assert took < HANG_TIMEOUT_S + 60, took
    st = _status("hang")
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
    res = CliRunner().invoke(cli, ["submit", str(spec), "--set", "train.steps=" + str(newest + 6)])
    assert res.exit_code == 0, res.output
    try:
        _wait_for("the resumed run", lambda: _status("hang")["state"] != "RUNNING", 400)
    finally:
        _release([], "hang")
    st = _status("hang")
    out = (run_dir / "logs" / "launcher.out").read_text()
    assert st["state"] == "SUCCEEDED", (st, out[-3000:])
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

    import yaml
    from helpers.ckpt_run import free_port

    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "own.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "own",
                "run_dir": str(tmp_path / "own"),
                "resources": {"procs_per_node": 2},
                "entrypoint": {"script": str(ROOT / "examples" / script), "args": args},
                "local": {"master_port": free_port()},
                "watchdog": {"hang_timeout_s": HANG_TIMEOUT_S},
                "restart": {"max_in_allocation": 0},  # the hang ends the run here
            }
        )
    )
    run_dir = tmp_path / "own"
    res = CliRunner().invoke(cli, ["submit", str(spec)])
    assert res.exit_code == 0, res.output
    stopped: list[int] = []

    def logged() -> str:
        return "".join(
            (run_dir / "logs" / n).read_text() if (run_dir / "logs" / n).exists() else ""
            for n in ("launcher.out", "launcher.err")
        )

    try:
        _wait_for("3 steps", lambda: len(re.findall(progress, logged(), re.M)) >= 3, 400)
        ranks = rank_pids(run_dir, 0)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped.append(ranks[1])
        took = _wait_for("the end", lambda: _status("own")["state"] != "RUNNING", 180)
    finally:
        _release(stopped, "own")
    assert took < HANG_TIMEOUT_S + 60, took
    st = _status("own")
    assert st["state"] == "HUNG", (st, logged()[-3000:])
    marker = json.loads((run_dir / HUNG_FILE).read_text())
    assert marker["first"] == [1]
    report = Path(marker["report"]).read_text()
    assert report.count("Python stack, most recent call first") == 2
    assert report.count(script) >= 2  # each rank's stack names the user's script
    assert not any(rank_pids(run_dir, 0).values())
