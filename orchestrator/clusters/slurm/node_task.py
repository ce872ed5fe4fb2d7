"""The Slurm node task: what every node runs (`NodeTask`), as submitit's task under
`shardctl submit` and through `python -m shardctl.orchestrator.clusters.slurm` under
the standalone `job.sbatch`.

It runs the node agent (`orchestrator/agent/`: the node's `launch.sh` started with
node rank and master address taken from Slurm at run time, the preemption signal
passed on to the ranks, the rounds of restarts in place, each round judged by
shardctl's one classifier, `shardctl.orchestrator.outcome`) with Slurm's adapter
(`SlurmAdapter`): the round tokens and their claim, the batch shell's signal, the
ranks each node runs, a killed rank pinned on its node, and the requeue that leaves a
bad node behind. The backend
(`SlurmCluster`, this package's `__init__`) submits it, one task per node; the
package re-exports it, so a job pickled by submitit under
`shardctl.orchestrator.clusters.slurm.NodeTask` still finds it.

Why not submitit's own checkpoint/requeue. submitit installs a handler for USR2
in every task process that, on global rank 0 only, calls the callable's
`checkpoint()` and requeues AT ONCE — the requeue kills the job while the ranks
(separate processes, started by the launcher) are still writing their shards —
and counts signals that come late in a job as time-outs against
`max_num_timeout`. So `NodeTask` replaces submitit's handlers while it runs:

- the launcher is started in its own session with the preemption signal
  ignored (torchrun, accelerate and deepspeed have no handler for USR2, so its
  default action would kill the launcher and orphan the ranks); the ranks
  install their own handler, which overrides the inherited "ignore";
- on the signal, the task forwards it to every descendant that catches it (the
  ranks), again every 2 s to ranks that installed their handler later, so a
  rank still importing torch when the signal came is not missed; a rank that
  also got it from Slurm sees one flag either way. The ranks stop on USR2 (and
  TERM): a `slurm.signal` of USR1 or INT reaches them ignored (inherited from
  the launcher) and is passed on as USR2;
- a signal that reached the batch shell alone (`scancel --batch`, `--signal=B:`),
  which the shell writes down, counts as this task's own, and one sent while this
  task started waits for its handler (`batch_signal.py`): neither ends the job FAILED;
- when the launcher has exited, shardctl's one classifier
  (`shardctl.orchestrator.outcome`) judges the attempt from the launcher's code,
  the markers and the signals this task received; node 0 carries it out:
  preempted (the warning came, or the ranks saved on it) → requeue; finished →
  done; anything else → the job fails (a dead node, a crash), and resubmitting
  resumes from the newest complete checkpoint. SIGTERM alone (`scancel`,
  `shardctl cancel`, or a Slurm preemption that requeues by itself), received by
  the task or recorded as the ranks' signal, is a cancel: never requeued. A
  script's exit 78 (it said do not retry) fails the job, and so does a retry after
  3 attempts in a row without a new complete checkpoint: node 0 records every
  attempt it judged in the run dir's `attempts.jsonl`, which `status` reads for
  the reason a FAILED job stopped.

Restarts inside the allocation. A crash (FAILED) or a hang (HUNG) with restarts left
(`restart.max_in_allocation`, counted per allocation) is not requeued: node 0 judges
the round, claims a new attempt token (`slurm-<job>-<requeue>-r<round>`), writes its
decision to the run dir's `RESTART`, and runs its launcher again; every other node
whose launcher ended waits for that decision and runs its launcher again too, so the
nodes rendezvous anew (same job id, same nodes). Past the bound the classifier's
decision applies as below (a hang requeues, a crash fails the job); three rounds or
attempts without a new complete checkpoint stop the job (a crash loop).

Hot spares (`slurm.spare_nodes`). The allocation holds spare nodes beside the
training nodes; their tasks stand by, idle, while the others train (the agent sits a
round out for a node outside the round's lineup, `SlurmAdapter.enter_round`). A fault
pinned on a training node other than node 0 makes node 0 put a spare in its place for
the next restart in place (`spares.py`); with none left, a fault goes on as below.

Hangs. The node agent applies the hang rule itself (`agent/hangs.py`: `launch.sh`
runs no watchdog under it). When no rank of a node advanced for the hang timeout,
that node's agent writes `HUNG` in the run directory, dumps every rank's stack to
`logs/hang-attempt<A>[-restart<R>]-node<N>.txt`, kills the launcher's tree and takes
the round's code for `EXIT_HUNG` (124); the other nodes' ranks lose their peers and
their agents read the round's HUNG. A
hang is treated as a fault a retry may clear: a launcher ended as hung, or
any failure with a `HUNG` written during this attempt, restarts in place while
restarts are left, then makes node 0 requeue the job exactly as after a
preemption, counted against `slurm.max_requeues` (the other nodes return "hung").
Nothing was saved: the next attempt resumes from the newest complete checkpoint. A
SIGTERM the task received is a cancel, never a hang. `status` names the step the
last attempt hung at, and says when a job that FAILED (out of requeues) hung.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from ...agent import NodeAgent, say
from ...errors import ClusterError
from ...fence import claim_attempt
from ...launch_wrapper import ENV_NODE_RANK
from ...outcome import (
    MAX_ATTEMPTS_WITHOUT_PROGRESS,
    Decision,
    Evidence,
    Kind,
    Outcome,
    Verdict,
)
from ...rundir import ENV_NODE_SUPERVISOR, HUNG_FILE, PREEMPTED_FILE
from ..base import run_resources
from .bad_nodes import hostnames, leave_behind, pinned_node
from .batch_signal import batch_warned
from .killed_ranks import record_killed
from .queries import scontrol_job
from .rank_nodes import RankRecorder
from .rounds import round_token
from .spares import (
    FRESH_NODES_ENV,
    Lineup,
    Replacement,
    read_lineup,
    record_replacement,
    write_lineup,
)


@dataclass(frozen=True)
class NodeTask:
    """What the submitit task on every node runs (pickled by reference).

    Runs the node's launch script under the node agent with Slurm's adapter and turns
    its end into the job's next state: returns when the node finished, requeues the
    job (node 0) after a preemption save or a hang, raises when the node failed. See
    the module docstring.
    """

    command: list[str]
    run_dir: str
    signal_name: str = "USR2"
    max_requeues: int = 10
    checkpoint_dir: str | None = None  # None: the run dir's checkpoints/
    max_stalled: int = MAX_ATTEMPTS_WITHOUT_PROGRESS
    # `restart.max_in_allocation`: rounds of every node's launcher after a crash or a
    # hang inside this allocation (0: none; the job fails or requeues at once).
    max_restarts: int = 0
    # `slurm.spare_nodes`: nodes of the allocation that stand by (`spares.py`).
    spare_nodes: int = 0

    def __call__(self) -> str:
        adapter = SlurmAdapter(self.run_dir, self.max_requeues, self.spare_nodes)
        agent = NodeAgent(
            adapter, self.command, self.run_dir, signal_name=self.signal_name,
            checkpoint_dir=self.checkpoint_dir, max_retries=self.max_requeues,
            max_stalled=self.max_stalled, max_restarts=self.max_restarts,
            # The hang rule, in the agent (the node's launch.sh runs no watchdog).
            watch_hangs=True,
        )  # fmt: skip
        return agent.run()


class SlurmAdapter:
    """Slurm's part of the node agent (`agent.Adapter`): where the node stands comes
    from Slurm's environment; "go again" is a requeue by node 0 that leaves a bad
    node behind."""

    cluster = "slurm"
    forwards_signals = True

    def __init__(self, run_dir: str, max_requeues: int, spare_nodes: int = 0) -> None:
        env = os.environ
        self.run_dir = run_dir
        self.max_requeues = max_requeues
        self.node = int(env.get("SLURM_NODEID", "0"))
        # Every node of the allocation, the spares too (they acknowledge each round).
        self.nodes = _job_node_count()
        self.spare_nodes = spare_nodes
        # Which node trains as which node rank this round (`spares.py`); without
        # spares, node i is node rank i in every round.
        self.lineup = Lineup.first(self.nodes - spare_nodes, self.nodes)
        self.rank = self.node
        self.job_id = env.get("SLURM_JOB_ID", "?")
        self.allocation = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
        self.retries = self.allocation
        # Which ranks this node runs (`logs --rank`): the rendezvous numbers by arrival.
        self.per_node = run_resources(run_dir).get("procs_per_node")

    def token(self, round_: int) -> str:
        return round_token(self.job_id, self.allocation, round_)

    def claim(self, round_: int) -> None:
        claim_attempt(
            self.run_dir, self.token(round_), cluster="slurm", job_id=self.job_id,
            attempt=self.allocation, restart=round_,
        )  # fmt: skip

    def prepare_env(self, env: dict[str, str]) -> None:
        # submitit's own variables would make a rank's submitit think it is a task.
        for key in ("SUBMITIT_FOLDER", "SUBMITIT_EXECUTOR"):
            env.pop(key, None)
        # The agent judges every attempt from the markers: the node watchdog need not
        # wait for another node's HUNG to turn a lost peer into its own 124.
        env[ENV_NODE_SUPERVISOR] = self.cluster

    def enter_round(self, round_: int, env: dict[str, str]) -> bool:
        """With spares: this round's lineup (node 0 wrote it before telling the nodes
        to go) gives this node's node rank to its launcher; False: it sits it out."""
        if not self.spare_nodes:
            return True
        previous = self.lineup
        if round_:
            self.lineup = read_lineup(
                self.run_dir, self.job_id, self.allocation, round_, self.lineup
            )
        rank = self.lineup.rank_of(self.node)
        if rank is None:
            return False
        self.rank = rank
        env[ENV_NODE_RANK] = str(rank)
        # Every node computes the same list: the ranks agree on where each restores from.
        fresh = self.lineup.fresh_since(previous)
        if fresh:
            env[FRESH_NODES_ENV] = ",".join(map(str, fresh))
        else:
            env.pop(FRESH_NODES_ENV, None)
        return True

    @property
    def spares_left(self) -> int:
        """Spares node 0 can still put in a bad node's place (the agent waits for a
        killed rank's KILLED while there are: it names the node to replace)."""
        return len(self.lineup.spares()) if self.spare_nodes and self.node == 0 else 0

    def outside_signal(self, signal_name: str) -> bool:
        # The batch shell got the signal (scancel --batch, --signal=B:...): as if the
        # agent had, once per allocation.
        if not batch_warned(self.run_dir, self.job_id, self.allocation):
            return False
        say(f"node {self.node}: got {signal_name} (sent to the batch shell); "
            "passing it to the ranks")  # fmt: skip
        return True

    def watch(self, round_: int) -> Callable[[int], None] | None:
        ranks = RankRecorder(
            self.run_dir, self.job_id, self.allocation, round_, self.node, self.per_node
        )
        return ranks.poll

    def pin_killed(self, round_: int, started: float) -> None:
        # The launcher's record and the marker name the node by its rank in the round.
        said = record_killed(self.run_dir, self.rank, started, self.token(round_))
        if said:
            say(f"node {self.node}: {said}")

    def judged(self, verdict: Verdict, rc: int, round_: int) -> None:
        """Node 0 (it recorded the verdict in the ledger), with spares, before a restart
        in place: the next round's lineup, a spare in the place of a node the fault is
        pinned on (`spares.py`), written before the other nodes are told to go."""
        if not (self.spare_nodes and self.node == 0 and verdict.decision is Decision.RESTART):
            return
        lineup, rank = self.lineup, pinned_node(verdict.outcome)
        replaced = lineup.replace(rank) if rank is not None else None
        try:
            write_lineup(self.run_dir, self.job_id, self.allocation, round_ + 1, replaced or lineup)
        except OSError as exc:
            # Every node then keeps this round's lineup: a restart as without spares.
            say(f"node 0: could not write the next round's lineup ({exc}); no spare used")
            return
        if replaced is not None and rank is not None:
            try:
                self._record_replacement(verdict.outcome, replaced, rank, round_)
            except OSError as exc:
                say(f"node 0: a spare replaces node rank {rank}; not recorded for status ({exc})")

    def _record_replacement(self, out: Outcome, replaced: Lineup, rank: int, round_: int) -> None:
        hosts = hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
        why = out.summary().removeprefix("failed: ")
        said = record_replacement(self.run_dir, Replacement(
            job_id=self.job_id, requeue=self.allocation, round_=round_ + 1,
            token=self.token(round_), rank=rank, node=self.lineup.ranks[rank],
            spare=replaced.ranks[rank], why=why,
        ), hosts)  # fmt: skip
        say(f"node 0: {said}")

    def carry_out(self, verdict: Verdict, evidence: Evidence, rc: int, round_: int) -> str:
        """Node 0 requeues (within `max_requeues`) or fails the job; the other nodes
        return and leave it to node 0."""
        node, job_id, out = self.node, self.job_id, verdict.outcome
        if verdict.no_progress and node == 0:
            raise RuntimeError(
                f"job {job_id}: {verdict.summary()}; not requeued. Fix the cause, then "
                "resubmit to resume from the newest complete checkpoint."
            )
        if out.kind is Kind.DONE:
            say(f"node {node}: launcher finished")
            return "finished"
        if out.kind is Kind.CANCELLED:
            by = out.signal or "SIGTERM"
            say(f"node {node}: stopped by {by} (cancel); launcher exit {rc}")
            return "terminated"
        if out.kind is Kind.PREEMPTED:
            saved = PREEMPTED_FILE in evidence.markers
            what = f"saved step {out.step}" if saved else "no new checkpoint"
            return self._retry(
                f"preempted ({what})", f"was preempted ({what})",
                result="preempted", resume="", out_of_retries=verdict.out_of_retries,
            )  # fmt: skip
        if out.kind is Kind.HUNG:
            # Nothing was saved: the next attempt resumes from the newest complete checkpoint.
            if HUNG_FILE in evidence.markers:
                what = f"hung at step {_or_q(out.step)} (node {_or_q(out.node)}'s watchdog)"
            else:
                what = f"hung (the launcher exited with {rc}; no HUNG marker)"
            why = f"hung at step {_or_q(out.step)}, rank {out.rank} stopped first"
            return self._retry_leaving_behind(out, verdict, what, why)
        if out.kind is Kind.PERMANENT:
            raise RuntimeError(f"node {node} of job {job_id}: {out.summary()}; not requeued.")
        if out.pinned and verdict.decision is Decision.RETRY:
            what = out.summary().removeprefix("failed: ")
            return self._retry_leaving_behind(out, verdict, what, what)
        code = f"; a rank exited with code {out.code}" if out.rank is not None else ""
        raise RuntimeError(
            f"node {node} of job {job_id}: the launcher exited with code {rc}{code}; the "
            "job failed. Resubmitting resumes from the newest complete checkpoint."
        )

    def _retry_leaving_behind(self, out: Outcome, verdict: Verdict, what: str, why: str) -> str:
        """A hang or a crash past the restarts in place: node 0 requeues (within
        `max_requeues`) and, when the fault is pinned on one node, leaves that node
        behind (`bad_nodes`); nothing was saved, the requeued job resumes from the
        newest complete checkpoint."""
        pinned = pinned_node(out) if self.node == 0 and not verdict.out_of_retries else None
        if pinned is not None:
            # The markers name a node by its rank in the round; Slurm by its index.
            pinned = self.lineup.ranks[pinned] if pinned < len(self.lineup.ranks) else None
        # Read before the requeue, which gives the nodes back.
        job = None
        if pinned is not None:
            with contextlib.suppress(ClusterError):
                job = scontrol_job(self.job_id)
        result = self._retry(
            what, what, result=out.kind.value,
            resume=" from the newest complete checkpoint",
            out_of_retries=verdict.out_of_retries,
        )  # fmt: skip
        if pinned is not None and job is not None and result == "requeued":
            say("node 0: " + leave_behind(
                job_id=self.job_id, run_dir=self.run_dir, node=pinned, needed=self.nodes,
                why=why, job=job, requeue=self.allocation,
            ))  # fmt: skip
        return result

    def _retry(
        self, event: str, job_event: str, *, result: str, resume: str, out_of_retries: bool
    ) -> str:
        """After a preemption or a hang (the classifier's RETRY): node 0 requeues the
        job, or fails it when the verdict says the retries are spent (`event`: what
        happened, for the log; `job_event`: the same after "job J"); the other nodes
        return `result` and leave it to node 0."""
        job_id, restarts = self.job_id, self.allocation
        if self.node != 0:
            say(f"node {self.node}: {event}; node 0 requeues the job")
            return result
        if out_of_retries:
            raise RuntimeError(
                f"job {job_id} {job_event} after {restarts} requeue(s), which is "
                f"slurm.max_requeues ({self.max_requeues}); not requeued. Resubmit to "
                f"resume{resume}."
            )
        then = f"; it resumes{resume}" if resume else ""
        say(f"node 0: {event}; requeueing job {job_id} ({restarts + 1} of at most "
            f"{self.max_requeues}){then}")  # fmt: skip
        return _requeue(job_id, job_event)


def _job_node_count() -> int:
    """The nodes of the job this task runs in (Slurm's environment)."""
    try:
        return int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES", "1"))
    except ValueError:
        return 1


def _or_q(value: int | None) -> str:
    return "?" if value is None else str(value)


def _requeue(job_id: str, what: str) -> str:
    """Node 0 puts the whole job back in the queue (`scontrol requeue`)."""
    try:
        proc = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60
        )
    except OSError as exc:
        # A pyxis image without the Slurm client: the job cannot requeue itself.
        # Failing says so in its state; resubmitting resumes from the saved step.
        raise RuntimeError(
            f"job {job_id} {what} but cannot requeue itself: {exc} "
            "(slurm.container: this image has no Slurm client). Resubmit to resume."
        ) from None
    if proc.returncode != 0:
        # E.g. a Slurm preemption already requeues it: say so, do not fail the node.
        say(f"node 0: scontrol requeue {job_id}: {proc.stderr.strip()}")
    return "requeued"
