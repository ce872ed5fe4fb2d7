"""A rank killed on this node, pinned there: read from the launcher's own report.

A rank the kernel's OOM killer or a bad page kills writes nothing, and the launcher
reports every end of a rank as its own exit 1. But torchrun prints which rank ended
first and how ("Root Cause": `rank : 3`, `exitcode : -9`) to its stderr, which on
Slurm is this node task's own log file. After the launcher exits, the node task reads
what the launcher wrote there during this attempt; a first rank killed by one of
`outcome.NODE_SIGNALS` becomes the run dir's KILLED marker, with this node's index
and host. The classifier reads it as a crash pinned on this node (`Outcome.pinned`),
and node 0 leaves the node behind when it requeues (`bad_nodes`).

Only the first KILLED of an attempt is kept (O_EXCL): the node whose rank was killed
reports first; a rank torchrun itself stops afterwards (TERM, then KILL after its
grace) is never a report's root cause.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

from ...launcher_output import root_cause
from ...outcome import NODE_SIGNALS, killed_marker, signal_name
from ...rundir import KILLED_FILE, RunDir

# How much of this attempt's log is read (the report is at its end).
TAIL_BYTES = 256 * 1024


def own_log() -> tuple[str, int] | None:
    """This process's stderr, when it is a regular file (Slurm's log of the task), and
    its size now: where the launcher's output of the coming attempt starts."""
    try:
        path = os.readlink("/proc/self/fd/2")
        st = os.stat(path)
    except OSError:
        return None
    if not Path(path).is_file():
        return None
    return path, st.st_size


def killed_rank(text: str) -> tuple[int | None, int] | None:
    """(the rank, the signal number) when the launcher's first reported root cause in
    `text` is a rank killed by one of `NODE_SIGNALS`; else None."""
    root = root_cause(text)
    if root is None or root[1] >= 0:
        return None
    if signal_name(-root[1]) not in NODE_SIGNALS:
        return None
    return root[0], -root[1]


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def record_killed(
    run_dir: str, node: int, log: tuple[str, int] | None, started: float, token: str | None = None
) -> str:
    """Pin a killed rank on this node when this attempt's part of `log` reports one:
    write KILLED, carrying the attempt's `token` (the first of this attempt wins), and
    return a line for the node's log; "" when nothing was killed here or another
    node's KILLED came first."""
    if log is None:
        return ""
    found = killed_rank(_read_from(*log))
    if found is None:
        return ""
    rank, signum = found
    # Slurm's name for this node (several emulated nodes can share one host).
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    marker = killed_marker(rank, node, host, signum)
    if not RunDir.of(run_dir).write_first_marker(KILLED_FILE, marker, started, token):
        return ""  # another node was first, or the run dir is unwritable
    who = f"rank {rank}" if rank is not None else "a rank"
    return f"{who} was killed by {signal.Signals(signum).name} on this node ({host})"
