"""How an attempt ended, and whether to go again: the one classifier every supervisor calls.

Torch-free and dependency-free (it imports only `rundir`): the local supervisor, the
Slurm node task, the standalone `job.sbatch` (through `python -m
shardctl.orchestrator.outcome`), every `status`, the ranks (`train/entry.py`, the
loop, `api`, the HF callback) and the node watchdog import it.

The ranks and the watchdog record a typed outcome as fields of the markers
(`kind` and its fields; `reason` stays, for display only):

    DONE        {"kind": "done", "step"}
    PREEMPTED   {"kind": "preempted", "step", "signal": "SIGUSR2" | "SIGTERM" | null,
                 "reason"}  — the ranks saved because of that signal (null: a testing
                 aid, or a user script's own exit 42)
    HUNG        {"kind": "hung", "step", "node", "rank": the rank that stopped first
                 (null: none stands out), ...}  — the node watchdog
    FAILED      {"kind": "failed", "code", "rank"}  — a user script's own exit
    CANCELLED   {"kind": "cancelled"}  — `shardctl cancel` (local)

A supervisor gathers the evidence of one attempt (`Evidence`: the exit code, the
markers written during the attempt, the signals it received itself) and calls
`classify` (evidence → `Outcome`) and `decide` (outcome + retry budget → `Verdict`).
`classify` goes down `RULES`, first match wins; `decide` reads `POLICY`. README
("How an attempt ends") holds the same two tables for users.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .rundir import (
    CANCELLED_FILE,
    DONE_FILE,
    EXIT_FAILED,
    EXIT_HUNG,
    EXIT_OK,
    EXIT_PREEMPTED,
    FAILED_FILE,
    HUNG_FILE,
    PREEMPTED_FILE,
    RunDir,
)

# The markers an attempt may leave, in the order they are read.
MARKER_FILES = (DONE_FILE, CANCELLED_FILE, PREEMPTED_FILE, HUNG_FILE, FAILED_FILE)

# Signals by name, as the markers and supervisors record them. A warning: the cluster
# takes the allocation back (Slurm's `--signal`, a preemption's user signal); an end:
# a cancel, a pod's deletion, Ctrl-C (`shardctl.train.stop` says why a warning wins).
WARNINGS = ("SIGUSR2", "SIGUSR1")
ENDS = ("SIGTERM", "SIGINT")


class Kind(enum.StrEnum):
    DONE = "done"
    PREEMPTED = "preempted"
    CANCELLED = "cancelled"
    HUNG = "hung"
    FAILED = "failed"
    UNKNOWN = "unknown"  # nothing recorded: no exit code, no marker


class Decision(enum.StrEnum):
    FINISH = "finish"  # the run is complete
    RETRY = "retry"  # go again and resume from the newest complete checkpoint
    STOP = "stop"  # do not go again by yourself (a person decides)


@dataclass(frozen=True)
class Rule:
    decision: Decision
    exit_code: int | None  # what `submit --wait` reports; None: the outcome's own code
    why: str


# The policy: one row per kind (README "How an attempt ends" has the same table).
# A RETRY within the retry budget (Slurm: `slurm.max_requeues`) goes again; past it,
# the run stops.
POLICY: dict[Kind, Rule] = {
    Kind.DONE: Rule(Decision.FINISH, EXIT_OK, "every step ran and the final checkpoint exists"),
    Kind.PREEMPTED: Rule(
        Decision.RETRY, EXIT_PREEMPTED, "the ranks saved a checkpoint on the cluster's signal"
    ),
    Kind.CANCELLED: Rule(
        Decision.STOP, EXIT_PREEMPTED, "stopped from outside; the ranks saved what they could"
    ),
    Kind.HUNG: Rule(
        Decision.RETRY, EXIT_HUNG, "a node watchdog ended ranks that stopped advancing"
    ),
    Kind.FAILED: Rule(Decision.STOP, None, "a crash or an error a retry would repeat"),
    Kind.UNKNOWN: Rule(Decision.STOP, EXIT_FAILED, "nothing recorded how the attempt ended"),
}


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended (typed; `reason` and `marker` are for display only)."""

    kind: Kind
    step: int | None = None
    signal: str | None = None  # the signal that stopped it, by name ("SIGUSR2")
    rank: int | None = None  # failed: the rank that failed; hung: the one stuck first
    node: int | None = None  # hung: the node whose watchdog declared it
    code: int | None = None  # failed: the exit code (the rank's own when recorded)
    reason: str = ""
    marker: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def summary(self) -> str:
        """One line for a log or `status`."""
        at = f" at step {self.step}" if self.step is not None else ""
        sig = f" (signal {self.signal})" if self.signal else ""
        if self.kind is Kind.DONE:
            return f"finished{at}"
        if self.kind is Kind.PREEMPTED:
            saved = f", checkpoint saved{at}" if self.step is not None else ", checkpoint saved"
            return f"preempted{sig}{saved}"
        if self.kind is Kind.CANCELLED:
            return f"cancelled{sig}" + (f"; checkpoint at step {self.step}" if at else "")
        if self.kind is Kind.HUNG:
            where = f" (node {self.node}'s watchdog)" if self.node is not None else ""
            return f"hung{at}{where}"
        if self.kind is Kind.FAILED:
            who = f"rank {self.rank}" if self.rank is not None else "the launcher"
            return f"failed: {who} exited with code {self.code}"
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


