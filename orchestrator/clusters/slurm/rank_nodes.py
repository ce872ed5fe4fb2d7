"""Which node ran which global rank: recorded by each node task, read by `logs --rank`.

torchrun's rendezvous numbers the nodes by their arrival, not by Slurm's node index:
rank 0 may run on node 1. So `rank // procs_per_node` can name the wrong node. Each
node task, while its launcher runs, finds the rank processes below it (those whose
environment holds `RANK`: torchrun, accelerate and deepspeed set it for each rank) and
writes the global ranks it saw into the run dir (a shared file system), one file per
node of the job, `logs/rank-nodes/<job>-node<N>.json`:

    {"job", "requeue", "restart", "node", "host", "ranks", "time"}

rewritten whenever this node's set of ranks grows, and for each attempt and restart in
place (the rendezvous may number the nodes otherwise each time). `node_of_rank`
answers from the newest attempt that recorded the rank.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ...durable import write_text_atomic
from ...proctree import descendants
from ...rundir import LOGS_DIR

FOLDER = "rank-nodes"


def folder(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOGS_DIR / FOLDER


def ranks_below(root: int) -> set[int]:
    """The global ranks of the processes below `root` (a rank's own children share its
    `RANK`); a process that ended or hides its environment is skipped."""
    found: set[int] = set()
    for p in descendants(root):
        rank = _environ_rank(p.pid)
        if rank is not None:
            found.add(rank)
    return found


def _environ_rank(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for entry in raw.split(b"\0"):
        if entry.startswith(b"RANK="):
            value = entry[5:].decode(errors="replace")
            return int(value) if value.isdigit() else None
    return None


class RankRecorder:
    """This node's ranks of one attempt (or round), written when the set grows."""

    def __init__(
        self, run_dir: str, job_id: str, requeue: int, restart: int, node: int,
        per_node: int | None = None,
    ) -> None:  # fmt: skip
        # Once this many are seen, no more looking (`resources.procs_per_node`).
        self.per_node = per_node
        self.path = folder(run_dir) / f"{job_id}-node{node}.json"
        self.fields: dict[str, Any] = {
            "job": job_id,
            "requeue": requeue,
            "restart": restart,
            "node": node,
            "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0],
        }
        self.ranks: set[int] = set()

    def poll(self, launcher_pid: int) -> None:
        """Look for ranks below the launcher; record them when there are new ones. A
        failure to write is not the job's failure: `logs --rank` falls back."""
        if self.per_node is not None and len(self.ranks) >= self.per_node:
            return
        seen = ranks_below(launcher_pid)
        if seen <= self.ranks:
            return
        self.ranks |= seen
        record = {**self.fields, "ranks": sorted(self.ranks), "time": time.time()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps(record, sort_keys=True) + "\n", durable=False)
        except OSError:
            pass


def node_of_rank(run_dir: str | Path, job_id: str, rank: int) -> tuple[int, str] | None:
    """(node index, host) that ran global rank `rank` in the newest attempt of job
    `job_id` that recorded it; None when no node task recorded it (yet)."""
    best: tuple[tuple[int, int, float], int, str] | None = None
    for path in folder(run_dir).glob(f"{job_id}-node*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or rank not in (record.get("ranks") or []):
            continue
        node, host = record.get("node"), record.get("host")
        if not isinstance(node, int):
            continue
        when = (
            _int(record.get("requeue")),
            _int(record.get("restart")),
            float(record.get("time") or 0.0),
        )
        if best is None or when > best[0]:
            best = (when, node, str(host or "?"))
    return None if best is None else (best[1], best[2])


def _int(value: object) -> int:
    return value if isinstance(value, int) else -1
