"""A rank killed on this node, pinned there: read from its launcher's own record.

A rank the kernel's OOM killer or a bad page kills writes nothing, and only its
parent, the launcher, can wait for its exit status. So the rendered `launch.sh` runs
torchrun and `accelerate launch` in-process under `launch_wrapper`, which records
every failed rank of this node and attempt (global and local rank, pid, exit code or
signal) in the run dir as it is raised, not as it is printed: see that module for the
record and for why this is the structured source. After the launcher exits, the node
task reads its node's record of the round's token; a first failure killed by one of
`outcome.NODE_SIGNALS` becomes the run dir's KILLED marker, with this node's index and
host. The classifier reads it as a crash pinned on this node (`Outcome.pinned`), and
node 0 leaves the node behind when it requeues (`bad_nodes`).

Only the first KILLED of an attempt is kept (O_EXCL): the node whose rank was killed
reports first; a rank torchrun itself stops afterwards (TERM, then KILL after its
grace) is never the record's first failure. DeepSpeed's launcher is not wrapped
(`launch_wrapper`): a rank killed under it is not pinned.
"""

from __future__ import annotations

import signal
from typing import Any

from ...launch_wrapper import node_host, read_record
from ...outcome import NODE_SIGNALS, killed_marker
from ...rundir import KILLED_FILE, RunDir


def killed_rank(record: dict[str, Any]) -> tuple[int, int, int | None] | None:
    """(the global rank, the signal number, its pid) when the first failure of a
    launcher's `record` is a rank killed by one of `NODE_SIGNALS`; else None."""
    first = record.get("first")
    for failure in record.get("failures") or []:
        if not isinstance(failure, dict) or failure.get("rank") != first:
            continue
        code = failure.get("exitcode")
        if not isinstance(code, int) or isinstance(code, bool) or code >= 0:
            return None
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return None
        if name not in NODE_SIGNALS:
            return None
        pid = failure.get("pid")
        return int(first), -code, pid if isinstance(pid, int) else None
    return None


def record_killed(run_dir: str, node: int, started: float, token: str | None) -> str:
    """Pin a killed rank on this node when its launcher's record of attempt `token`
    names one: write KILLED, carrying the token (the first of this attempt wins), and
    return a line for the node's log; "" when nothing was killed here, the launcher
    wrote no record, or another node's KILLED came first."""
    if not token:
        return ""
    record = read_record(run_dir, token, node)
    found = killed_rank(record) if record is not None else None
    if record is None or found is None:
        return ""
    rank, signum, pid = found
    host = str(record.get("host") or node_host())
    marker = killed_marker(rank, node, host, signum)
    if not RunDir.of(run_dir).write_first_marker(KILLED_FILE, marker, started, token):
        return ""  # another node was first, or the run dir is unwritable
    process = f" (pid {pid})" if pid is not None else ""
    return f"rank {rank}{process} was killed by {signal.Signals(signum).name} on this node ({host})"
