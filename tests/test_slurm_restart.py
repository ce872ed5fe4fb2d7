"""Restarts inside the allocation on a real Slurm: a rank killed, later a rank stopped,
recovered in place both times (same job id, never requeued), the job COMPLETED.

2 emulated nodes × 1 CPU rank (gloo) of the dev cluster (`scripts/slurm-dev-cluster
up`; the session fixture of tests/test_slurm_cluster.py brings it up). Once the first
checkpoint exists, node 1's rank is SIGKILLed: torchrun on node 1 exits 1, node 0's
rank loses its peer; node 0 judges a crash with restarts left, writes RESTART, and
every node's task runs its launcher again (rendezvous again, a new attempt token);
the ranks resume from the checkpoint. Then node 1's restarted rank is SIGSTOPped: its
watchdog ends the ranks (124) and the same happens. The run finishes COMPLETED.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.recovery import recovered
from shardctl.orchestrator.clusters.base import JobRef, JobState
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from test_slurm_cluster import (  # the dev cluster's fixture and the e2e helpers
    _finished,
    _last_checkpoint,
    _spec,
    _submitted,
    _wait,
    slurm_cluster,  # noqa: F401  (a fixture)
)
from test_slurm_hang import _rank_of_node

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 400
EVERY = 20
HANG_TIMEOUT_S = 20


def _rank(run_dir: Path, node: int, restart: int) -> int | None:
    """The pid of the training rank node `node` runs in round `restart` of the run's
    first allocation."""
    found = _rank_of_node(run_dir, node, 0, restart=restart)
    return found[0] if found else None


def _rank0_out(ref: JobRef) -> str:
    """Both nodes' stdout (submitit's files): global rank 0, which says where it
    resumed, runs on whichever node the rendezvous made group 0."""
    text = ""
    for node in (0, 1):
        with contextlib.suppress(OSError):
            text += (Path(ref.extra["folder"]) / f"{ref.job_id}_{node}_log.out").read_text()
    return text


def test_a_killed_then_a_stopped_rank_recover_inside_the_allocation(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    spec = _spec(
        "restart-in-place",
        resources={"procs_per_node": 1},
        train={"steps": STEPS},
        checkpoint={"every_steps": EVERY, "keep": 2, "consolidate_on_finish": False},
        watchdog={"hang_timeout_s": HANG_TIMEOUT_S},
        restart={"max_in_allocation": 3},
        slurm={"time": "00:20:00"},
    )
    ref = _submitted(tmp_path, spec)
    run_dir = Path(ref.run_dir)
    cluster = SlurmCluster()
    stopped: list[int] = []
    took: list[float] = []
    try:
        _wait(ref, lambda: (_last_checkpoint(run_dir) or 0) >= EVERY, 480, "a checkpoint")
        killed = _wait(ref, lambda: _rank(run_dir, 1, 0), 90, "node 1's rank")
        fault = time.time()
        os.kill(killed, signal.SIGKILL)
        assert not (run_dir / "DONE").exists(), "the run ended before its rank was killed"
        # Both nodes run their launcher again; the restarted ranks log a step.
        back = recovered(run_dir, lambda: _rank0_out(ref), 1, fault)
        took.append(_wait(ref, back, 480, "the first restart's first step"))
        again = _wait(ref, lambda: _rank(run_dir, 1, 1), 90, "node 1's restarted rank")

        fault = time.time()
        os.kill(again, signal.SIGSTOP)
        stopped.append(again)
        back = recovered(run_dir, lambda: _rank0_out(ref), 2, fault)
        took.append(_wait(ref, back, HANG_TIMEOUT_S + 480, "the second restart's first step"))
        assert _rank(run_dir, 1, 2) is not None
        assert _finished(ref, timeout=600) is JobState.SUCCEEDED, cluster.logs(ref, tail=60)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if not cluster.status(ref).state.is_terminal:
            subprocess.run(["scancel", ref.job_id], timeout=30, check=False)
    print(f"fault -> first step of the restarted ranks on Slurm: {took[0]:.1f} s (SIGKILL), "
          f"{took[1]:.1f} s (SIGSTOP, hang timeout {HANG_TIMEOUT_S} s)")  # fmt: skip

    # Same job, never requeued (scontrol counts no restart), COMPLETED.
    status = cluster.status(ref)
    assert status.native_state == "COMPLETED" and "requeued" not in status.detail, status
    logs = cluster.logs(ref)
    assert "requeueing" not in logs, logs
    assert "restarting every rank in this allocation (1 of at most 3)" in logs, logs
    assert "restarting every rank in this allocation (2 of at most 3)" in logs, logs
    assert "node 1: " in logs and "node 0 restarts every node in place" in logs, logs
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", logs)]
    assert len(resumed) == 2 and all(s > 0 and s % EVERY == 0 for s in resumed), resumed
    attempts = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(a["job"], a["attempt"], a["restart"], a["kind"], a["decision"]) for a in attempts] == [
        (ref.job_id, 0, 0, "failed", "restart"),
        (ref.job_id, 0, 1, "hung", "restart"),
        (ref.job_id, 0, 2, "done", "finish"),
    ], attempts  # fmt: skip
    claimed = json.loads((run_dir / "CURRENT_ATTEMPT").read_text())
    assert claimed["token"] == f"slurm-{ref.job_id}-0-r2", claimed
    assert list((run_dir / "logs").glob("hang-attempt0-restart1-node1.txt"))
    assert (run_dir / "DONE").is_file()
