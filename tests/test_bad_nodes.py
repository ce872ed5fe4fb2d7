"""Leaving bad nodes behind: which node a fault is pinned on, the bound, the record.

The Slurm side (a real requeue that excludes the host) is test_slurm_hang.py's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from shardctl.orchestrator.clusters.slurm.bad_nodes import (
    _run,
    choose,
    left_behind_detail,
    pinned_node,
    read_left_behind,
)
from shardctl.orchestrator.outcome import Kind, Outcome
from shardctl.orchestrator.rundir import LEFT_BEHIND_FILE


@pytest.mark.parametrize(
    ("outcome", "node"),
    [
        (Outcome(Kind.HUNG, step=20, rank=3, node=1), 1),
        # Every rank stopped together (a collective): nothing points at one node.
        (Outcome(Kind.HUNG, step=20, rank=None, node=1), None),
        (Outcome(Kind.HUNG), None),  # exit 124 without a marker
        (Outcome(Kind.FAILED, code=1, rank=3), None),
        # A rank killed on its node (the KILLED marker): by a node's signal only.
        (Outcome(Kind.FAILED, code=137, rank=3, node=1, signal="SIGKILL"), 1),
        (Outcome(Kind.FAILED, code=135, rank=3, node=0, signal="SIGBUS"), 0),
        (Outcome(Kind.FAILED, code=134, rank=3, node=1, signal="SIGABRT"), None),
        (Outcome(Kind.PREEMPTED, step=20, signal="SIGUSR2"), None),
    ],
)
def test_a_named_hang_or_a_rank_killed_on_its_node_pins_the_node(
    outcome: Outcome, node: int | None
) -> None:
    assert pinned_node(outcome) == node


def test_a_host_is_left_behind_while_the_partition_keeps_enough_nodes() -> None:
    pool = ["n1", "n2", "n3", "n4"]
    got = choose("n2", [], pool, needed=2)
    assert (got.excluded, got.exclude) == (True, ("n2",))
    got = choose("n3", ["n2"], pool, needed=2)
    assert (got.excluded, got.exclude) == (True, ("n2", "n3"))
    # A third would leave 1 node for a job of 2.
    got = choose("n4", ["n2", "n3"], pool, needed=2)
    assert (got.excluded, got.exclude) == (False, ("n2", "n3"))
    assert got.note == "kept: without n4 the partition has 1 node(s) for a job of 2"
    got = choose("n2", ["n2"], pool, needed=1)
    assert (got.excluded, got.note) == (False, "n2 is already excluded")
    # Slurm did not say which nodes the partition has (a busy controller): kept, or the
    # requeued job might exclude every node it could run on and wait forever.
    got = choose("n2", [], [], needed=1)
    assert (got.excluded, got.note) == (False, "kept: the partition's nodes could not be read")


def test_the_record_reads_back_per_job_and_skips_what_does_not_read(tmp_path: Path) -> None:
    lines = [
        {"host": "n1", "node": 0, "job": "7", "why": "hung at step 20", "excluded": True},
        {"host": "n2", "node": 1, "job": "7", "why": "hung at step 40", "excluded": False},
        {"host": "n3", "node": 0, "job": "8", "why": "hung at step 5", "excluded": True},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + "\n{torn\n[1, 2]\n"
    (tmp_path / LEFT_BEHIND_FILE).write_text(text)
    assert [e["host"] for e in read_left_behind(tmp_path)] == ["n1", "n2", "n3"]
    assert left_behind_detail(tmp_path, "7") == (
        "nodes: n1 left behind (hung at step 20); n2 kept (hung at step 40)"
    )
    assert left_behind_detail(tmp_path, "9") == ""
    assert read_left_behind(tmp_path / "missing") == []


def test_the_slurm_commands_of_node_0_outlive_the_requeues_sigterm(tmp_path: Path) -> None:
    """The requeue's SIGTERM reaches every process of the job, the `scontrol` node 0
    runs then too; one killed by it once left a hung node kept, "cannot tell the host
    of node 1". A command that gets SIGTERM while it runs still finishes."""
    code = "import os, signal, time; os.kill(os.getpid(), signal.SIGTERM); print('answered')"
    proc = _run([sys.executable, "-c", code])
    assert (proc.returncode, proc.stdout.strip()) == (0, "answered"), proc
    assert proc.args == [sys.executable, "-c", code]  # what it ran, without the wrapper
    # Node 0 itself is not made deaf: the command alone is.
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    # Without the wrapper the same command dies of the signal (the test can tell).
    bare = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    assert bare.returncode == -signal.SIGTERM
    # A command that cannot run is a failed one, not an exception.
    missing = _run([str(tmp_path / "no-such-command")])
    assert missing.returncode != 0


def _blocked(status: str) -> int:
    """The blocked-signal mask of a /proc/PID/status text."""
    return int(next(x for x in status.splitlines() if x.startswith("SigBlk:")).split()[1], 16)


def test_the_slurm_commands_of_node_0_are_deaf_to_sigterm_from_their_first_instant() -> None:
    """From a CI run: the requeue's SIGTERM landed while the command's shell started,
    before its trap, and killed it ("cannot tell the host of node 0"). The command starts
    with SIGTERM blocked (what its shell and it inherit from the fork on); node 0's own
    mask is as it was."""
    term = 1 << (signal.SIGTERM - 1)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    proc = _run(["cat", "/proc/self/status"])
    assert proc.returncode == 0, proc
    assert _blocked(proc.stdout) & term, proc.stdout
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
    assert signal.SIGTERM not in before  # the check above means something
    # The command alone: a plain child of node 0 is not started deaf.
    plain = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True)
    assert not _blocked(plain.stdout) & term