def failed_marker(code: int, rank: int) -> dict[str, Any]:
    return {"kind": Kind.FAILED.value, "code": code, "rank": rank, "time": time.time()}


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
        FAILED_FILE: Kind.FAILED, CANCELLED_FILE: Kind.CANCELLED,
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
    ) -> Evidence:
        """Read this attempt's markers (written at or after `since`; None: every marker
        there). With `wait_s`, a failed launcher that nothing explains yet waits that
        long for PREEMPTED, HUNG or FAILED: rank 0 (which writes them) may run on
        another node and end a moment later."""
        folder = RunDir.of(run_dir)
        evidence = cls(exit_code, _read_markers(folder, since), tuple(signals), warning)
        if wait_s > 0 and evidence._unexplained():
            deadline = time.monotonic() + wait_s
            while evidence._unexplained() and time.monotonic() < deadline:
                time.sleep(0.5)
                evidence = cls(exit_code, _read_markers(folder, since), tuple(signals), warning)
        return evidence

    def _unexplained(self) -> bool:
        explained = (PREEMPTED_FILE, HUNG_FILE, FAILED_FILE, CANCELLED_FILE)
        return (
            self.exit_code not in (None, EXIT_OK, EXIT_HUNG)
            and not self.signals
            and not any(name in self.markers for name in explained)
        )

    def outcome_of(self, name: str) -> Outcome | None:
        data = self.markers.get(name)
        return from_marker(name, data) if data is not None else None

    def warned(self) -> str | None:
        """The warning signal the supervisor received, if any."""
        return next((s for s in self.signals if s == self.warning or s in WARNINGS), None)


def _read_markers(folder: RunDir, since: float | None) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for name in MARKER_FILES:
        data = folder.read_marker(name) if since is None else folder.fresh_marker(name, since)
        if data is None and (folder.root / name).exists() and name == CANCELLED_FILE:
            # `cancel` wrote a timestamp, not JSON, before the typed markers.
            stale = since is not None and (folder.root / name).stat().st_mtime < since - 1.0
            data = None if stale else {}
        if data is not None:
            found[name] = data
    return found


# ----------------------------------------------------------------- the classifier


def _saved(ev: Evidence) -> Outcome | None:
    return ev.outcome_of(PREEMPTED_FILE)


def _rule_exit_ok(ev: Evidence) -> Outcome | None:
    if ev.exit_code != EXIT_OK:
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
    return Outcome(Kind.PREEMPTED, step=saved.step if saved else None, signal=warning)


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
    return Outcome(Kind.PREEMPTED, step=saved.step, signal=saved.signal, reason=saved.reason)


