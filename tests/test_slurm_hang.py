"""A hang on a real Slurm: the watchdog ends it, node 0 requeues, the run resumes.

2 emulated nodes × 1 CPU rank (gloo) of the dev cluster (`scripts/slurm-dev-cluster
up`; the session fixture of tests/test_slurm_cluster.py brings it up). Once the first
checkpoint exists, node 1's rank is stopped with SIGSTOP: its node's watchdog sees no
heartbeat for `watchdog.hang_timeout_s`, writes HUNG and the rank's stack, ends the
ranks (exit 124); node 0 requeues the job like a preemption; the next attempt resumes
from that checkpoint and the job COMPLETES. About 1.5 minutes on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from shardctl.orchestrator.clusters.base import JobRef, JobState
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from shardctl.orchestrator.clusters.slurm.bad_nodes import read_left_behind
from test_slurm_cluster import (  # the dev cluster's fixture and the e2e helpers
    _finished,
    _last_checkpoint,
    _spec,
    _steps,
    _submitted,
    _wait,
    slurm_cluster,  # noqa: F401  (a fixture)
)

# Waits are sized for a loaded machine and a shared dev cluster (other jobs may hold
# its nodes for a while): deadline-bounded polls, none a fixed sleep.
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 600
EVERY = 20
HANG_TIMEOUT_S = 20


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(w.decode(errors="replace").partition("=")[::2] for w in raw.split(b"\0") if w)


def _rank_of_node(
    run_dir: Path,
    node: int,
    attempt: int,
    restart: int | None = None,
    module: str = "shardctl.train",
) -> tuple[int, str] | None:
    """(pid, RANK) of the training rank that node `node` runs for `attempt` of the run
    (and, given `restart`, that round of restarts in place): the dev cluster's nodes are
    processes of this machine. A rank's own children (forked, same environment) are
    left out: the one whose parent is not one of them. `module`: what the rank runs
    (`-m shardctl.train`, the built-in loop; `shardctl.train.entry`, a user's script)."""
    found: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            env = _environ(pid)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in argv]
        if (
            "RANK" in env
            and os.path.realpath(env.get("SHARDCTL_RUN_DIR", "")) == os.path.realpath(run_dir)
            and env.get("SLURM_NODEID") == str(node)
            and env.get("SHARDCTL_ATTEMPT") == str(attempt)
            and (restart is None or env.get("SHARDCTL_RESTART") == str(restart))
            and module in words
        ):
            parent = int(stat[stat.rfind(")") + 2 :].split()[1])
            found[pid] = (parent, env["RANK"])
    ranks = [(pid, rank) for pid, (parent, rank) in found.items() if parent not in found]
    return ranks[0] if len(ranks) == 1 else None


def _is_rank(pid: int, run_dir: Path, attempt: int) -> bool:
    """`pid` is still that rank (not a reused number)."""
    with contextlib.suppress(OSError):
        env = _environ(pid)
        return os.path.realpath(env.get("SHARDCTL_RUN_DIR", "")) == os.path.realpath(
            run_dir
        ) and env.get("SHARDCTL_ATTEMPT") == str(attempt)
    return False


def _hung(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "HUNG").read_text())
    except (OSError, ValueError):
        return None


