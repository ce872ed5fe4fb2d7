"""Hot spares inside a Slurm allocation (`slurm.spare_nodes`).

The job holds `resources.nodes + spare_nodes` nodes. Each round of restarts in place
has a lineup: which Slurm node (its `SLURM_NODEID`) trains as each node rank. Round 0
trains on nodes 0..N-1 and the spares N.. stand by, idle (the node agent sits a round
out for a node outside the lineup, `SlurmAdapter.enter_round`). When node 0 restarts
in place after a fault pinned on a node rank other than 0 (a hang's stopped rank, a
killed rank: the evidence `bad_nodes` leaves a node behind on) and a spare is left,
the next round's lineup puts the first spare at that rank and benches the bad node
for the rest of the allocation: same job id, no requeue. Node 0 stays: it decides
every round and hosts the rendezvous, so a fault pinned on it is never handed to a
spare (it goes on as without spares).

A spare's ranks restore like every rank: from the newest tier that verifies. The
launcher's environment names the node ranks a spare just stood in for
(`FRESH_NODES_ENV`), so the memory tier serves them from the partner copies rather
than from the spare's own (empty) memory.

Node 0 writes each restart round's lineup into the run dir's `rounds/` before it
tells the other nodes to go (`rounds.tell_round`), so a node that reads the decision
finds its lineup; the bad node's replacement is one line of `nodes-left-behind.jsonl`
(with the round's token and the spare), which `status` reads. A requeue starts a new
allocation with the first lineup again (its files are named by the requeue count).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...durable import write_text_atomic
from ...rundir import LEFT_BEHIND_FILE
from .rounds import ROUNDS_DIR

# The node ranks a spare just stood in for, for the ranks' memory tier: their own
# node's memory is not asked, the partner copies serve them. The same name as
# `train/memory_partner.FRESH_NODES_ENV` (orchestrator/ imports nothing of train/;
# tests/test_slurm_spares.py keeps the two equal).
FRESH_NODES_ENV = "SHARDCTL_MEMORY_FRESH_NODES"


@dataclass(frozen=True)
class Lineup:
    """The Slurm node of each node rank in one round, and the nodes benched so far."""

    #: `ranks[p]`: the Slurm node index that trains as node rank p.
    ranks: tuple[int, ...]
    #: Every node of the allocation, spares included.
    total: int
    #: Nodes a fault was pinned on, replaced by a spare: they sit the allocation out.
    benched: tuple[int, ...] = ()

    @classmethod
    def first(cls, training: int, total: int) -> Lineup:
        """Round 0: nodes 0..training-1 train, the rest stand by."""
        return cls(tuple(range(training)), total)

    def rank_of(self, node: int) -> int | None:
        """The node rank `node` trains as, or None: it sits this round out."""
        return self.ranks.index(node) if node in self.ranks else None

    def spares(self) -> list[int]:
        """The nodes standing by, first in line first."""
        busy = set(self.ranks) | set(self.benched)
        return [n for n in range(self.total) if n not in busy]

    def fresh_since(self, previous: Lineup) -> list[int]:
        """The node ranks another node trains as than in `previous` (a spare that just
        stood in): their node's memory holds no copy of that rank's state."""
        old = previous.ranks
        return [p for p, n in enumerate(self.ranks) if p >= len(old) or old[p] != n]

    def replace(self, rank: int) -> Lineup | None:
        """The next round's lineup with the first spare at node rank `rank`; None when
        no spare is left or `rank` is 0 or not a node rank of this round."""
        spares = self.spares()
        if not spares or not 0 < rank < len(self.ranks):
            return None
        ranks = list(self.ranks)
        bad, ranks[rank] = ranks[rank], spares[0]
        return Lineup(tuple(ranks), self.total, (*self.benched, bad))


def _lineup_path(run_dir: str, job_id: str, requeue: int, round_: int) -> Path:
    return Path(run_dir) / ROUNDS_DIR / f"{job_id}-{requeue}-r{round_}.lineup"


def write_lineup(run_dir: str, job_id: str, requeue: int, round_: int, lineup: Lineup) -> None:
    """Node 0: the lineup of round `round_`, before it tells the other nodes to go."""
    path = _lineup_path(run_dir, job_id, requeue, round_)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"ranks": list(lineup.ranks), "total": lineup.total, "benched": list(lineup.benched)}
    write_text_atomic(path, json.dumps(entry) + "\n", durable=False)


def read_lineup(run_dir: str, job_id: str, requeue: int, round_: int, current: Lineup) -> Lineup:
    """The lineup node 0 wrote for round `round_`; `current` when it wrote none or it
    does not read (node 0 writes one for every restart round: the nodes then go on as
    they were rather than guess)."""
    try:
        entry = json.loads(_lineup_path(run_dir, job_id, requeue, round_).read_text())
        ranks = tuple(int(n) for n in entry["ranks"])
        benched = tuple(int(n) for n in entry.get("benched", ()))
        total = int(entry["total"])
    except (OSError, ValueError, TypeError, KeyError):
        return current
    return Lineup(ranks, total, benched)


@dataclass(frozen=True)
class Replacement:
    """A bad node replaced by a spare in round `round_` of one allocation."""

    job_id: str
    requeue: int
    round_: int
    token: str
    rank: int
    node: int
    spare: int
    why: str


def record_replacement(run_dir: str, r: Replacement, hosts: list[str]) -> str:
    """Write the replacement into the run dir's `nodes-left-behind.jsonl` (read by
    `status`) and return one line for node 0's log. `hosts`: the allocation's hosts
    by node index (empty when Slurm did not say)."""
    host, spare_host = (hosts[n] if n < len(hosts) else f"node {n}" for n in (r.node, r.spare))
    note = f"replaced by spare {spare_host} (node {r.spare}) in restart {r.round_}"
    entry: dict[str, Any] = {
        "host": host, "node": r.node, "rank": r.rank, "job": r.job_id,
        "requeue": r.requeue, "restart": r.round_, "token": r.token, "why": r.why,
        "excluded": False, "spare": {"node": r.spare, "host": spare_host}, "note": note,
        "time": time.time(),
    }  # fmt: skip
    with (Path(run_dir) / LEFT_BEHIND_FILE).open("a") as f:
        f.write(json.dumps(entry) + "\n")
    return (
        f"node {r.node} ({host}): {r.why}; spare node {r.spare} ({spare_host}) trains as "
        f"node rank {r.rank} from restart {r.round_}, {host} sits the allocation out"
    )
