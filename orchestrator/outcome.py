"""How an attempt ended, and whether to go again: the one classifier every supervisor calls.

Torch-free and dependency-free (it imports only `rundir` and `attempts`, the ledger of
attempts and their progress): the node agent (`orchestrator/agent`: the local
cluster's and the Slurm node task's, under submitit and under the standalone
`job.sbatch`), a supervisor of your own in bash (`python -m
shardctl.orchestrator.outcome`), every `status`, the ranks (`train/entry.py`, the loop,
`api`, the HF callback) and the node watchdog import it.

The ranks and the watchdog record a typed outcome as fields of the markers
(`kind` and its fields; `reason` stays, for display only):

    DONE        {"kind": "done", "step"}
    PREEMPTED   {"kind": "preempted", "step", "signal": "SIGUSR2" | "SIGTERM" | null,
                 "reason"}  — the ranks saved because of that signal (null: a testing
                 aid, or a user script's own exit 42); with `"saved": false` and
                 `"rank"`, that rank got the warning with no handler of its own and
                 nothing was saved (`train/entry.py`): still a preemption, requeued
    HUNG        {"kind": "hung", "step", "node", "rank": the rank that stopped first
                 (null: none stands out), ...}  — the node watchdog
    FAILED      {"kind": "failed", "code", "rank", "reason"?}  — a user script's own
                 exit (code 78, `EXIT_DO_NOT_RETRY`: the script said do not retry)
    KILLED      {"kind": "failed", "code": 128 + the signal, "rank", "node", "host",
                 "signal"}  — a rank killed by a signal that points at its node
                 (`NODE_SIGNALS`), from the record the launcher's own process wrote
                 (`launch_wrapper`; a killed rank writes nothing); written by the
                 node's supervisor (Slurm's node task)
    CANCELLED   {"kind": "cancelled"}  — `shardctl cancel` (local)

A supervisor gathers the evidence of one attempt (`Evidence`: the exit code, the
markers written during the attempt, the signals it received itself) and calls
`classify` (evidence → `Outcome`) and `decide` (outcome + retry budget → `Verdict`).
`classify` goes down `RULES`, first match wins; `decide` reads `POLICY`. The docs
(docs/guides/faults.md, "How an attempt ends") hold the same two tables for users.

Restarts inside the allocation: a crash (FAILED) or a hang (HUNG) is a RESTART while
the supervisor's `restarts` in this allocation are below `max_restarts`
(`restart.max_in_allocation`): every node starts its launcher again on the nodes the
job holds. Past the bound the row's decision applies (a hang: RETRY, a requeue on
Slurm; a crash: STOP, but a crash pinned on one node, a rank killed there by
SIGKILL, SIGBUS, SIGSEGV or SIGILL, is a RETRY: the requeue leaves that node behind).
A preemption is never restarted in place: it gives the allocation back (RETRY).

Knowing when to stop: a script's exit `EXIT_DO_NOT_RETRY` is a permanent failure
(STOP on every cluster). A retrying supervisor (Slurm) also records every attempt it
judged (`record_attempt`: `attempts.jsonl` in the run dir, with the newest complete
checkpoint read from the folder names and their manifests, torch-free) and passes
`stalled_attempts` to `decide`: `MAX_ATTEMPTS_WITHOUT_PROGRESS` attempts in a row of
one job that published no new complete checkpoint turn a RETRY or a RESTART into STOP
(the node agent records every round, restarts in place included, on every cluster
it runs on).

Markers written before this module (no `kind`, no `signal`) still read: the file
name gives the kind, and a PREEMPTED without `signal` counts as a preemption. No
rule reads the human `reason`.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

# The ledger moved to attempts.py; its names stay importable from here, as callers
# (the ranks, `status`, the tests) imported them before.
from .attempts import (  # noqa: F401
    CHECKPOINT_COMMIT,
    TRAINER_COMMIT,
    TRAINER_OUTPUT_FILE,
    Progress,
    attempt_progress,
    last_attempt,
    newest_checkpoint,
    newest_step,
    newest_trainer_checkpoint,
    record_attempt,
)
from .rundir import (
    CANCELLED_FILE,
    DONE_FILE,
    EXIT_CANCELLED,
    EXIT_DO_NOT_RETRY,
    EXIT_FAILED,
    EXIT_HUNG,
    EXIT_OK,
    EXIT_PREEMPTED,
    FAILED_FILE,
    HUNG_FILE,
    KILLED_FILE,
    PREEMPTED_FILE,
    TOKEN_FIELD,
    RunDir,
    attempt_token,
    belongs_to_attempt,
)

# The markers an attempt may leave, in the order they are read.
MARKER_FILES = (DONE_FILE, CANCELLED_FILE, PREEMPTED_FILE, HUNG_FILE, KILLED_FILE, FAILED_FILE)

# Signals by name, as the markers and supervisors record them. A warning: the cluster
# takes the allocation back (Slurm's `--signal`, a preemption's user signal); an end:
# a cancel, a pod's deletion, Ctrl-C (`shardctl.train.stop` says why a warning wins).
WARNINGS = ("SIGUSR2", "SIGUSR1")
ENDS = ("SIGTERM", "SIGINT")
# A rank killed by one of these points at its node, not at the code every rank runs:
# the kernel's OOM killer or an operator (KILL), a bad memory page or a file system
# gone (BUS), a driver's fault (SEGV, ILL). Not ABRT: gloo and NCCL abort the ranks
# that lost a peer, on the healthy nodes too. Not TERM or INT: a stop from outside.
NODE_SIGNALS = ("SIGKILL", "SIGBUS", "SIGSEGV", "SIGILL")

# Attempts in a row of one job that published no new complete checkpoint, after
# which a retry stops (NVIDIA's resiliency extension does the same on restarts
# without progress): a crash loop must not burn the whole retry budget.
MAX_ATTEMPTS_WITHOUT_PROGRESS = 3


class Kind(enum.StrEnum):
    DONE = "done"
    PREEMPTED = "preempted"
    CANCELLED = "cancelled"
    HUNG = "hung"
    FAILED = "failed"
    PERMANENT = "permanent"  # the script said do not retry (exit EXIT_DO_NOT_RETRY)
    UNKNOWN = "unknown"  # nothing recorded: no exit code, no marker


class Decision(enum.StrEnum):
    FINISH = "finish"  # the run is complete
    RETRY = "retry"  # go again and resume from the newest complete checkpoint
    # Start every rank again on the nodes the job holds (`restart.max_in_allocation`)
    # and resume from the newest complete checkpoint; no requeue, no new allocation.
    RESTART = "restart"
    STOP = "stop"  # do not go again by yourself (a person decides)


@dataclass(frozen=True)
class Rule:
    decision: Decision
    exit_code: int | None  # what `submit --wait` reports; None: the outcome's own code
    why: str
    # A crash or a hang: restarted inside the allocation while restarts are left,
    # before `decision` applies (a preemption gives the allocation back instead).
    restart: bool = False


# The policy: one row per kind (docs/guides/faults.md, "How an attempt ends", has the same table).
# A RETRY within the retry budget (Slurm: `slurm.max_requeues`) goes again; past it,
# the run stops. A row with `restart` first restarts inside the allocation, while
# `restart.max_in_allocation` allows; past that, its decision applies.
POLICY: dict[Kind, Rule] = {
    Kind.DONE: Rule(Decision.FINISH, EXIT_OK, "every step ran and the final checkpoint exists"),
    Kind.PREEMPTED: Rule(
        Decision.RETRY, EXIT_PREEMPTED, "the ranks saved a checkpoint on the cluster's signal"
    ),
    Kind.CANCELLED: Rule(
        Decision.STOP, EXIT_CANCELLED, "stopped from outside; the ranks saved what they could"
    ),
    Kind.HUNG: Rule(
        Decision.RETRY,
        EXIT_HUNG,
        "a node watchdog ended ranks that stopped advancing",
        restart=True,
    ),
    Kind.FAILED: Rule(
        Decision.STOP, None, "a crash or an error a retry would repeat", restart=True
    ),
    Kind.PERMANENT: Rule(
        Decision.STOP, EXIT_DO_NOT_RETRY, "the script said do not retry (a permanent error)"
    ),
    Kind.UNKNOWN: Rule(Decision.STOP, EXIT_FAILED, "nothing recorded how the attempt ended"),
}
# A crash pinned on one node (a rank killed there by one of `NODE_SIGNALS`): restarted
# in place like any crash; past the restarts a retry, since another node may not fail
# (Slurm's requeue leaves the node behind, `clusters/slurm/bad_nodes`). Locally there
# is no other node: a RETRY there stops, as a hang's does.
PINNED_CRASH = Rule(
    Decision.RETRY, None, "a rank killed by a signal on one node; another node may not fail",
    restart=True,
)  # fmt: skip


def rule_for(outcome: Outcome) -> Rule:
    """The policy row for `outcome`: its kind's, or `PINNED_CRASH`."""
    if outcome.kind is Kind.FAILED and outcome.pinned:
        return PINNED_CRASH
    return POLICY[outcome.kind]


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended (typed; `reason` and `marker` are for display only)."""

    kind: Kind
    step: int | None = None
    signal: str | None = None  # the signal that stopped it, by name ("SIGUSR2")
    rank: int | None = None  # failed: the rank that failed; hung: the one stuck first
    # hung: the node whose watchdog declared it; failed: the node a rank was killed on
    node: int | None = None
    code: int | None = None  # failed: the exit code (the rank's own when recorded)
    reason: str = ""
    marker: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def pinned(self) -> bool:
        """A crash pinned on one node: a rank killed there by one of `NODE_SIGNALS`."""
        return (
            self.kind is Kind.FAILED
            and self.node is not None
            and self.node >= 0  # a marker edited by hand names no node
            and self.signal in NODE_SIGNALS
        )

    @property
    def saved(self) -> bool:
        """False when a rank recorded that the stop signal found no handler to save
        (the marker's typed `saved`); True otherwise, markers before the field too."""
        return self.marker.get("saved") is not False

    def unsaved_why(self) -> str:
        """Which rank had no handler, for `summary` and `status` (typed fields only)."""
        rank = _int(self.marker.get("rank"))
        who = f"rank {rank}" if rank is not None else "a rank"
        what = self.signal or "the stop signal"
        return (
            f"{who} had no handler for {what}; the next attempt starts from the "
            "script's own last checkpoint, if it saved one"
        )

    def summary(self) -> str:
        """One line for a log or `status`."""
        at = f" at step {self.step}" if self.step is not None else ""
        sig = f" (signal {self.signal})" if self.signal else ""
        if self.kind is Kind.DONE:
            return f"finished{at}"
        if self.kind is Kind.PREEMPTED:
            if not self.saved:
                return f"preempted{sig}, nothing saved: {self.unsaved_why()}"
            saved = f", checkpoint saved{at}" if self.step is not None else ", checkpoint saved"
            return f"preempted{sig}{saved}"
        if self.kind is Kind.CANCELLED:
            return f"cancelled{sig}" + (f"; checkpoint at step {self.step}" if at else "")
        if self.kind is Kind.HUNG:
            where = f" (node {self.node}'s watchdog)" if self.node is not None else ""
            return f"hung{at}{where}"
        if self.kind is Kind.PERMANENT:
            who = f"rank {self.rank}" if self.rank is not None else "the launcher"
            why = f": {self.reason}" if self.reason else ""
            return f"the script said do not retry ({who} exited with code {self.code}){why}"
        if self.kind is Kind.FAILED and self.pinned:
            who = f"rank {self.rank}" if self.rank is not None else "a rank"
            host = self.marker.get("host")
            where = f"node {self.node}" + (f" ({host})" if isinstance(host, str) else "")
            return f"failed: {who} was killed by {self.signal} on {where}"
        if self.kind is Kind.FAILED:
            who = f"rank {self.rank}" if self.rank is not None else "the launcher"
            why = f": {self.reason}" if self.reason else ""
            return f"failed: {who} exited with code {self.code}{why}"
        return "ended without a record (no exit code, no marker)"


# ----------------------------------------------------------------- writing markers


def signal_name(signum: int | None) -> str | None:
    """A signal number as the markers record it ("SIGUSR2"), None for none."""
    if signum is None:
        return None
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


def done_marker(step: int | None) -> dict[str, Any]:
    return {"kind": Kind.DONE.value, "step": step, "time": time.time()}


def preempted_marker(step: int | None, signum: int | None, reason: str) -> dict[str, Any]:
    return {
        "kind": Kind.PREEMPTED.value,
        "step": step,
        "signal": signal_name(signum),
        "reason": reason,
    }


def failed_marker(code: int, rank: int, reason: str = "") -> dict[str, Any]:
    marker = {"kind": Kind.FAILED.value, "code": code, "rank": rank, "time": time.time()}
    return {**marker, "reason": reason} if reason else marker


def unsaved_marker(signum: int, rank: int) -> dict[str, Any]:
    """A rank got the stop signal `signum` while its code had no handler for it: a
    preemption (requeued) in which nothing was saved (PREEMPTED, `"saved": false`)."""
    name = signal_name(signum)
    return {
        **preempted_marker(None, signum, f"{name} reached rank {rank}, which had no handler"),
        "saved": False, "rank": rank, "time": time.time(),
    }  # fmt: skip


def killed_marker(rank: int | None, node: int, host: str, signum: int) -> dict[str, Any]:
    """A rank killed by signal `signum` on `node` (its launcher's report), for KILLED."""
    return {
        "kind": Kind.FAILED.value, "code": 128 + signum, "rank": rank, "node": node,
        "host": host, "signal": signal_name(signum), "time": time.time(),
    }  # fmt: skip


def cancelled_marker() -> dict[str, Any]:
    return {"kind": Kind.CANCELLED.value, "time": time.time()}


# ----------------------------------------------------------------- reading markers


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def from_marker(name: str, data: Mapping[str, Any]) -> Outcome:
    """The outcome a marker records; read defensively (a marker edited by hand or
    written before the `kind` field must not break a supervisor)."""
    kinds = {
        DONE_FILE: Kind.DONE, PREEMPTED_FILE: Kind.PREEMPTED, HUNG_FILE: Kind.HUNG,
        FAILED_FILE: Kind.FAILED, KILLED_FILE: Kind.FAILED, CANCELLED_FILE: Kind.CANCELLED,
    }  # fmt: skip
    kind = kinds.get(name, Kind.UNKNOWN)
    written = data.get("kind")
    if written in Kind.__members__.values() and written != Kind.UNKNOWN.value:
        kind = Kind(written)
    rank = _int(data.get("rank"))
    if kind is Kind.HUNG and rank is None:  # a watchdog's marker before the `rank` field
        first = data.get("first")
        rank = _int(first[0]) if isinstance(first, list) and first else None
    return Outcome(
        kind=kind,
        step=_int(data.get("step")),
        signal=_str(data.get("signal")),
        rank=rank,
        node=_int(data.get("node")),
        code=_int(data.get("code")),
        reason=str(data.get("reason") or ""),
        marker=dict(data),
    )


@dataclass(frozen=True)
class Evidence:
    """What a supervisor knows about one attempt."""

    # The launcher's (or node's, or whole job's) exit code; None when none was recorded.
    exit_code: int | None
    # The markers written during this attempt, by file name (older ones left out).
    markers: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # The signals the supervisor itself received during the attempt, by name.
    signals: Sequence[str] = ()
    # The name of the signal the cluster warns with (Slurm: `slurm.signal`); the
    # names of WARNINGS count as warnings too.
    warning: str | None = None
    # The attempt's token (fence.py): a marker carrying another token is not this
    # attempt's, and a DONE carrying this one was written by this attempt's ranks.
    token: str | None = None

    @classmethod
    def gather(
        cls,
        run_dir: str | Path,
        since: float | None,
        exit_code: int | None,
        *,
        signals: Sequence[str] = (),
        warning: str | None = None,
        wait_s: float = 0.0,
        culprit_wait_s: float = 0.0,
        killed_wait_s: float = 0.0,
        token: str | None = None,
    ) -> Evidence:
        """Read this attempt's markers: those carrying its `token` (None: this process's
        `SHARDCTL_ATTEMPT_TOKEN`, if any), and those without a token written at or after
        `since` (`rundir.belongs_to_attempt`; `since` None: every marker there). With
        `wait_s`, a failed launcher that nothing explains yet waits that long for
        PREEMPTED, HUNG or FAILED: rank 0 (which writes them) may run on
        another node and end a moment later. With `culprit_wait_s` (a job of several
        nodes), a HUNG that names no rank waits that long for one that does: every
        node's watchdog sees the same idle time, and the one whose rank stopped first
        may declare a poll later than a node whose ranks wait in a collective. With
        `killed_wait_s`, a crash that no KILLED explains waits that long for one: the
        node whose rank was killed writes it once its launcher has reported, and this
        node's ranks may have lost their peer and ended first."""
        folder = RunDir.of(run_dir)
        token = token or attempt_token()

        def read() -> Evidence:
            markers = _read_markers(folder, since, token)
            return cls(exit_code, markers, tuple(signals), warning, token)

        evidence = read()
        waits = (
            (wait_s, cls._unexplained), (culprit_wait_s, cls._unpinned),
            (killed_wait_s, cls._crash_unpinned),
        )  # fmt: skip
        for wait, pending in waits:
            deadline = time.monotonic() + wait
            while wait > 0 and pending(evidence) and time.monotonic() < deadline:
                time.sleep(0.5)
                evidence = read()
        return evidence

    def _unexplained(self) -> bool:
        explained = (PREEMPTED_FILE, HUNG_FILE, KILLED_FILE, FAILED_FILE, CANCELLED_FILE)
        return (
            self.exit_code not in (None, EXIT_OK, EXIT_HUNG)
            and not self.signals
            and not any(name in self.markers for name in explained)
        )

    def _unpinned(self) -> bool:
        hung = self.outcome_of(HUNG_FILE)
        return hung is not None and hung.rank is None

    def _crash_unpinned(self) -> bool:
        out = classify(self)
        return out.kind is Kind.FAILED and not out.pinned

    def outcome_of(self, name: str) -> Outcome | None:
        data = self.markers.get(name)
        return from_marker(name, data) if data is not None else None

    def done_by_this_attempt(self) -> bool:
        """A DONE that carries this attempt's token: its ranks wrote it (never a time
        match: another attempt may have ended in the same second)."""
        done = self.markers.get(DONE_FILE)
        return bool(self.token) and done is not None and done.get(TOKEN_FIELD) == self.token

    def warned(self) -> str | None:
        """The warning signal the supervisor received, if any."""
        return next((s for s in self.signals if s == self.warning or s in WARNINGS), None)


def _read_markers(
    folder: RunDir, since: float | None, token: str | None
) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for name in MARKER_FILES:
        if since is not None:
            data = folder.fresh_marker(name, since, token)
        else:  # no start known: every marker, but never one of another attempt's token
            data = folder.read_marker(name)
            written_by = data.get(TOKEN_FIELD) if data is not None else None
            if token and isinstance(written_by, str) and written_by and written_by != token:
                data = None
        if data is None and name == CANCELLED_FILE and _unreadable(folder, name):
            # An older version's `cancel` wrote a timestamp, not JSON (no token): the
            # time rule, the fallback for tokenless evidence of older versions.
            mtime = (folder.root / name).stat().st_mtime
            stale = since is not None and not belongs_to_attempt(None, mtime, since, None)
            data = None if stale else {}
        if data is not None:
            found[name] = data
    return found


def _unreadable(folder: RunDir, name: str) -> bool:
    """Whether marker `name` is there but holds no JSON object (an older version's)."""
    return (folder.root / name).exists() and folder.read_marker(name) is None


# ----------------------------------------------------------------- the classifier


def _saved(ev: Evidence) -> Outcome | None:
    return ev.outcome_of(PREEMPTED_FILE)


def _rule_exit_ok(ev: Evidence) -> Outcome | None:
    if ev.exit_code != EXIT_OK:
        return None
    done = ev.outcome_of(DONE_FILE)
    return Outcome(Kind.DONE, step=done.step if done else None)


def _rule_finished_before_the_stop(ev: Evidence) -> Outcome | None:
    # DONE is written after the last step (and consolidation): a cancel or a signal
    # that reached the ranks only while they shut down stopped nothing of the run.
    done = ev.outcome_of(DONE_FILE)
    if done is None or any(name in ev.markers for name in (FAILED_FILE, HUNG_FILE)):
        return None
    if CANCELLED_FILE not in ev.markers and not ev.signals:
        return None
    return Outcome(Kind.DONE, step=done.step)


def _rule_done_then_launcher_failed(ev: Evidence) -> Outcome | None:
    # This attempt's ranks wrote DONE (its token, not a time), none failed or hung, and
    # a launcher still ended non-zero: the work is complete. Another node's launcher
    # that held the rendezvous store finished first and took the store with it, which
    # fails torchrun's shutdown on the nodes still leaving.
    if not ev.done_by_this_attempt() or ev.exit_code in (None, EXIT_OK):
        return None
    if any(name in ev.markers for name in (FAILED_FILE, HUNG_FILE, KILLED_FILE)):
        return None
    done = ev.outcome_of(DONE_FILE)
    return Outcome(Kind.DONE, step=done.step if done else None)


def _rule_cancel_asked(ev: Evidence) -> Outcome | None:
    if CANCELLED_FILE not in ev.markers:
        return None
    saved = _saved(ev)
    return Outcome(
        Kind.CANCELLED,
        step=saved.step if saved else None,
        signal=saved.signal if saved else None,
        reason="cancelled by the user",
    )


def _rule_warned(ev: Evidence) -> Outcome | None:
    warning = ev.warned()
    if warning is None:
        return None
    saved = _saved(ev)
    return Outcome(
        Kind.PREEMPTED, step=saved.step if saved else None, signal=warning,
        marker=saved.marker if saved else {},
    )  # fmt: skip


def _rule_ended_from_outside(ev: Evidence) -> Outcome | None:
    end = next((s for s in ev.signals if s in ENDS), None)
    if end is None:
        return None
    saved = _saved(ev)
    return Outcome(Kind.CANCELLED, step=saved.step if saved else None, signal=end)


def _rule_saved(ev: Evidence) -> Outcome | None:
    saved = _saved(ev)
    if saved is None:
        return None
    if saved.signal in ENDS:  # the ranks saved on a TERM/INT alone: a cancel
        return Outcome(Kind.CANCELLED, step=saved.step, signal=saved.signal)
    return Outcome(
        Kind.PREEMPTED, step=saved.step, signal=saved.signal, reason=saved.reason,
        marker=saved.marker,
    )  # fmt: skip


def _rule_do_not_retry(ev: Evidence) -> Outcome | None:
    failed = ev.outcome_of(FAILED_FILE)
    if failed is not None and failed.code == EXIT_DO_NOT_RETRY:
        return Outcome(Kind.PERMANENT, code=failed.code, rank=failed.rank, reason=failed.reason)
    if failed is None and ev.exit_code == EXIT_DO_NOT_RETRY:
        return Outcome(Kind.PERMANENT, code=ev.exit_code)
    return None


def _rule_hung(ev: Evidence) -> Outcome | None:
    hung = ev.outcome_of(HUNG_FILE)
    if hung is not None:
        return Outcome(
            Kind.HUNG, step=hung.step, rank=hung.rank, node=hung.node, marker=hung.marker
        )
    if ev.exit_code == EXIT_HUNG:
        return Outcome(Kind.HUNG)
    return None


def _rule_rank_killed(ev: Evidence) -> Outcome | None:
    killed = ev.outcome_of(KILLED_FILE)
    if killed is None or not killed.pinned:
        return None
    return replace(killed, reason=f"killed by {killed.signal}")


def _rule_rank_failed(ev: Evidence) -> Outcome | None:
    failed = ev.outcome_of(FAILED_FILE)
    if failed is None or not failed.code:
        return None
    return Outcome(Kind.FAILED, code=failed.code, rank=failed.rank, reason=failed.reason)


def _rule_exit_code(ev: Evidence) -> Outcome | None:
    if ev.exit_code is None:
        return None
    return Outcome(Kind.FAILED, code=ev.exit_code)


def _rule_done_marker(ev: Evidence) -> Outcome | None:
    done = ev.outcome_of(DONE_FILE)
    return Outcome(Kind.DONE, step=done.step) if done is not None else None


# First match wins (docs/guides/faults.md, "How an attempt ends", lists the same rules).
RULES: tuple[tuple[str, Callable[[Evidence], Outcome | None]], ...] = (
    ("exit code 0", _rule_exit_ok),
    (
        "a DONE marker, then a cancel or a signal: the run had finished",
        _rule_finished_before_the_stop,
    ),
    ("a CANCELLED marker (`shardctl cancel`)", _rule_cancel_asked),
    ("the supervisor received the cluster's warning signal", _rule_warned),
    ("the supervisor received TERM or INT and no warning", _rule_ended_from_outside),
    ("a PREEMPTED marker: its signal TERM/INT is a cancel, else a preemption", _rule_saved),
    ("a FAILED marker with code 78, or exit code 78: do not retry", _rule_do_not_retry),
    ("a HUNG marker, or exit code 124", _rule_hung),
    ("a KILLED marker: a rank killed on its node (pinned there)", _rule_rank_killed),
    ("a FAILED marker (a rank's own non-zero exit)", _rule_rank_failed),
    (
        "this attempt's DONE (its token), no FAILED/HUNG/KILLED, a launcher's non-zero "
        "exit: the work was complete",
        _rule_done_then_launcher_failed,
    ),
    ("any other exit code (42 without PREEMPTED included)", _rule_exit_code),
    ("no exit code recorded, a DONE marker", _rule_done_marker),
)


def classify(evidence: Evidence) -> Outcome:
    """How the attempt ended: the first of `RULES` that matches, else UNKNOWN."""
    for _name, rule in RULES:
        found = rule(evidence)
        if found is not None:
            return found
    return Outcome(Kind.UNKNOWN)


@dataclass(frozen=True)
class Verdict:
    """A supervisor's answer: how the attempt ended and what to do now."""

    outcome: Outcome
    decision: Decision
    exit_code: int
    # A RETRY the retry budget refused (the decision is then STOP).
    out_of_retries: bool = False
    retries: int = 0  # retries made before this attempt
    max_retries: int | None = None
    # A RETRY refused because this attempt and the ones before it published no new
    # complete checkpoint (`stalled` attempts in a row; the newest complete step then).
    no_progress: bool = False
    stalled: int = 0
    last_step: int | None = None
    # Restarts inside this allocation made before this attempt, and the bound
    # (`restart.max_in_allocation`; None: the supervisor does not restart in place).
    restarts: int = 0
    max_restarts: int | None = None

    def summary(self) -> str:
        text = self.outcome.summary()
        if self.decision is Decision.RESTART:
            text += (
                f"; restarting every rank in this allocation ({self.restarts + 1} of at "
                f"most {self.max_restarts})"
            )
        elif self.out_of_restarts and not self.no_progress:
            text += (
                f"; out of restarts in this allocation ({self.restarts} of at most "
                f"{self.max_restarts})"
            )
        if self.out_of_retries:
            text += f"; out of retries ({self.retries} of at most {self.max_retries})"
        if self.no_progress:
            text += f"; {self.stop_reason()}"
        return text

    @property
    def out_of_restarts(self) -> bool:
        """A crash or a hang that `restart.max_in_allocation` no longer restarts (0
        restarts allowed: never said, nothing ran out)."""
        return (
            bool(self.max_restarts)
            and rule_for(self.outcome).restart
            and self.restarts >= self.max_restarts
        )

    def stop_reason(self) -> str:
        """Why a run that could retry stopped (empty when it did not)."""
        if self.no_progress:
            at = f"last at step {self.last_step}" if self.last_step is not None else "none yet"
            return f"stopped: no new checkpoint in {self.stalled} attempts ({at})"
        if self.out_of_retries:
            return f"stopped: out of retries ({self.retries} of at most {self.max_retries})"
        return ""

    def to_json(self) -> dict[str, Any]:
        outcome = {k: v for k, v in asdict(self.outcome).items() if k not in ("marker",)}
        return {
            "decision": self.decision.value,
            "exit_code": self.exit_code,
            "out_of_retries": self.out_of_retries,
            "retries": self.retries,
            "max_retries": self.max_retries,
            "no_progress": self.no_progress,
            "stalled": self.stalled,
            "last_step": self.last_step,
            "restarts": self.restarts,
            "max_restarts": self.max_restarts,
            "outcome": outcome,
            "summary": self.summary(),
        }


def decide(
    outcome: Outcome,
    *,
    retries: int = 0,
    max_retries: int | None = None,
    progress: Progress | None = None,
    max_stalled: int = MAX_ATTEMPTS_WITHOUT_PROGRESS,
    restarts: int = 0,
    max_restarts: int | None = None,
) -> Verdict:
    """`POLICY` for `outcome`. A crash or a hang (a row with `restart`) restarts inside
    the allocation while `restarts` (made before this attempt) is below `max_restarts`
    (None: this supervisor does not restart in place); past it the row's decision
    applies. A RETRY past `max_retries` (retries already made: `retries`) becomes STOP.
    A RESTART or RETRY after `max_stalled` attempts in a row without a new complete
    checkpoint (`progress`; `max_stalled` 0: never) becomes STOP: a crash loop."""
    rule = rule_for(outcome)
    code = rule.exit_code if rule.exit_code is not None else (outcome.code or EXIT_FAILED)
    base = Verdict(
        outcome, rule.decision, code, False, retries, max_retries,
        restarts=restarts, max_restarts=max_restarts,
    )  # fmt: skip
    stalled = progress is not None and 0 < max_stalled <= progress.stalled
    no_progress = replace(
        base, decision=Decision.STOP, no_progress=True,
        stalled=progress.stalled if progress else 0, last_step=progress.step if progress else None,
    )  # fmt: skip
    if rule.restart and max_restarts is not None and restarts < max_restarts:
        return no_progress if stalled else replace(base, decision=Decision.RESTART)
    if rule.decision is not Decision.RETRY:
        return base
    if max_retries is not None and retries >= max_retries:
        return replace(base, decision=Decision.STOP, out_of_retries=True)
    return no_progress if stalled else base


def judge(evidence: Evidence, **counts: Any) -> Verdict:
    """`decide(classify(evidence), **counts)`: what a supervisor calls. `counts` are
    `decide`'s keywords (retries, restarts, their bounds, progress), passed on as they
    are so that the two cannot disagree on a name or a default."""
    return decide(classify(evidence), **counts)


# ----------------------------------------------------------------- python -m

USAGE = "python -m shardctl.orchestrator.outcome RUN_DIR --exit-code RC [options]"


def _step_arg(text: str) -> int | None:
    """`--start-step`: a step, or '' / 'none' for "no checkpoint at the start"."""
    if text.strip().lower() in ("", "none"):
        return None
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a checkpoint step; give a whole number >= 0, or 'none'"
        )
    return int(text)


