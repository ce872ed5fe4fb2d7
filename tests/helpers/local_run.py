"""A job of the local cluster followed to its end from a test, never left running: a
tiny job submitted through the CLI, its ranks found in /proc (to be killed or stopped
by the test), what `status` and the run dir say of it, and every stopped rank
continued and the job cancelled whatever ends the test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers.ckpt_run import ROOT
from helpers.train_run import tiny_spec
from shardctl.orchestrator.agent.hangs import environ_of
from shardctl.orchestrator.cli import cli

# The modules a rank runs: the built-in loop, or a user's script under shardctl's entry.
RANK_MODULES = (b"shardctl.train", b"shardctl.train.entry")


def follow_to_end(local: Any, ref: Any, poll_s: float = 0.3) -> int:
    """`LocalCluster.follow` of `ref` (its output dropped) until it ends; its exit code.
    Whatever ends the wait early (an error, a test timeout), a job still running is
    cancelled: no test leaves ranks behind."""
    from shardctl.orchestrator.clusters.base import JobState

    try:
        return local.follow(ref, write=lambda s: None, poll_s=poll_s)
    finally:
        if local.status(ref).state == JobState.RUNNING:
            local.cancel(ref, grace_s=5)


@dataclass(frozen=True)
class SubmittedJob:
    """A job `submit_tiny` submitted: its spec, name and run dir."""

    spec: Path
    name: str
    run_dir: Path

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    def has_checkpoint(self) -> bool:
        return any(self.checkpoints.glob("step-*[0-9]"))


def submit_tiny(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    *,
    steps: int,
    hang_timeout_s: int,
    max_in_allocation: int = 0,
    **over: Any,
) -> SubmittedJob:
    """`shardctl submit` of a tiny spec (`train_run.tiny_spec`, run dir `tmp_path/<name>`)
    from `tmp_path`: `steps` steps, each logged, a checkpoint every 4, the hang timeout
    and restarts in place given; `over` for the other sections."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    spec = tiny_spec(
        tmp_path, name,
        train={"steps": steps, "log_every": 1},
        checkpoint={"every_steps": 4},
        watchdog={"hang_timeout_s": hang_timeout_s},
        restart={"max_in_allocation": max_in_allocation},
        **over,
    )  # fmt: skip
    res = CliRunner().invoke(cli, ["submit", str(spec)])
    assert res.exit_code == 0, res.output
    return SubmittedJob(spec, name, tmp_path / name)


@contextlib.contextmanager
def released(name: str) -> Iterator[list[int]]:
    """Yields the list in which the test names each pid it stops; on leaving, however,
    each is continued and job `name`, if it still runs, cancelled (`release`)."""
    stopped: list[int] = []
    try:
        yield stopped
    finally:
        release(stopped, name)


@contextlib.contextmanager
def past_first_checkpoint(job: SubmittedJob) -> Iterator[list[int]]:
    """`released`, entered once the job's first checkpoint is complete."""
    with released(job.name) as stopped:
        wait_for("the first checkpoint", job.has_checkpoint, 400)
        yield stopped


def module_of(argv: list[bytes]) -> bytes:
    """The module a Python command line runs (`-m M`): the first word after the first
    `-m`. Words, not substrings: the checkout's path may hold "watchdog" or "torchrun"."""
    if len(argv) > 1 and argv[1].endswith(b"torchrun"):
        return b"torchrun"  # python .../bin/torchrun ... -m shardctl.train: the launcher
    return next((argv[i + 1] for i, word in enumerate(argv[:-1]) if word == b"-m"), b"")


def run_processes(run_dir: Path) -> dict[int, tuple[dict[str, str], bytes]]:
    """{pid: (environment, module run)} of every process of `run_dir`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        env = environ_of(int(entry.name))
        if env.get("SHARDCTL_RUN_DIR") != str(run_dir):
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        found[int(entry.name)] = (env, module_of(argv))
    return found


def rank_pids(run_dir: Path, attempt: int, restart: int | None = None) -> dict[int, int]:
    """{global rank: pid} of the ranks of `run_dir`'s attempt (and, given, of that
    restart inside it: SHARDCTL_RESTART), found in /proc."""
    return {
        int(env["RANK"]): pid
        for pid, (env, module) in run_processes(run_dir).items()
        if env.get("SHARDCTL_ATTEMPT") == str(attempt)
        and (restart is None or env.get("SHARDCTL_RESTART") == str(restart))
        and "RANK" in env
        and module in RANK_MODULES
    }


def status(name: str) -> dict:
    res = CliRunner().invoke(cli, ["status", name, "-o", "json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def release(stopped: list[int], name: str) -> None:
    """By PID: continue what the test stopped; cancel the job if it still runs."""
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    if status(name)["state"] == "RUNNING":
        CliRunner().invoke(cli, ["cancel", name])


def ended(name: str) -> Callable[[], bool]:
    """A poll for `wait_for`: whether job `name` no longer runs."""
    return lambda: status(name)["state"] != "RUNNING"


def wait_for(what: str, check: Callable[[], object], timeout: float) -> float:
    """Polls `check` until it is true, `timeout` seconds at most; the seconds it took."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(0.3)
    return time.monotonic() - started


def succeeded(job: SubmittedJob) -> tuple[dict, str]:
    """Asserts the job SUCCEEDED (its launcher's output the message otherwise); returns
    its status and that output."""
    st = status(job.name)
    out = (job.run_dir / "logs" / "launcher.out").read_text()
    assert st["state"] == "SUCCEEDED", (st, out[-3000:])
    return st, out


def attempt_rows(run_dir: Path) -> list[dict]:
    """The run's ledger, `attempts.jsonl`, a dict a line."""
    return [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
