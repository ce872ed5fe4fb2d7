"""Restarts inside the allocation, unit level: the policy (`outcome.decide`: a crash or
a hang restarts while `restart.max_in_allocation` allows, a preemption never; past the
bound a hang requeues and a crash stops; a crash loop stops after 3 attempts without a
new checkpoint, saying so), then Slurm's node task and job.sbatch's own shell with a
stand-in launcher (a new attempt token per round, each round in attempts.jsonl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.node_task_run import SCRIPT as NODE_TASK
from shardctl.orchestrator.outcome import Decision, Kind, Outcome, Progress, decide
from test_give_up import _job_sbatch, _stand_ins

CRASH = Outcome(Kind.FAILED, code=1)
HANG = Outcome(Kind.HUNG, step=25, node=1)
ADVANCED = Progress(step=40, advanced=True, stalled=0)


@pytest.mark.parametrize("outcome", [CRASH, HANG])
def test_a_crash_or_a_hang_restarts_in_place_while_restarts_are_left(outcome: Outcome) -> None:
    for made in (0, 1, 2):
        verdict = decide(outcome, restarts=made, max_restarts=3, progress=ADVANCED)
        assert verdict.decision is Decision.RESTART, verdict
        assert f"restarting every rank in this allocation ({made + 1} of at most 3)" in (
            verdict.summary()
        )
    # Without a bound (a supervisor that does not restart in place) nothing changes.
    assert decide(outcome).decision is not Decision.RESTART


def test_past_the_bound_a_hang_requeues_and_a_crash_stops() -> None:
    hang = decide(HANG, restarts=3, max_restarts=3, retries=0, max_retries=10)
    assert hang.decision is Decision.RETRY and hang.out_of_restarts
    assert "out of restarts in this allocation (3 of at most 3)" in hang.summary()
    crash = decide(CRASH, restarts=3, max_restarts=3, retries=0, max_retries=10)
    assert crash.decision is Decision.STOP and crash.out_of_restarts
    none = decide(CRASH, restarts=0, max_restarts=0)  # 0: no restart, nothing to say
    assert none.decision is Decision.STOP and "restart" not in none.summary()


def test_a_preemption_or_a_permanent_failure_is_never_restarted_in_place() -> None:
    saved = Outcome(Kind.PREEMPTED, step=20, signal="SIGUSR2")
    assert decide(saved, restarts=0, max_restarts=3).decision is Decision.RETRY
    permanent = Outcome(Kind.PERMANENT, code=78, rank=1)
    assert decide(permanent, restarts=0, max_restarts=3).decision is Decision.STOP
    cancelled = Outcome(Kind.CANCELLED, signal="SIGTERM")
    assert decide(cancelled, restarts=0, max_restarts=3).decision is Decision.STOP


def test_a_crash_loop_stops_with_its_reason_before_the_bound() -> None:
    stalled = Progress(step=20, advanced=False, stalled=3)
    verdict = decide(CRASH, restarts=2, max_restarts=10, progress=stalled)
    assert verdict.decision is Decision.STOP and verdict.no_progress
    assert verdict.summary() == (
        "failed: the launcher exited with code 1; stopped: no new checkpoint in 3 attempts "
        "(last at step 20)"
    )
    two = Progress(step=20, advanced=False, stalled=2)
    assert decide(CRASH, restarts=1, max_restarts=10, progress=two).decision is Decision.RESTART


# ----------------------------------------------------------------- the node task

# A stand-in launcher: the first round saves a new complete checkpoint and crashes,
# the second hangs (the watchdog's HUNG, 124), the third finishes; or it always crashes.
# A crash leaves a rank's FAILED marker (as `train/entry.py` does): explained at once,
# no wait for markers.
LAUNCHER = """#!/bin/bash
echo "token ${SHARDCTL_ATTEMPT_TOKEN} restart ${SHARDCTL_RESTART}" >> "${FAKE_RUN}/rounds"
round="$(wc -l < "${FAKE_RUN}/rounds")"
crash() { echo '{"kind": "failed", "code": 3, "rank": 1}' > "${FAKE_RUN}/FAILED"; exit 1; }
[ "${FAKE_END}" = crash-loop ] && crash
case "${round}" in
  1) mkdir -p "${FAKE_RUN}/checkpoints/step-00000040"
     echo '{}' > "${FAKE_RUN}/checkpoints/step-00000040/manifest.json"; crash ;;
  2) echo '{"kind": "hung", "step": 45, "node": 0}' > "${FAKE_RUN}/HUNG"; exit 124 ;;
  *) exit 0 ;;