def main(argv: list[str] | None = None) -> int:
    """For a supervisor written in bash (one of your own; shardctl's clusters run the
    node agent, which imports this module): prints
    `<decision> <summary>` on one line; `--write FILE` also records the verdict as
    JSON. Exit 0 once it judged, 2 on bad arguments."""
    p = argparse.ArgumentParser(prog="python -m shardctl.orchestrator.outcome", usage=USAGE)
    p.add_argument("run_dir")
    p.add_argument("--exit-code", type=int, required=True)
    p.add_argument("--since", type=float, default=None, help="the attempt's start (epoch s)")
    p.add_argument("--signal", action="append", default=[], help="a signal it received")
    p.add_argument("--warning", default=None, help="the cluster's warning signal (name)")
    p.add_argument("--retries", type=int, default=0)
    p.add_argument("--max-retries", type=int, default=None)
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for markers")
    p.add_argument(
        "--token", default=None,
        help="the attempt's token (default: SHARDCTL_ATTEMPT_TOKEN): its markers only",
    )  # fmt: skip
    p.add_argument("--write", default=None, help="also write the verdict here (JSON)")
    p.add_argument(
        "--job", default=None,
        help="judge progress for this job (its id) and record the attempt in attempts.jsonl",
    )  # fmt: skip
    p.add_argument("--checkpoint-dir", default=None, help="default: RUN_DIR/checkpoints")
    p.add_argument(
        "--start-step", type=_step_arg, default=None,
        help="the newest complete checkpoint's step when the job's first attempt started "
        "('' or none: there was none); progress is a newer one",
    )  # fmt: skip
    p.add_argument("--max-stalled", type=int, default=MAX_ATTEMPTS_WITHOUT_PROGRESS)
    p.add_argument("--restarts", type=int, default=0, help="restarts in this allocation so far")
    p.add_argument(
        "--max-restarts", type=int, default=None,
        help="restart.max_in_allocation (unset: never restart in place)",
    )  # fmt: skip
    args = p.parse_args(argv)
    evidence = Evidence.gather(
        args.run_dir, args.since, args.exit_code,
        signals=args.signal, warning=args.warning, wait_s=args.wait, token=args.token,
    )  # fmt: skip
    progress = None
    if args.job:
        progress = attempt_progress(args.run_dir, args.checkpoint_dir, args.start_step, args.job)
    verdict = judge(
        evidence, retries=args.retries, max_retries=args.max_retries,
        progress=progress, max_stalled=args.max_stalled,
        restarts=args.restarts, max_restarts=args.max_restarts,
    )  # fmt: skip
    if args.job and progress is not None:
        token = args.token or attempt_token()
        record_attempt(args.run_dir, args.job, verdict, progress, args.since, token)
    if args.write:
        from .durable import write_text_atomic

        write_text_atomic(Path(args.write), json.dumps(verdict.to_json()) + "\n", durable=False)
    print(f"{verdict.decision.value} {verdict.summary()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
