"""The ranks' stop agreement (`shardctl.train.stop`): the rule for mixed signals on its
slots, and on real processes (gloo, 2 ranks): SIGUSR2 to one rank and SIGTERM to the
other within one step, through the training loop and through `api.Checkpointer`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.ckpt_run import ROOT, child_env, kill_group
from helpers.train_run import loop_argv, tiny_spec
from shardctl.orchestrator.rundir import EXIT_PREEMPTED
from shardctl.train import stop

USR2, TERM, INT, USR1 = signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1


def _agree(*ranks: tuple[bool, int | None]) -> stop.StopDecision:
    """The slots of every rank, summed as the all-reduce sums them."""
    total = [0.0] * (2 + stop.SLOTS)
    for wants, signum in ranks:
        mine = [0.0] * (2 + stop.SLOTS)
        stop.fill(mine, 2, wants, signum)  # at an offset, as the loop puts the loss first
        total = [a + b for a, b in zip(total, mine, strict=True)]
    return stop.read(total, 2)


@pytest.mark.parametrize(
    ("ranks", "stops", "winner"),
    [
        ([(False, None), (False, None)], False, None),
        ([(True, None), (False, None)], True, None),  # the testing aid: no signal
        ([(True, TERM), (False, None)], True, TERM),
        ([(True, USR2), (True, TERM)], True, USR2),  # a warning wins over TERM
        ([(True, TERM), (True, USR2), (True, TERM)], True, USR2),  # whatever the count
        ([(True, USR1), (True, USR2)], True, USR2),
        ([(True, INT), (True, TERM)], True, TERM),
        ([(True, INT), (True, USR1)], True, USR1),
    ],
)
def test_the_rule_for_mixed_signals(ranks, stops, winner) -> None:
    agreed = _agree(*ranks)
    assert (agreed.stop, agreed.signum) == (stops, winner)


def test_each_signal_is_counted_in_its_own_slot() -> None:
    # Numbers are never summed: USR2 (12) + TERM (15) is not SIGALRM (14) twice over.
    agreed = _agree((True, USR2), (True, TERM), (True, TERM))
    assert agreed.received == {USR2: 1, TERM: 2}


# ---------------------------------------------------------------- real ranks

HOLD_STEP = 4


def _wait_held(folder: Path, procs: list[subprocess.Popen], logs) -> None:
    deadline = time.monotonic() + 240
    while not all((folder / f"held-{r}").exists() for r in range(2)):
        assert all(p.poll() is None for p in procs), logs()
        assert time.monotonic() < deadline, "the ranks never reached the held step\n" + logs()
        time.sleep(0.1)


def _rank_pids(launcher: int) -> dict[int, int]:
    """RANK → pid of torchrun's children."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            if int(stat[stat.rfind(")") + 2 :].split()[1]) != launcher:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
            rank = next(int(v[5:]) for v in env if v.startswith(b"RANK="))
            found[rank] = int(entry.name)
    return found


@pytest.mark.slow
def test_the_loop_records_the_warning_when_ranks_got_usr2_and_term(tmp_path: Path) -> None:
    spec = tiny_spec(
        tmp_path, "mixed", train={"steps": 50, "warmup_steps": 0}, checkpoint={"every_steps": 50}
    )
    held = tmp_path / "held"
    held.mkdir()
    run_dir = tmp_path / "mixed"
    argv = loop_argv(spec)
    env = {**child_env(), "SHARDCTL_HOLD_AT_STEP": f"{HOLD_STEP}:{held}"}
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    try:
        _wait_held(held, [proc], lambda: log.read_text()[-4000:])
        pids = _rank_pids(proc.pid)
        assert set(pids) == {0, 1}, pids
        os.kill(pids[0], signal.SIGUSR2)
        os.kill(pids[1], signal.SIGTERM)
        proc.wait(timeout=180)
    finally:
        kill_group(proc)
    text = log.read_text()
    assert f"exiting with code {EXIT_PREEMPTED}" in text, text[-4000:]
    marker = json.loads((run_dir / "PREEMPTED").read_text())
    assert marker == {
        "kind": "preempted",
        "step": HOLD_STEP,
        "signal": "SIGUSR2",
        "reason": "signal SIGUSR2",
    }


@pytest.mark.slow
def test_the_api_records_the_warning_when_ranks_got_usr2_and_term(tmp_path: Path) -> None:
    from test_api import _start_ranks, rank_logs, stopped_steps

    out = tmp_path / "out"
    out.mkdir()
    held = tmp_path / "held"
    held.mkdir()
    procs = _start_ranks(tmp_path, out, extra_env={"SHARDCTL_HOLD_AT_STEP": f"{HOLD_STEP}:{held}"})

    def warn_and_term() -> None:
        _wait_held(held, procs, lambda: rank_logs(out))
        os.kill(procs[0].pid, signal.SIGUSR2)
        os.kill(procs[1].pid, signal.SIGTERM)

    assert stopped_steps(procs, out, warn_and_term) == {HOLD_STEP}
    marker = json.loads((tmp_path / "run" / "PREEMPTED").read_text())
    assert marker == {
        "kind": "preempted",
        "step": HOLD_STEP,
        "signal": "SIGUSR2",
        "reason": "signal SIGUSR2",
    }
