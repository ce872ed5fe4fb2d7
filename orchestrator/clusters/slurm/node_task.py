"""The Slurm node task: what every node runs (`NodeTask`), as submitit's task under
`shardctl submit` and through `python -m shardctl.orchestrator.clusters.slurm` under
the standalone `job.sbatch`.

It runs the node's `launch.sh` (torchrun / accelerate launch / deepspeed) with node
rank and master address taken from Slurm at run time, passes the preemption signal
on to the ranks, and turns the launcher's end into the job's next state through
shardctl's one classifier (`shardctl.orchestrator.outcome`). The backend
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

Hangs. `launch.sh` runs the launcher under the node watchdog
(`shardctl.train.watchdog`). When no rank of a node advanced for the hang timeout,
that watchdog writes `HUNG` in the run directory, dumps every rank's stack to
`logs/hang-attempt<A>-node<N>.txt`, kills the ranks and exits `EXIT_HUNG` (124);
the other nodes' ranks lose their peers and their watchdogs exit 124 as well. A
hang is treated as a fault a retry may clear: a launch script that exits 124, or
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
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ...attempts import newest_step
from ...errors import ClusterError
from ...fence import claim_attempt
from ...launch import PYTHON_VAR
from ...outcome import (
    MAX_ATTEMPTS_WITHOUT_PROGRESS,
    Decision,
    Evidence,
    Kind,
    Outcome,
    Verdict,
    attempt_progress,
    judge,
    record_attempt,
    rule_for,
)
from ...proctree import descendants, forward_to_catchers, signal_all
from ...proctree import proc as process_of
from ...rundir import (
    ENV_ATTEMPT_TOKEN,
    ENV_NODE_SUPERVISOR,
    ENV_RESTART,
    EXIT_HUNG,
    FAILED_FILE,
    HUNG_FILE,
    KILLED_FILE,
    PREEMPTED_FILE,
)
from ..base import run_resources
from .bad_nodes import leave_behind, pinned_node
from .batch_signal import batch_warned
from .killed_ranks import record_killed
from .queries import scontrol_job
from .rank_nodes import RankRecorder
from .rounds import (
    ROUND_ACK_WAIT_S,
    ack_round,
    round_decision,
    round_token,
    tell_round,
    wait_for_acks,
)

# How long a node whose launcher failed waits for rank 0's PREEMPTED marker.
MARKER_WAIT_S = 10.0
# How long node 0 waits for a HUNG that names the rank that stopped first, after one
# that names none (another node's watchdog declares a poll later, up to
# watchdog.MAX_POLL_S, and writes HUNG before it collects the stacks).
CULPRIT_WAIT_S = 15.0
# How long node 0, out of restarts, waits for the KILLED of a rank killed on another
# node after its own ranks lost their peer (that node's task writes it within a poll
# of its launcher's exit): it decides between failing and leaving the node behind.
KILLED_WAIT_S = 5.0

# `NodeTask._after`: this node runs its launcher again (a restart inside the allocation).
RESTARTED = "restarted"


@dataclass(frozen=True)
class NodeTask:
    """What the submitit task on every node runs (pickled by reference).

    Runs the node's launch script and turns its end into the job's next state:
    returns when the node finished, requeues the job (node 0) after a
    preemption save or a hang, raises when the node failed. See the module docstring.
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

    def __call__(self) -> str:
        env = os.environ
        node = int(env.get("SLURM_NODEID", "0"))
        job_id = env.get("SLURM_JOB_ID", "?")
        restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
        preempt_sig = signal.Signals[f"SIG{self.signal_name}"]
        started = time.time()
        received: list[int] = []
        forwarded: set[tuple[int, int]] = set()

        def on_signal(signum: int, frame: Any) -> None:
            received.append(signum)
            _say(f"node {node}: got {signal.Signals(signum).name}; passing it to the ranks")

        # Replaces submitit's handlers (immediate requeue on rank 0) for this task.
        signal.signal(preempt_sig, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        # The srun line started this task with the signal blocked (`batch_signal`): one
        # sent while it started is delivered now, to the handler (and the launcher,
        # started below, inherits it unblocked).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {preempt_sig})

        def from_batch() -> None:
            # The batch shell got the signal (scancel --batch, --signal=B:...): as if
            # this task had, once per allocation.
            if preempt_sig not in received and batch_warned(self.run_dir, job_id, restarts):
                received.append(preempt_sig)
                _say(f"node {node}: got {preempt_sig.name} (sent to the batch shell); "
                     "passing it to the ranks")  # fmt: skip

        child_env = dict(env)
        # The launchers of the environment that runs this task (torchrun, accelerate,
        # deepspeed live beside its python), whatever PATH the job inherited.
        child_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        child_env.setdefault(PYTHON_VAR, sys.executable)  # the node watchdog's interpreter
        # submitit's own variables would make a rank's submitit think it is a task.
        for key in ("SUBMITIT_FOLDER", "SUBMITIT_EXECUTOR"):
            child_env.pop(key, None)
        # This task judges every attempt from the markers: the node watchdog need not
        # wait for another node's HUNG to turn a lost peer into its own 124.
        child_env[ENV_NODE_SUPERVISOR] = "slurm"
        # Which ranks this node runs (`logs --rank`): the rendezvous numbers by arrival.
        per_node = run_resources(self.run_dir).get("procs_per_node")
        # Rounds inside this allocation: a crash or a hang with restarts left starts
        # every node's launcher again here (no requeue); node 0 decides each round.
        round_ = 0
        while True:
            # Every node derives this round's token; node 0 makes it the run's current
            # attempt before its ranks start (rank 0, the publisher, runs there): a rank
            # of an earlier start, round or job of this run can no longer publish.
            # (A later round's token is claimed before node 0 tells the others to go.)
            token = round_token(job_id, restarts, round_)
            if node == 0 and round_ == 0:
                self._claim(job_id, restarts, round_)
            # The newest checkpoint this round starts from, read once its token is
            # claimed: node 0 judges the round's progress by step, never by file time.
            start_step = newest_step(self.run_dir, self.checkpoint_dir) if node == 0 else None
            child_env[ENV_ATTEMPT_TOKEN] = token
            child_env[ENV_RESTART] = str(round_)
            again = f", restart {round_} in this allocation" if round_ else ""
            _say(
                f"node {node} of job {job_id} (requeue {restarts}{again}): running "
                f"{shlex.join(self.command)}"
            )
            # A node other than 0 whose launcher is still in this round (its ranks
            # waiting in a collective or a rendezvous) once node 0 has decided the
            # round's end stops it: it would hold up the next round until a timeout.
            follows = node != 0 and self.max_restarts > 0
            decided = partial(round_decision, self.run_dir, job_id, restarts, round_, 0.0)
            ranks = RankRecorder(self.run_dir, job_id, restarts, round_, node, per_node)
            from_batch()
            rc, superseded = self._launch(
                child_env, preempt_sig, received, forwarded, decided if follows else None, ranks,
                from_batch,
            )  # fmt: skip
            if follows:  # this node's launcher of the round is gone: node 0 may go on
                ack_round(self.run_dir, job_id, restarts, round_, node)
            if superseded == Decision.RESTART.value:
                _say(f"node {node}: node 0 restarts every node in place; this node's "
                     f"launcher of round {round_} was stopped")  # fmt: skip
                round_ += 1
                started = time.time()
                continue
            if rc not in (0, EXIT_HUNG) and not received and superseded is None:
                self._pin_killed(node, job_id, restarts, round_, started)
            result = self._after(
                node, job_id, restarts, rc, received, preempt_sig, started, round_, start_step
            )
            if result != RESTARTED:
                signal.signal(preempt_sig, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                return result
            round_ += 1
            started = time.time()

    def _claim(self, job_id: str, restarts: int, round_: int) -> None:
        """Make this round's token the run's current attempt (node 0)."""
        claim_attempt(
            self.run_dir, round_token(job_id, restarts, round_), cluster="slurm", job_id=job_id,
            attempt=restarts, restart=round_,
        )  # fmt: skip

    def _pin_killed(
        self, node: int, job_id: str, restarts: int, round_: int, started: float
    ) -> None:
        """Record a rank of this node killed by a node's signal (KILLED), from the
        launcher's record of the round (`killed_ranks`), unless node 0 already judged
        this round without it (a late marker would be read as the next round's)."""
        if node != 0 and round_decision(self.run_dir, job_id, restarts, round_, 0.0):
            return
        said = record_killed(self.run_dir, node, started, round_token(job_id, restarts, round_))
        if said:
            _say(f"node {node}: {said}")

    def _launch(
        self,
        child_env: dict[str, str],
        preempt_sig: signal.Signals,
        received: list[int],
        forwarded: set[tuple[int, int]],
        decided: Callable[[], str | None] | None = None,
        ranks: RankRecorder | None = None,
        from_batch: Callable[[], None] | None = None,
    ) -> tuple[int, str | None]:
        """Run the node's launcher to its end, passing signals on to the ranks; the
        launcher's code. With `decided`: once it returns node 0's decision on this
        round, the launcher and everything below it are killed (the round is over
        for every node), and the decision is returned beside the code. `ranks`
        records the global ranks found below the launcher (`rank_nodes.py`);
        `from_batch` adds a signal the batch shell got to `received`."""
        child = subprocess.Popen(
            self.command,
            env=child_env,
            start_new_session=True,
            # The launcher must survive the preemption signal; ranks catch it themselves.
            preexec_fn=lambda: signal.signal(preempt_sig, signal.SIG_IGN),
        )
        while True:
            try:
                return child.wait(timeout=2.0), None
            except subprocess.TimeoutExpired:
                pass
            if ranks is not None:
                ranks.poll(child.pid)
            if from_batch is not None:
                from_batch()
            decision = decided() if decided is not None and not received else None
            if decision is not None:
                # KILL, not TERM: the ranks would take TERM for a stop and save.
                tree = [process_of(child.pid), *descendants(child.pid)]
                signal_all(tree, signal.SIGKILL)
                return child.wait(), decision
            for signum in set(received):
                # The ranks stop on USR2 or TERM; whatever `slurm.signal` Slurm sent
                # (USR1, INT), they are told with USR2.
                to_ranks = signal.SIGTERM if signum == signal.SIGTERM else signal.SIGUSR2
                forwarded |= forward_to_catchers(child.pid, to_ranks, forwarded)

    def _after(
        self,
        node: int,
        job_id: str,
        restarts: int,
        rc: int,
        received: list[int],
        preempt_sig: signal.Signals,
        started: float,
        round_: int = 0,
        start_step: int | None = None,
    ) -> str:
        """The one classifier (`shardctl.orchestrator.outcome`) judges this node's end
        from the launcher's code, this attempt's markers and the signals this task
        received; node 0 carries out a restart inside the allocation (within
        `max_restarts`, telling the other nodes through the run dir's RESTART) or a
        retry (requeue) within `max_requeues`; progress is a checkpoint newer than
        `start_step`, the newest when the round started. `RESTARTED`: run the launcher
        again."""
        evidence = Evidence.gather(
            self.run_dir, started, rc,
            # This round's markers: those its ranks and nodes wrote, by token.
            token=round_token(job_id, restarts, round_),
            signals=[signal.Signals(s).name for s in received],
            warning=preempt_sig.name,
            # Global rank 0 (which writes the markers) may run on another node, and this
            # node's ranks may have exited a moment before it wrote one.
            wait_s=MARKER_WAIT_S,
            # Node 0 judges for every node: the stopped rank's node names it.
            culprit_wait_s=CULPRIT_WAIT_S if node == 0 and _job_node_count() > 1 else 0.0,
            # Out of restarts, a crash pinned on another node is left behind there.
            killed_wait_s=KILLED_WAIT_S
            if node == 0 and _job_node_count() > 1 and round_ >= self.max_restarts
            else 0.0,
        )  # fmt: skip
        # Node 0 carries the verdict out, so it alone judges progress and records the
        # attempt (the evidence of "no progress" for the attempts after it).
        progress = None
        if node == 0:
            progress = attempt_progress(self.run_dir, self.checkpoint_dir, start_step, job_id)
        verdict = judge(
            evidence, retries=restarts, max_retries=self.max_requeues,
            progress=progress, max_stalled=self.max_stalled,
            # Node 0 alone decides a restart; the others follow its RESTART.
            restarts=round_, max_restarts=self.max_restarts if node == 0 else None,
        )  # fmt: skip
        if progress is not None:
            record_attempt(self.run_dir, job_id, verdict, progress, started)
        out = verdict.outcome
        if node == 0 and self.max_restarts:
            if verdict.decision is Decision.RESTART:
                self._claim(job_id, restarts, round_ + 1)
            tell_round(self.run_dir, job_id, restarts, round_, verdict.decision.value)
        if verdict.decision is Decision.RESTART:
            # This round's; its verdict is recorded.
            for name in (HUNG_FILE, KILLED_FILE, FAILED_FILE):
                (Path(self.run_dir) / name).unlink(missing_ok=True)
            _say(f"node 0: {verdict.summary()}; the other nodes start again too")
            missing = wait_for_acks(self.run_dir, job_id, restarts, round_, _job_node_count())
            if missing:
                _say(f"node 0: nodes {missing} did not end round {round_} within "
                     f"{ROUND_ACK_WAIT_S:.0f} s; starting the next round anyway")  # fmt: skip
            return RESTARTED
        if node != 0 and self.max_restarts and rule_for(out).restart:
            decided = round_decision(self.run_dir, job_id, restarts, round_)
            if decided == Decision.RESTART.value:
                _say(f"node {node}: {out.summary()}; node 0 restarts every node in place")
                return RESTARTED
        if verdict.no_progress and node == 0:
            raise RuntimeError(
                f"job {job_id}: {verdict.summary()}; not requeued. Fix the cause, then "
                "resubmit to resume from the newest complete checkpoint."
            )
        if out.kind is Kind.DONE:
            _say(f"node {node}: launcher finished")
            return "finished"
        if out.kind is Kind.CANCELLED:
            by = out.signal or "SIGTERM"
            _say(f"node {node}: stopped by {by} (cancel); launcher exit {rc}")
            return "terminated"
        if out.kind is Kind.PREEMPTED:
            saved = PREEMPTED_FILE in evidence.markers
            what = f"saved step {out.step}" if saved else "no new checkpoint"
            return self._retry(
                node, job_id, restarts, f"preempted ({what})", f"was preempted ({what})",
                result="preempted", resume="", out_of_retries=verdict.out_of_retries,
            )  # fmt: skip
        if out.kind is Kind.HUNG:
            # Nothing was saved: the next attempt resumes from the newest complete checkpoint.
            if HUNG_FILE in evidence.markers:
                what = f"hung at step {_or_q(out.step)} (node {_or_q(out.node)}'s watchdog)"
            else:
                what = f"hung (the launcher exited with {rc}; no HUNG marker)"
            why = f"hung at step {_or_q(out.step)}, rank {out.rank} stopped first"
            return self._retry_leaving_behind(node, job_id, restarts, out, verdict, what, why)
        if out.kind is Kind.PERMANENT:
            raise RuntimeError(f"node {node} of job {job_id}: {out.summary()}; not requeued.")
        if out.pinned and verdict.decision is Decision.RETRY:
            what = out.summary().removeprefix("failed: ")
            return self._retry_leaving_behind(node, job_id, restarts, out, verdict, what, what)
        code = f"; a rank exited with code {out.code}" if out.rank is not None else ""
        raise RuntimeError(
            f"node {node} of job {job_id}: the launcher exited with code {rc}{code}; the "
            "job failed. Resubmitting resumes from the newest complete checkpoint."
        )

    def _retry_leaving_behind(
        self, node: int, job_id: str, restarts: int, out: Outcome, verdict: Verdict,
        what: str, why: str,
    ) -> str:  # fmt: skip
        """A hang or a crash past the restarts in place: node 0 requeues (within
        `max_requeues`) and, when the fault is pinned on one node, leaves that node
        behind (`bad_nodes`); nothing was saved, the requeued job resumes from the
        newest complete checkpoint."""
        pinned = pinned_node(out) if node == 0 and not verdict.out_of_retries else None
        # Read before the requeue, which gives the nodes back.
        job = None
        if pinned is not None:
            with contextlib.suppress(ClusterError):
                job = scontrol_job(job_id)
        result = self._retry(
            node, job_id, restarts, what, what,
            result=out.kind.value, resume=" from the newest complete checkpoint",
            out_of_retries=verdict.out_of_retries,
        )  # fmt: skip
        if pinned is not None and job is not None and result == "requeued":
            _say("node 0: " + leave_behind(
                job_id=job_id, run_dir=self.run_dir, node=pinned, needed=_job_node_count(),
                why=why, job=job, requeue=restarts,
            ))  # fmt: skip
        return result

    def _retry(
        self, node: int, job_id: str, restarts: int, event: str, job_event: str,
        *, result: str, resume: str, out_of_retries: bool,
    ) -> str:  # fmt: skip
        """After a preemption or a hang (the classifier's RETRY): node 0 requeues the
        job, or fails it when the verdict says the retries are spent (`event`: what
        happened, for the log; `job_event`: the same after "job J"); the other nodes
        return `result` and leave it to node 0."""
        if node != 0:
            _say(f"node {node}: {event}; node 0 requeues the job")
            return result
        if out_of_retries:
            raise RuntimeError(
                f"job {job_id} {job_event} after {restarts} requeue(s), which is "
                f"slurm.max_requeues ({self.max_requeues}); not requeued. Resubmit to "
                f"resume{resume}."
            )
        then = f"; it resumes{resume}" if resume else ""
        _say(f"node 0: {event}; requeueing job {job_id} ({restarts + 1} of at most "
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
        _say(f"node 0: scontrol requeue {job_id}: {proc.stderr.strip()}")
    return "requeued"


def _say(message: str) -> None:
    # The task's stdout is the node's log file (submitit's %j_%t_log.out).
    print(f"[shardctl] {message}", flush=True)