def _rule_hung(ev: Evidence) -> Outcome | None:
    hung = ev.outcome_of(HUNG_FILE)
    if hung is not None:
        return Outcome(
            Kind.HUNG, step=hung.step, rank=hung.rank, node=hung.node, marker=hung.marker
        )
    if ev.exit_code == EXIT_HUNG:
        return Outcome(Kind.HUNG)
    return None


def _rule_rank_failed(ev: Evidence) -> Outcome | None:
    failed = ev.outcome_of(FAILED_FILE)
    if failed is None or not failed.code:
        return None
    return Outcome(Kind.FAILED, code=failed.code, rank=failed.rank)


def _rule_exit_code(ev: Evidence) -> Outcome | None:
    if ev.exit_code is None:
        return None
    return Outcome(Kind.FAILED, code=ev.exit_code)


def _rule_done_marker(ev: Evidence) -> Outcome | None:
    done = ev.outcome_of(DONE_FILE)
    return Outcome(Kind.DONE, step=done.step) if done is not None else None


# First match wins (README "How an attempt ends" lists the same rules).
RULES: tuple[tuple[str, Callable[[Evidence], Outcome | None]], ...] = (
    ("exit code 0", _rule_exit_ok),
    ("a CANCELLED marker (`shardctl cancel`)", _rule_cancel_asked),
    ("the supervisor received the cluster's warning signal", _rule_warned),
    ("the supervisor received TERM or INT and no warning", _rule_ended_from_outside),
    ("a PREEMPTED marker: its signal TERM/INT is a cancel, else a preemption", _rule_saved),
    ("a HUNG marker, or exit code 124", _rule_hung),
    ("a FAILED marker (a rank's own non-zero exit)", _rule_rank_failed),
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

    def summary(self) -> str:
        text = self.outcome.summary()
        if self.out_of_retries:
            text += f"; out of retries ({self.retries} of at most {self.max_retries})"
        return text

    def to_json(self) -> dict[str, Any]:
        outcome = {k: v for k, v in asdict(self.outcome).items() if k not in ("marker",)}
        return {
            "decision": self.decision.value,
            "exit_code": self.exit_code,
            "out_of_retries": self.out_of_retries,
            "retries": self.retries,
            "max_retries": self.max_retries,
            "outcome": outcome,
            "summary": self.summary(),
        }


def decide(outcome: Outcome, *, retries: int = 0, max_retries: int | None = None) -> Verdict:
    """`POLICY` for `outcome`; a RETRY past `max_retries` (retries already made:
    `retries`) becomes STOP."""
    rule = POLICY[outcome.kind]
    code = rule.exit_code if rule.exit_code is not None else (outcome.code or EXIT_FAILED)
    if rule.decision is Decision.RETRY and max_retries is not None and retries >= max_retries:
        return Verdict(outcome, Decision.STOP, code, True, retries, max_retries)
    return Verdict(outcome, rule.decision, code, False, retries, max_retries)


def judge(evidence: Evidence, *, retries: int = 0, max_retries: int | None = None) -> Verdict:
    """`decide(classify(evidence))`: what a supervisor calls."""
    return decide(classify(evidence), retries=retries, max_retries=max_retries)


# ----------------------------------------------------------------- python -m

USAGE = "python -m shardctl.orchestrator.outcome RUN_DIR --exit-code RC [options]"


def main(argv: list[str] | None = None) -> int:
    """For a supervisor written in bash (job.sbatch, the local supervisor): prints
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
    p.add_argument("--write", default=None, help="also write the verdict here (JSON)")
    args = p.parse_args(argv)
    evidence = Evidence.gather(
        args.run_dir, args.since, args.exit_code,
        signals=args.signal, warning=args.warning, wait_s=args.wait,
    )  # fmt: skip
    verdict = judge(evidence, retries=args.retries, max_retries=args.max_retries)
    if args.write:
        from .durable import write_text_atomic

        write_text_atomic(Path(args.write), json.dumps(verdict.to_json()) + "\n", durable=False)
    print(f"{verdict.decision.value} {verdict.summary()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