esac
"""


def _node_task(tmp_path: Path, end: str, max_restarts: int) -> str:
    launch = tmp_path / "launch.sh"
    launch.write_text(LAUNCHER)
    env = {
        **os.environ,
        "PATH": f"{_stand_ins(tmp_path)}{os.pathsep}{os.environ['PATH']}",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "7",
        "SLURM_RESTART_COUNT": "0",
        "FAKE_OUT": str(tmp_path / "calls"),
        "FAKE_RUN": str(tmp_path),
        "FAKE_END": end,
    }
    proc = subprocess.run(
        [sys.executable, str(NODE_TASK), str(launch), str(tmp_path), str(max_restarts)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return proc.stdout + proc.stderr


def _attempts(run_dir: Path) -> list[tuple[int, str, str]]:
    lines = (run_dir / "attempts.jsonl").read_text().splitlines()
    return [(e["restart"], e["kind"], e["decision"]) for e in map(json.loads, lines)]


def test_node_task_restarts_in_place_then_finishes(tmp_path: Path) -> None:
    out = _node_task(tmp_path, "crash-then-hang", 3)
    assert "RESULT finished" in out, out
    assert not (tmp_path / "calls").exists()  # never requeued
    rounds = (tmp_path / "rounds").read_text().splitlines()
    assert rounds == ["token slurm-7-0 restart 0", "token slurm-7-0-r1 restart 1",
                      "token slurm-7-0-r2 restart 2"]  # fmt: skip
    assert _attempts(tmp_path) == [
        (0, "failed", "restart"), (1, "hung", "restart"), (2, "done", "finish"),
    ]  # fmt: skip
    claimed = json.loads((tmp_path / "CURRENT_ATTEMPT").read_text())
    assert claimed["token"] == "slurm-7-0-r2" and claimed["restart"] == 2
    told = json.loads((tmp_path / "RESTART").read_text())  # what the other nodes follow
    assert told == {"job": "7", "requeue": 0, "restart": 2, "decision": "finish"}


def test_node_task_past_the_bound_requeues_a_hang(tmp_path: Path) -> None:
    out = _node_task(tmp_path, "crash-then-hang", 1)
    assert "RESULT requeued" in out, out
    assert (tmp_path / "calls").read_text() == "requeue 7\n"
    assert _attempts(tmp_path) == [(0, "failed", "restart"), (1, "hung", "retry")]


def test_node_task_stops_a_crash_loop_saying_why(tmp_path: Path) -> None:
    out = _node_task(tmp_path, "crash-loop", 10)
    assert (
        "ERROR job 7: failed: rank 1 exited with code 3; stopped: no new checkpoint "
        "in 3 attempts (none yet); not requeued." in out
    ), out
    assert _attempts(tmp_path) == [
        (0, "failed", "restart"), (1, "failed", "restart"), (2, "failed", "stop"),
    ]  # fmt: skip
    assert not (tmp_path / "calls").exists()


# ----------------------------------------------------------------- job.sbatch


def test_job_sbatch_restarts_in_place_then_finishes(tmp_path: Path) -> None:
    # srun runs job.sbatch's node task here (one node), which runs launch.sh beside it.
    script, env = _job_sbatch(tmp_path, LAUNCHER, restarts_in_place=True)
    run_dir = tmp_path / "run"
    env["FAKE_END"] = "crash-then-hang"
    proc = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "restarting every rank in this allocation (2 of at most 3)" in proc.stdout
    assert not (tmp_path / "calls").exists()
    assert _attempts(run_dir) == [
        (0, "failed", "restart"), (1, "hung", "restart"), (2, "done", "finish"),
    ]  # fmt: skip
