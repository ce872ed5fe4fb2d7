"""The node agent's loop: what runs on every node between the cluster and the launcher.

`NodeAgent.run` starts the node's launcher (its own session, the preemption signal
ignored: torchrun, accelerate and deepspeed have no handler for it and would die,
orphaning the ranks; the ranks install their own), passes the preemption signal
and SIGTERM on to every descendant that catches them (again every 2 s, so a rank
still importing torch when the signal came is not missed; whatever the cluster
sent, the ranks are told with USR2, or TERM for a TERM), with `watch_hangs` applies
the hang rule to the launchers below it (`hangs.py`: no watchdog process between;
a launcher ended as hung is the round's 124), and, once the launcher exited,
judges the round with the one classifier (`orchestrator/outcome.py`) from the
launcher's code, the round's markers (by its attempt token) and the signals received.

Rounds of restarts in place: a crash or a hang with restarts left
(`max_restarts`) is not handed to the cluster: node 0 judges the round, claims the
next round's token, writes its decision (`rounds.tell_round`) and runs its launcher
again; every other node whose launcher ended waits for that decision and runs its
launcher again too, and a node whose launcher is still in a round node 0 decided
kills its tree (KILL, not TERM: the ranks would take TERM for a stop and save) and
acknowledges it (`rounds.ack_round`); node 0 starts the next round once every node
did. Node 0 alone judges progress (a checkpoint newer than the round's start, by
step) and records each round in `attempts.jsonl`.

Anything else the verdict says is the cluster's to carry out (`Adapter.carry_out`).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from ..attempts import newest_step
from ..launch import PYTHON_VAR
from ..outcome import (
    MAX_ATTEMPTS_WITHOUT_PROGRESS,
    Decision,
    Evidence,
    attempt_progress,
    judge,
    record_attempt,
    rule_for,
)
from ..proctree import descendants, forward_to_catchers, signal_all
from ..proctree import proc as process_of
from ..rundir import (
    ENV_ATTEMPT_TOKEN,
    ENV_RESTART,
    EXIT_HUNG,
    FAILED_FILE,
    HUNG_FILE,
    KILLED_FILE,
)
from .adapter import Adapter
from .hangs import AgentHangs
from .rounds import ROUND_ACK_WAIT_S, ack_round, round_decision, tell_round, wait_for_acks

# How long a node whose launcher failed waits for rank 0's PREEMPTED marker.
MARKER_WAIT_S = 10.0
# How long node 0 waits for a HUNG that names the rank that stopped first, after one
# that names none (another node's agent declares a poll later, up to
# watchdog.MAX_POLL_S, and writes HUNG before it collects the stacks).
CULPRIT_WAIT_S = 15.0
# How long node 0, out of restarts, waits for the KILLED of a rank killed on another
# node after its own ranks lost their peer (that node's agent writes it within a poll
# of its launcher's exit): it decides between failing and leaving the node behind.
KILLED_WAIT_S = 5.0
# How often the agent looks at its launcher, the signals and node 0's decision.
POLL_S = 2.0

# `NodeAgent._judge`: this node runs its launcher again (a restart in place).
RESTARTED = "restarted"
# `NodeAgent.run` of a node that sat the allocation's last round out (a spare).
STOOD_BY = "stood by"


class Unread:
    """`first_start_step` not given: the agent reads it itself."""


UNREAD = Unread()


class NodeAgent:
    """One node's agent: runs `command` in rounds until the cluster's adapter
    carries a verdict out (see the module docstring)."""

    def __init__(
        self,
        adapter: Adapter,
        command: list[str],
        run_dir: str,
        *,
        signal_name: str = "USR2",
        checkpoint_dir: str | None = None,
        max_retries: int | None = None,
        max_stalled: int = MAX_ATTEMPTS_WITHOUT_PROGRESS,
        max_restarts: int = 0,
        marker_wait_s: float = MARKER_WAIT_S,
        first_start_step: int | Unread | None = UNREAD,
        watch_hangs: bool = False,
    ) -> None:
        self.adapter = adapter
        self.command = command
        self.run_dir = run_dir
        self.preempt_sig = signal.Signals[f"SIG{signal_name}"]
        self.checkpoint_dir = checkpoint_dir
        self.max_retries = max_retries
        self.max_stalled = max_stalled
        self.max_restarts = max_restarts
        self.marker_wait_s = marker_wait_s
        self.first_start_step = first_start_step
        self.received: list[int] = []
        self.forwarded: set[tuple[int, int]] = set()
        # The hang rule applied here, to every launcher whose launch.sh accepted
        # (`hangs.py`); Kubernetes' pods apply it through their adapter's `watch`.
        self.hangs = AgentHangs() if watch_hangs else None

    def run(self) -> str:
        """Run the node's rounds; the adapter's result (or its RuntimeError)."""
        try:
            return self._rounds()
        finally:
            if self.hangs is not None:
                self.hangs.close()

    def _rounds(self) -> str:
        node = self.adapter.node
        signal.signal(self.preempt_sig, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        # A cluster may start the agent with the signal blocked (Slurm's srun line): one
        # sent while it started is delivered now, to the handler (and the launcher,
        # started below, inherits it unblocked).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {self.preempt_sig})
        child_env = self._child_env()
        round_ = 0
        started = time.time()
        while True:
            # Every node derives this round's token; node 0 makes it the run's current
            # attempt before its ranks start (rank 0, the publisher, runs there): a rank
            # of an earlier start, round or job of this run can no longer publish.
            # (A later round's token is claimed before node 0 tells the others to go.)
            token = self.adapter.token(round_)
            if node == 0 and round_ == 0:
                self.adapter.claim(round_)
            # The newest checkpoint this round starts from, read once its token is
            # claimed: node 0 judges the round's progress by step, never by file time.
            start_step = self._start_step(round_) if node == 0 else None
            if token is None:  # a run outside a fenced attempt: its markers carry none
                child_env.pop(ENV_ATTEMPT_TOKEN, None)
            else:
                child_env[ENV_ATTEMPT_TOKEN] = token
            child_env[ENV_RESTART] = str(round_)
            if not self._takes_part(round_, child_env):
                # A spare standing by, or a bad node a spare replaced: no launcher here;
                # the round is over when node 0 decided it.
                if self._sit_out(round_) == Decision.RESTART.value:
                    round_ += 1
                    continue
                signal.signal(self.preempt_sig, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                return STOOD_BY
            again = f", restart {round_} in this allocation" if round_ else ""
            say(
                f"node {node} of job {self.adapter.job_id} (requeue {self.adapter.allocation}"
                f"{again}): running {shlex.join(self.command)}"
            )
            rc, superseded = self._round(child_env, round_)
            if superseded == Decision.RESTART.value:
                say(f"node {node}: node 0 restarts every node in place; this node's "
                    f"launcher of round {round_} was stopped")  # fmt: skip
                round_ += 1
                started = time.time()
                continue
            if rc not in (0, EXIT_HUNG) and not self.received and superseded is None:
                self._pin_killed(round_, started)
            result = self._judge(rc, started, round_, start_step)
            if result != RESTARTED:
                signal.signal(self.preempt_sig, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                return result
            round_ += 1
            started = time.time()

    def _takes_part(self, round_: int, child_env: dict[str, str]) -> bool:
        """Whether this node runs a launcher in this round: the adapter's
        `enter_round` (optional: a cluster without spares trains on every node) sets
        the round's variables, or says the node sits the round out. Only with restarts
        in place: node 0 then tells every round's end to the nodes sitting it out."""
        enter = getattr(self.adapter, "enter_round", None)
        return enter is None or not self.max_restarts or bool(enter(round_, child_env))

    def _sit_out(self, round_: int) -> str | None:
        """Wait, idle, for node 0's decision on a round this node sits out, and
        acknowledge it (node 0 starts the next round once every node did); None when
        the node was told to stop (SIGTERM: a cancel or the allocation's end)."""
        a = self.adapter
        say(f"node {a.node}: standing by in round {round_} (a spare, or a node a spare "
            "replaced)")  # fmt: skip
        while signal.SIGTERM not in self.received:
            decision = round_decision(self.run_dir, a.job_id, a.allocation, round_, 0.0)
            if decision is not None:
                ack_round(self.run_dir, a.job_id, a.allocation, round_, a.node)
                return decision
            time.sleep(POLL_S)
        return None

    def _spares_left(self) -> bool:
        """Whether the adapter still has a spare to put in a bad node's place."""
        return bool(getattr(self.adapter, "spares_left", 0))

    def _start_step(self, round_: int) -> int | None:
        """The newest complete checkpoint's step as this round starts (the first
        round's may be given: read by whoever claimed its token)."""
        if round_ == 0 and not isinstance(self.first_start_step, Unread):
            return self.first_start_step
        return newest_step(self.run_dir, self.checkpoint_dir)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        say(f"node {self.adapter.node}: got {signal.Signals(signum).name}; "
            "passing it to the ranks")  # fmt: skip

    def _outside_signal(self) -> None:
        """A preemption signal the cluster saw for this node counts as the agent's own."""
        if self.preempt_sig not in self.received and self.adapter.outside_signal(
            self.preempt_sig.name
        ):
            self.received.append(self.preempt_sig)

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # The launchers of the environment that runs the agent (torchrun, accelerate,
        # deepspeed live beside its python), whatever PATH the job inherited.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault(PYTHON_VAR, sys.executable)  # the node watchdog's interpreter
        self.adapter.prepare_env(env)
        if self.hangs is not None:
            self.hangs.offer(env)
        return env

    def _round(self, child_env: dict[str, str], round_: int) -> tuple[int, str | None]:
        """Run one round's launcher on this node: its code, and node 0's decision when
        it ended the round for this node (None otherwise)."""
        a = self.adapter
        # A node other than 0 whose launcher is still in this round (its ranks
        # waiting in a collective or a rendezvous) once node 0 has decided the
        # round's end stops it: it would hold up the next round until a timeout.
        follows = a.node != 0 and self.max_restarts > 0
        decided = partial(round_decision, self.run_dir, a.job_id, a.allocation, round_, 0.0)
        self._outside_signal()
        if self.hangs is not None:
            self.hangs.new_round()
        rc, superseded = self._launch(child_env, decided if follows else None, a.watch(round_))
        if follows:  # this node's launcher of the round is gone: node 0 may go on
            ack_round(self.run_dir, a.job_id, a.allocation, round_, a.node)
        return rc, superseded

    def _launch(
        self,
        child_env: dict[str, str],
        decided: Callable[[], str | None] | None,
        watch: Callable[[int], None] | None,
    ) -> tuple[int, str | None]:
        """Run the node's launcher to its end, passing signals on to the ranks; the
        launcher's code (`EXIT_HUNG` once the hang rule ended it, as the watchdog's
        exit said). With `decided`: once it returns node 0's decision on this round,
        the launcher and everything below it are killed (the round is over for every
        node), and the decision is returned beside the code."""
        preempt_sig = self.preempt_sig
        child = subprocess.Popen(
            self.command,
            env=child_env,
            start_new_session=True,
            # The launcher must survive the preemption signal; ranks catch it themselves.
            preexec_fn=lambda: signal.signal(preempt_sig, signal.SIG_IGN),
        )
        hung = False
        while True:
            try:
                rc = child.wait(timeout=POLL_S)
                return (EXIT_HUNG if hung else rc), None
            except subprocess.TimeoutExpired:
                pass
            if watch is not None:
                watch(child.pid)
            if self.hangs is not None:  # every poll: another node may declare later
                hung = self.hangs.look(child.pid) or hung
            self._outside_signal()
            decision = decided() if decided is not None and not self.received else None
            if decision is not None:
                # KILL, not TERM: the ranks would take TERM for a stop and save.
                tree = [process_of(child.pid), *descendants(child.pid)]
                signal_all(tree, signal.SIGKILL)
                return child.wait(), decision
            for signum in set(self.received) if self.adapter.forwards_signals else ():
                # The ranks stop on USR2 or TERM; whatever signal the cluster sent
                # (USR1, INT), they are told with USR2.
                to_ranks = signal.SIGTERM if signum == signal.SIGTERM else signal.SIGUSR2
                self.forwarded |= forward_to_catchers(child.pid, to_ranks, self.forwarded)

    def _pin_killed(self, round_: int, started: float) -> None:
        """Let the adapter pin a rank of this node killed by a node's signal, unless
        node 0 already judged this round without it (a late marker would be read as
        the next round's)."""
        a = self.adapter
        if a.node != 0 and round_decision(self.run_dir, a.job_id, a.allocation, round_, 0.0):
            return
        a.pin_killed(round_, started)

    def _judge(self, rc: int, started: float, round_: int, start_step: int | None) -> str:
        """The one classifier judges this node's end from the launcher's code, this
        round's markers and the signals received; node 0 runs a restart in place
        (within `max_restarts`, telling the other nodes through the run dir's
        RESTART); anything else is the adapter's to carry out. Progress is a
        checkpoint newer than `start_step`, the newest when the round started.
        `RESTARTED`: run the launcher again."""
        a = self.adapter
        node, many = a.node, a.nodes > 1
        evidence = Evidence.gather(
            self.run_dir, started, rc,
            # This round's markers: those its ranks and nodes wrote, by token.
            token=a.token(round_),
            signals=[signal.Signals(s).name for s in self.received],
            warning=self.preempt_sig.name,
            # Global rank 0 (which writes the markers) may run on another node, and this
            # node's ranks may have exited a moment before it wrote one.
            wait_s=self.marker_wait_s,
            # Node 0 judges for every node: the stopped rank's node names it.
            culprit_wait_s=CULPRIT_WAIT_S if node == 0 and many else 0.0,
            # Out of restarts, a crash pinned on another node is left behind there;
            # within them, one a spare can take over from is handed to the spare.
            killed_wait_s=KILLED_WAIT_S
            if node == 0 and many and (round_ >= self.max_restarts or self._spares_left())
            else 0.0,
        )  # fmt: skip
        # Node 0 carries the verdict out, so it alone judges progress and records the
        # attempt (the evidence of "no progress" for the attempts after it).
        progress = None
        if node == 0:
            progress = attempt_progress(self.run_dir, self.checkpoint_dir, start_step, a.job_id)
        verdict = judge(
            evidence, retries=a.retries, max_retries=self.max_retries,
            progress=progress, max_stalled=self.max_stalled,
            # Node 0 alone decides a restart; the others follow its RESTART.
            restarts=round_, max_restarts=self.max_restarts if node == 0 else None,
        )  # fmt: skip
        # A cluster that goes again its own way may decide for itself (optional
        # `Adapter.own_verdict`: Kubernetes' pods, which the operator restarts on their
        # exit code); the ledger records that decision.
        own_verdict = getattr(a, "own_verdict", None)
        if own_verdict is not None:
            verdict = own_verdict(verdict, evidence)
        if progress is not None:
            record_attempt(self.run_dir, a.job_id, verdict, progress, started, a.token(round_))
        a.judged(verdict, rc, round_)
        if node == 0 and self.max_restarts:
            if verdict.decision is Decision.RESTART:
                a.claim(round_ + 1)
            tell_round(self.run_dir, a.job_id, a.allocation, round_, verdict.decision.value)
        if verdict.decision is Decision.RESTART:
            return self._restart(verdict.summary(), round_)
        if node != 0 and self.max_restarts and rule_for(verdict.outcome).restart:
            decided = round_decision(self.run_dir, a.job_id, a.allocation, round_)
            if decided == Decision.RESTART.value:
                say(f"node {node}: {verdict.outcome.summary()}; node 0 restarts every "
                    "node in place")  # fmt: skip
                return RESTARTED
        return a.carry_out(verdict, evidence, rc, round_)

    def _restart(self, summary: str, round_: int) -> str:
        """Node 0 starts the next round: this round's markers go (its verdict is
        recorded) once every other node's launcher of it is gone."""
        a = self.adapter
        for name in (HUNG_FILE, KILLED_FILE, FAILED_FILE):
            (Path(self.run_dir) / name).unlink(missing_ok=True)
        say(f"node 0: {summary}; the other nodes start again too")
        missing = wait_for_acks(self.run_dir, a.job_id, a.allocation, round_, a.nodes)
        if missing:
            say(f"node 0: nodes {missing} did not end round {round_} within "
                f"{ROUND_ACK_WAIT_S:.0f} s; starting the next round anyway")  # fmt: skip
        return RESTARTED


def say(message: str) -> None:
    # The agent's stdout is the node's log file (Slurm: submitit's %j_%t_log.out).
    print(f"[shardctl] {message}", flush=True)
