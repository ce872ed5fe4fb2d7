"""What a cluster tells the node agent (`core.NodeAgent`): the `Adapter` protocol.

The agent is the same on every cluster: it starts the launcher, passes signals on,
runs the rounds of restarts in place (node 0 decides, the others follow) and judges
each round with the one classifier (`orchestrator/outcome.py`), recording node 0's
verdicts in the ledger (`attempts.jsonl`). What differs per cluster is small and
lives in its adapter:

- where this node stands: its index and the node count, the job and its allocation
  (Slurm: the requeue count), the retries so far (`node`, `nodes`, `job_id`,
  `allocation`, `retries`);
- the attempt token of each round and how it is claimed (`token`, `claim`);
- what the launcher's environment gets beside the agent's (`prepare_env`), and
  whether the agent passes signals on to the ranks (`forwards_signals`);
- a preemption signal that reached the node by another way (`outside_signal`),
  what to watch below the launcher while it runs (`watch`), a killed rank pinned
  on this node (`pin_killed`), what to keep of each round's verdict (`judged`);
- what "go again" means once a round's verdict is not a restart in place
  (`carry_out`): Slurm requeues the job and leaves a bad node behind, a local run
  returns its result, a Kubernetes pod exits with a code its operator acts on;
- optionally, the verdict itself (`own_verdict(verdict, evidence) -> Verdict`, called
  right after the classifier's, before the ledger records it), for a cluster whose
  bound on going again is its own (Kubernetes: restarts counted per pod, so a crash
  within it is a RETRY by the operator, never a restart in place).

A plugin cluster brings its own adapter and gets restarts in place, fencing, the
ledger and the verdicts with it. The agent imports no cluster module; each cluster
imports the agent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..outcome import Evidence, Verdict


class Adapter(Protocol):
    """One cluster's part of the node agent (see the module docstring)."""

    #: The cluster's name; also what the launcher's environment says judges above it.
    cluster: str
    node: int
    nodes: int
    job_id: str
    #: This allocation's number (Slurm: requeues so far); rounds are named by it.
    allocation: int
    #: Retries (requeues, resubmits) of this job so far, for the classifier's bound.
    retries: int
    #: Whether the agent passes the signals it gets on to the ranks (False where the
    #: cluster's own stop already signals every process of the run).
    forwards_signals: bool

    def token(self, round_: int) -> str | None:
        """The attempt token of this round, the same on every node (None: the run is
        not fenced; its markers carry no token)."""
        ...

    def claim(self, round_: int) -> None:
        """Make this round's token the run's current attempt (node 0, before its
        ranks start): a rank of an earlier round can no longer publish."""
        ...

    def prepare_env(self, env: dict[str, str]) -> None:
        """Set (or remove) the cluster's own variables of the launcher's environment."""
        ...

    def outside_signal(self, signal_name: str) -> bool:
        """True, once, when the preemption signal reached this node another way than
        to the agent itself (Slurm: the batch shell alone)."""
        ...

    def watch(self, round_: int) -> Callable[[int], None] | None:
        """Called every poll with the launcher's pid while it runs (or None)."""
        ...

    def pin_killed(self, round_: int, started: float) -> None:
        """After a launcher that failed: record a rank of this node killed by a
        node's signal (the KILLED marker), when the cluster can pin one."""
        ...

    def judged(self, verdict: Verdict, rc: int, round_: int) -> None:
        """Every round's verdict on this node, as soon as it is made (before a
        restart in place or `carry_out`)."""
        ...

    def carry_out(self, verdict: Verdict, evidence: Evidence, rc: int, round_: int) -> str:
        """Go again, or end, as the verdict says (anything but a restart in place,
        which the agent runs itself): the node's result, or raise RuntimeError with
        the one line that says why the job stops."""
        ...