def test_a_stopped_rank_is_found_hung_requeued_and_the_run_resumes(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    ref, run_dir = _submit_hang_job(tmp_path, "hang-node1", nodes=2, steps=STEPS)
    cluster = SlurmCluster()
    stopped: int | None = None
    try:
        _wait(ref, lambda: (_last_checkpoint(run_dir) or 0) >= EVERY, 480, "a checkpoint")
        stopped, rank = _wait(ref, lambda: _rank_of_node(run_dir, 1, 0), 90, "node 1's rank")
        os.kill(stopped, signal.SIGSTOP)
        saved = _last_checkpoint(run_dir) or 0
        assert not (run_dir / "DONE").exists(), "the run ended before its rank was stopped"

        # Node 1's watchdog: no heartbeat for the hang timeout → HUNG, stacks, exit 124.
        hung = _wait(ref, lambda: _hung(run_dir), HANG_TIMEOUT_S + 120, "the HUNG marker")
        assert hung["attempt"] == 0 and hung["timeout_s"] == HANG_TIMEOUT_S, hung
        report = run_dir / "logs" / "hang-attempt0-node1.txt"
        _wait(ref, lambda: "Python stack" in _text(report), 90, "node 1's hang report")
        text = _text(report)
        assert f"rank {rank} (pid {stopped})" in text and "stopped (SIGSTOP)" in text, text
        assert "←" in text and "loop.py" in text, text  # named first; its stack
        assert "node 1: HUNG" in text, text

        # Node 0 requeues like a preemption; the next attempt resumes from the checkpoint.
        # (Resumed, the run lasts over 10 s: `status` sees it PENDING or RUNNING again.)
        again = _wait(
            ref,
            lambda: (
                (st := cluster.status(ref)).state in (JobState.PENDING, JobState.RUNNING)
                and "requeued 1 time" in st.detail
                and st
            ),
            240,
            "the requeue",
        )
        assert "last attempt hung at step" in again.detail, again
        assert "(see logs/hang-attempt0-node" in again.detail, again
        assert _finished(ref, timeout=480) is JobState.SUCCEEDED, cluster.logs(ref, tail=60)
    finally:
        _clean_up(ref, run_dir, stopped)

    logs = cluster.logs(ref)
    assert f"requeueing job {ref.job_id} (1 of at most" in logs, logs
    assert "hung at step" in logs, logs
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", logs)]
    assert len(resumed) == 1 and resumed[0] > 0, logs  # rank 0 says it, once
    # From the newest checkpoint: the one there when the rank stopped, or a later one
    # (continued for its stack, the rank may finish a step with node 0's before it is
    # frozen again).
    assert resumed[0] % EVERY == 0 and resumed[0] >= saved, (resumed, saved)
    # Node 0's watchdog sees its rank wait in a collective as long and declares the
    # hang too; HUNG stays node 1's, which names the stopped rank as the first.
    hung = _hung(run_dir)
    assert hung is not None and hung["attempt"] == 0, hung
    assert hung["node"] == 1 and hung["first"] == [int(rank)], hung
    assert (run_dir / "DONE").is_file()
    assert _steps(run_dir)[-1] == STEPS
    status = cluster.status(ref)
    assert status.state is JobState.SUCCEEDED and "requeued 1 time(s)" in status.detail
    # The hang was pinned on node 1, but the dev partition has 2 nodes for this job of 2:
    # none can be left behind, and status says so.
    (entry,) = read_left_behind(run_dir)
    assert (entry["node"], entry["excluded"]) == (1, False), entry
    assert "the partition has 1 node(s) for a job of 2" in entry["note"], entry
    assert f"{entry['host']} kept (hung at step" in status.detail, status.detail
    # The watchdogs held start-up (imports, restore, the first step) to its own
    # allowance (900 s), not to the 20 s hang timeout.
    assert "start-up allowance 900 s" in logs, logs


def _submit_hang_job(tmp_path: Path, name: str, *, nodes: int, steps: int) -> tuple[JobRef, Path]:
    """A job of `nodes` × 1 rank whose watchdog declares a hang after HANG_TIMEOUT_S,
    checkpointing every EVERY steps (no restart in place: `_spec`'s)."""
    spec = _spec(
        name,
        resources={"nodes": nodes, "procs_per_node": 1},
        train={"steps": steps},
        checkpoint={"every_steps": EVERY, "keep": 2, "consolidate_on_finish": False},
        watchdog={"hang_timeout_s": HANG_TIMEOUT_S},
    )
    ref = _submitted(tmp_path, spec)
    return ref, Path(ref.run_dir)


def _clean_up(ref: JobRef, run_dir: Path, stopped: int | None) -> None:
    """Whatever the test left: the rank it stopped (if still that rank) and the job."""
    if stopped is not None and _is_rank(stopped, run_dir, 0):
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)
            os.kill(stopped, signal.SIGKILL)
    if not SlurmCluster().status(ref).state.is_terminal:
        subprocess.run(["scancel", ref.job_id], timeout=30, check=False)


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        (signal.SIGSTOP, "hung at step"),  # the watchdog names the rank that stopped
        (signal.SIGKILL, "rank 0 was killed by SIGKILL on node 0"),  # the launcher does
    ],
    ids=["hung", "killed"],
)
def test_a_node_a_fault_is_pinned_on_is_left_behind_when_the_job_requeues(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
    fault: signal.Signals,
    why: str,
) -> None:
    """A one-node job on the two-node dev partition: its rank hangs, or is killed, node
    0 requeues the job excluding that node's host, and the job finishes on the other
    node."""
    ref, run_dir = _submit_hang_job(tmp_path, f"leave-{fault.name.lower()}", nodes=1, steps=60)
    cluster = SlurmCluster()
    stopped: int | None = None
    try:
        _wait(ref, lambda: (_last_checkpoint(run_dir) or 0) >= EVERY, 480, "a checkpoint")
        first_host = _job_field(ref.job_id, "NodeList")
        stopped, _ = _wait(ref, lambda: _rank_of_node(run_dir, 0, 0), 90, "the rank")
        os.kill(stopped, fault)
        _wait(ref, lambda: read_left_behind(run_dir), HANG_TIMEOUT_S + 150, "the decision")
        assert _finished(ref, timeout=480) is JobState.SUCCEEDED, cluster.logs(ref, tail=60)
    finally:
        _clean_up(ref, run_dir, stopped)

    (entry,) = read_left_behind(run_dir)
    assert (entry["host"], entry["node"], entry["excluded"]) == (first_host, 0, True), entry
    assert entry["why"].startswith(why), entry
    if fault is signal.SIGSTOP:
        assert "rank 0 stopped first" in entry["why"], entry
    # Slurm itself: the job excludes that host and ran its second attempt elsewhere.
    assert _job_field(ref.job_id, "ExcNodeList") == first_host
    assert _job_field(ref.job_id, "NodeList") not in ("", first_host)
    status = cluster.status(ref)
    assert status.state is JobState.SUCCEEDED, status
    assert f"nodes: {first_host} left behind ({why}" in status.detail, status.detail
    logs = cluster.logs(ref)
    assert f"left node 0 ({first_host}) behind" in logs, logs
    assert _steps(run_dir)[-1] == 60


def _job_field(job_id: str, key: str) -> str:
    """One field of `scontrol show job` (the controller keeps a finished job a while)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    ).stdout
    fields = dict(w.partition("=")[::2] for w in out.split() if "=" in w)
    return fields.get(key, "")
