"""Rounds of restarts in place, agreed through the shared run dir (any cluster).

A crash or a hang with restarts left starts every node's launcher again in the same
allocation (`core.NodeAgent`). Node 0 decides each round and writes its decision to
the run dir's `RESTART` (`tell_round`); every other node waits for it
(`round_decision`), stops its launcher of the round if still running, and
acknowledges the end of the round with one file per node in `rounds/` (`ack_round`);
node 0 starts the next round once every node acknowledged it (`wait_for_acks`).

A round is named by the job, its allocation (Slurm: the requeue count) and its number
in that allocation; each round's attempt token is the cluster adapter's
(`Adapter.token`).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from ..durable import write_text_atomic
from ..outcome import Decision
from ..rundir import RESTART_FILE

# How long a node other than 0 waits for node 0's decision on a round: node 0's ranks
# may take a while to notice a lost peer (a collective's error, or node 0's own
# watchdog on a hang, the start-up allowance of 900 s at most).
ROUND_DECISION_WAIT_S = 1200.0
# How long node 0 waits, after deciding a restart, for every other node's launcher of
# the round to be gone (`ack_round`) before it starts the next round's: an old
# round's launcher still hosting or joining a rendezvous makes the new one fail.
ROUND_ACK_WAIT_S = 120.0
ROUNDS_DIR = "rounds"


def _ack_name(job_id: str, requeue: int, round_: int) -> str:
    return f"{job_id}-{requeue}-r{round_}.node"


def ack_round(run_dir: str, job_id: str, requeue: int, round_: int, node: int) -> None:
    """This node's launcher of the round is gone (a file per node in the run dir)."""
    folder = Path(run_dir) / ROUNDS_DIR
    with contextlib.suppress(OSError):
        folder.mkdir(exist_ok=True)
        (folder / f"{_ack_name(job_id, requeue, round_)}{node}").touch()


def wait_for_acks(
    run_dir: str, job_id: str, requeue: int, round_: int, nodes: int,
    wait_s: float = ROUND_ACK_WAIT_S,
) -> list[int]:  # fmt: skip
    """Node 0: wait until every other node acknowledged the end of the round; the
    nodes that did not within `wait_s` (their acknowledgements are then removed)."""
    folder = Path(run_dir) / ROUNDS_DIR
    prefix = _ack_name(job_id, requeue, round_)
    deadline = time.monotonic() + wait_s
    while True:
        missing = [n for n in range(1, nodes) if not (folder / f"{prefix}{n}").exists()]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    for n in range(1, nodes):
        with contextlib.suppress(OSError):
            (folder / f"{prefix}{n}").unlink()
    return missing


def tell_round(run_dir: str, job_id: str, requeue: int, round_: int, decision: str) -> None:
    """Node 0's decision on this round, for the other nodes (the run dir is shared)."""
    entry = {"job": job_id, "requeue": requeue, "restart": round_, "decision": decision}
    write_text_atomic(Path(run_dir) / RESTART_FILE, json.dumps(entry) + "\n", durable=False)


def round_decision(
    run_dir: str, job_id: str, requeue: int, round_: int, wait_s: float = ROUND_DECISION_WAIT_S
) -> str | None:
    """Node 0's decision on this round of this allocation, once it wrote it (None
    after `wait_s`: node 0 is gone; this node then ends as its own verdict says). A
    decision on a later round of the allocation says this one was a restart: node 0
    may have gone on without this node (a spare took its place) before it looked."""
    want = {"job": job_id, "requeue": requeue}
    deadline = time.monotonic() + wait_s
    while True:
        try:
            entry = json.loads((Path(run_dir) / RESTART_FILE).read_text())
        except (OSError, ValueError):
            entry = {}
        if isinstance(entry, dict) and all(entry.get(k) == v for k, v in want.items()):
            told = entry.get("restart")
            if told == round_:
                return str(entry.get("decision"))
            if isinstance(told, int) and told > round_:
                return Decision.RESTART.value
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)
