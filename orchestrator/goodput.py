"""Goodput: how much of a job's wall time went into training that was kept.

Torch-free; reads two files of the run dir, written by others: `attempts.jsonl` (one
line per judged attempt, `outcome.record_attempt`: `start` and `end` in epoch
seconds, `kind`, `decision`, `checkpoint_step`: the newest complete checkpoint at the
attempt's end) and `logs/metrics.jsonl` (one line per logged step with its wall-clock
`time`, `progress.py`); and, where the memory tier ran, `logs/restores.jsonl` (one
line per resume, written by rank 0: `token`, the attempt's token; `step`, the step it
resumed from; `tier`, `memory`, `partner` (a partner node's copy) or `durable`;
`train/memory_tier.record_restore`). One job's attempts only (its id in
attempts.jsonl: a new submission starts over); a job still running adds an open
attempt, from its start (the run dir's `CURRENT_ATTEMPT`, claimed by the attempt's
supervisor, when the claim names this job; or the end of the attempt before it) up to
now.

Definitions (what `status` and `ls` show):

- An attempt's *step records* are the metrics lines logged between its start and
  its end. An attempt resumed from the step of its line in restores.jsonl (a restart
  in place from the memory tier resumes past the newest durable checkpoint); without
  one, from the `checkpoint_step` of the attempt before it (none: 0). A restore line
  is an attempt's when it carries the attempt's token (recorded in attempts.jsonl, or
  the open attempt's claim); only where neither carries a token (older lines,
  Kubernetes pods) by its time falling inside the attempt.
- A step *survives* when it is in the final state: a step of an attempt survives
  when it is at or below the step the next attempt resumed from (it was not redone),
  and, for the last attempt, when the job finished or is still running (a job that
  stopped on a fault keeps only its last checkpoint).
- *Training time*: the wall time of the surviving steps, each step counted once,
  from the attempt whose work was kept. A step record covers the steps since the
  record before it in the same attempt and the wall time between the two; the first
  record of an attempt covers the steps since the attempt resumed and the attempt's
  own seconds per step for them (at most the time since the attempt started: the
  rest is start-up). An attempt that logged one step has no pace of its own: the
  median of the other attempts' is taken, and with none (every attempt logged one
  step: a run requeued after each step, or the first step of a run still starting)
  its time is all start-up. A record partly past the surviving limit counts in
  proportion.
- `effective` = training time ÷ the wall time of all the job's attempts (start to
  end, each; an attempt starts no earlier than the end of the one before it, whose
  judgement started it: starts are recorded in whole seconds).
- `restarts`: attempts judged `restart` (in place) or `retry` (requeued).
- `lost_steps`: steps computed and then not kept: past the checkpoint the next
  attempt resumed from, or past the last checkpoint of a job that stopped on a fault
  (counted from the logged steps: with `log_every` > 1, up to `log_every` - 1 fewer).
- *No progress known*: no step record belongs to any of the job's attempts (a
  script that logs no steps: neither `api.log_metrics` nor the built-in loop wrote
  metrics.jsonl). Then `effective` and `lost_steps` are None, never 0 % and "0 steps
  lost": whether a restart redid the work from step 0 is unknown.
- `recoveries`: one per fault that was restarted or requeued, its `kind` (failed,
  hung, preempted, ...) and `seconds` from the fault (the attempt's end) to the first
  step record of the attempt after it (up to now while the job is still running
  without one; None when it never logged one); `tier`, where the attempt after it has
  a restore line: the tier it resumed from (`memory`, `partner`, `durable`).

A long metrics.jsonl (past FULL_READ_BYTES) is not read whole: `status` and `ls` ask
for the goodput every time, and a million logged steps took seconds. Its lines are
appended in time order, so each attempt's lines are found by binary search on their
times, and only the records the definitions above depend on are read (`_Searched`).

Missing or unreadable files never raise: no attempt and no open attempt gives None;
lines that cannot be read, or attempts without their times (lines written before
`start`/`end` were recorded), are left out and said in `notes`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from .progress import METRICS_FILE, metrics_row
from .rundir import ATTEMPTS_FILE, CURRENT_ATTEMPT_FILE, LOGS_DIR

# The memory tier's record of each resume (`train/memory_tier.RESTORES_FILE`; not
# imported: orchestrator/ never imports train/ at module level).
RESTORES_FILE = "restores.jsonl"

# How a user's script makes its progress known (docs/guides/own-script.md).
NO_STEPS_HINT = "a script reports its steps with shardctl.train.api.log_metrics"
# Decisions after which the job went again (`outcome.Decision` values).
WENT_AGAIN = ("restart", "retry")
# Clock slack after an attempt's end when a step record is matched to it (the end is
# when the supervisor judged it, after the ranks' last line).
SLACK_S = 1.0


@dataclass(frozen=True)
class Recovery:
    kind: str
    seconds: float | None
    tier: str | None = None  # the tier the next attempt resumed from, when recorded

    def to_json(self) -> dict[str, Any]:
        seconds = None if self.seconds is None else round(self.seconds, 1)
        out: dict[str, Any] = {"kind": self.kind, "seconds": seconds}
        if self.tier is not None:
            out["tier"] = self.tier
        return out

    def words(self) -> str:
        """`failed 12 s`, or `failed 12 s from memory`."""
        seconds = "?" if self.seconds is None else f"{self.seconds:.0f}"
        return f"{self.kind} {seconds} s" + (f" from {self.tier}" if self.tier else "")


@dataclass(frozen=True)
class Goodput:
    effective: float | None  # None: no wall time yet
    training_s: float
    wall_s: float
    restarts: int
    lost_steps: int | None  # None: no progress known (no step logged by any attempt)
    recoveries: tuple[Recovery, ...]
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "effective": None if self.effective is None else round(self.effective, 4),
            "training_s": round(self.training_s, 1),
            "wall_s": round(self.wall_s, 1),
            "restarts": self.restarts,
            "lost_steps": self.lost_steps,
            "recoveries": [r.to_json() for r in self.recoveries],
            "notes": list(self.notes),
        }

    def percent(self) -> str:
        """`87 %` (what `ls` shows), or "" when unknown."""
        return "" if self.effective is None else f"{self.effective * 100:.0f} %"

    def line(self) -> str:
        """`goodput 87 % (10m29s of 12m03s trained; 2 restarts, 14 steps lost;
        recoveries: failed 47 s, hung 63 s)` (what `status` shows)."""
        head = f"goodput {self.percent() or '?'}"
        restarts = f"{self.restarts} restart{'s' if self.restarts != 1 else ''}"
        if self.lost_steps is None:
            parts = [f"no progress known: no step logged in {LOGS_DIR}/{METRICS_FILE} "
                     f"({NO_STEPS_HINT})", restarts]  # fmt: skip
        else:
            parts = [f"{_duration(self.training_s)} of {_duration(self.wall_s)} trained"]
            lost = f"{self.lost_steps} step{'s' if self.lost_steps != 1 else ''} lost"
            parts.append(f"{restarts}, {lost}")
        if self.recoveries:
            parts.append(f"recoveries: {', '.join(r.words() for r in self.recoveries)}")
        text = f"{head} ({'; '.join(parts)})"
        return text + "".join(f"\n  note: {n}" for n in self.notes)


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


@dataclass
class _Attempt:
    start: float
    end: float
    kind: str | None  # None: still running
    decision: str | None
    checkpoint_step: int | None
    token: str | None = None  # its round's token, where the ledger recorded one
    restore: dict[str, Any] | None = None  # its line of restores.jsonl, if any
    records: list[tuple[int, float]] = field(default_factory=list)  # (step, time)
    resumed: int = 0  # the step it resumed from (`_resume_steps`)
    kept_until: float = math.inf  # its steps past this one were redone or lost

    @property
    def kept_all(self) -> bool:
        return math.isinf(self.kept_until)


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _step(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _token(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _jsonl(path: Path) -> tuple[list[dict[str, Any]], int] | None:
    """(the lines that are JSON objects, how many others) or None when unreadable."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    rows, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1  # cut short by a crash, or damaged: the others still count
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


# Up to this size metrics.jsonl is read whole. A longer one (a million logged steps is
# about 200 MB) is searched by time, its lines being appended in time order, and only
# the lines that decide the goodput are read: each attempt's first and last steps and
# those around the checkpoint the next attempt resumed from (`_Searched`).
FULL_READ_BYTES = 8 << 20
# With more attempts than this, the searches would read more than the file: read it all.
SEARCHED_ATTEMPTS = 64
# Bytes read per look while searching, and around each line found.
PROBE_BYTES = 4 << 10
WINDOW_BYTES = 64 << 10
# A line longer than this (no newline: damage) is not a record.
LONGEST_LINE = 1 << 20


def _step_time(line: bytes) -> tuple[int, float] | None:
    """A metrics line's (step, time), or None (blank, cut short, damaged, untimed)."""
    row = metrics_row(line) if line.startswith(b"{") else None  # a cheap first test
    when = _number(row.get("time")) if row is not None else None
    return None if row is None or when is None else (row["step"], when)


class _Searched:
    """metrics.jsonl read in pieces: the records whose lines start in a byte range,
    and binary searches for the first record at or past a time or a step."""

    def __init__(self, f: Any, size: int) -> None:
        self.f, self.size = f, size

    def rows(self, lo: int, hi: int) -> list[tuple[int, tuple[int, float]]]:
        """(line start, (step, time)) of the records whose lines start in [lo, hi)."""
        lo, hi = max(0, lo), min(hi, self.size)
        if lo >= hi:
            return []
        begin = max(0, lo - 1)  # the byte before `lo` says whether a line starts at it
        self.f.seek(begin)
        data = self.f.read(hi - begin)
        while not data.endswith(b"\n") and self.f.tell() < self.size:
            more = self.f.read(PROBE_BYTES)  # the last line, up to its newline
            cut = more.find(b"\n")
            data += more if cut < 0 else more[: cut + 1]
            if cut >= 0 or len(data) > hi - begin + LONGEST_LINE:
                break
        start = begin
        if lo > 0:
            cut = data.find(b"\n")
            if cut < 0:
                return []
            start, data = begin + cut + 1, data[cut + 1 :]
        out = []
        for line in data.split(b"\n"):
            if start >= hi:
                break
            record = _step_time(line)
            if record is not None:
                out.append((start, record))
            start += len(line) + 1
        return out

    def first(self, lo: int, hi: int, key: int, target: float) -> int:
        """The line start of the first record in [lo, hi) whose (step, time)[key] is at
        least `target` (the records ascend in it), else `hi`."""
        while hi - lo > WINDOW_BYTES:
            mid = (lo + hi) // 2
            found = self._next(mid, hi)
            if found is None or found[1][key] >= target:
                hi = mid if found is None else found[0]
            else:
                lo = found[0] + 1  # past this record's line start
        return next((at for at, record in self.rows(lo, hi) if record[key] >= target), hi)

    def _next(self, lo: int, hi: int) -> tuple[int, tuple[int, float]] | None:
        """The first record whose line starts in [lo, hi), looking at most WINDOW_BYTES
        on (past a damaged stretch the search goes on below it)."""
        for at in range(lo, min(hi, lo + WINDOW_BYTES), PROBE_BYTES):
            found = self.rows(at, min(hi, at + PROBE_BYTES))
            if found:
                return found[0]
        return None


def _searched_rows(f: Any, size: int, attempts: Sequence[_Attempt]) -> list[dict[str, Any]]:
    """The records of a long metrics.jsonl that decide the goodput of `attempts`: each
    attempt's first and last steps, and those on both sides of the checkpoint step the
    next attempt resumed from. The steps between them count by their first and last
    times alone (a kept stretch's time is its last record's time minus its first's)."""
    lines = _Searched(f, size)
    found: dict[int, tuple[int, float]] = {}
    lo = 0
    for i, attempt in enumerate(attempts):
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        until = math.nextafter(attempt.end + SLACK_S, math.inf)
        if nxt is not None:
            until = min(until, nxt.start)
        lo = lines.first(lo, size, 1, attempt.start)
        hi = lines.first(lo, size, 1, until)
        if hi - lo <= 3 * WINDOW_BYTES:
            found.update(lines.rows(lo, hi))
            continue
        found.update(lines.rows(lo, lo + WINDOW_BYTES))
        found.update(lines.rows(hi - WINDOW_BYTES, hi))
        if not attempt.kept_all:  # the steps on both sides of `_measure`'s limit
            at = lines.first(lo, hi, 0, int(attempt.kept_until) + 1)
            found.update(lines.rows(max(lo, at - WINDOW_BYTES // 2), min(hi, at + WINDOW_BYTES)))
        lo = hi
    return [{"step": step, "time": when} for _, (step, when) in sorted(found.items())]


def _metrics_rows(path: Path, attempts: Sequence[_Attempt]) -> list[dict[str, Any]] | None:
    """The step records of metrics.jsonl that `_assign` needs for `attempts`: all of
    them when the file is short, else those `_searched_rows` finds; None: unreadable."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            if size > FULL_READ_BYTES and len(attempts) <= SEARCHED_ATTEMPTS:
                return _searched_rows(f, size, attempts)
            return [
                {"step": record[0], "time": record[1]}
                for record in map(_step_time, f)  # streamed, line by line
                if record is not None
            ]
    except OSError:
        return None


def _claimed(run_dir: Path, job: str) -> tuple[float, str | None] | None:
    """When the run's current attempt was claimed (`CURRENT_ATTEMPT`'s mtime) and its
    token, if that claim is `job`'s: the job it names (`job`, or Slurm's `job_id`)
    decides, not how close its time is; a claim naming no job (an older version's)
    counts. None for another job's claim, or none."""
    path = run_dir / CURRENT_ATTEMPT_FILE
    try:
        claimed_at = path.stat().st_mtime
        text = path.read_text()
    except OSError:
        return None
    try:
        claim = json.loads(text)
    except ValueError:
        return claimed_at, None  # names no job: counted, as before claims named theirs
    if not isinstance(claim, dict):
        return claimed_at, None
    named = claim.get("job", claim.get("job_id"))
    if isinstance(named, str) and named != job:
        return None
    token = claim.get("token")
    return claimed_at, token if isinstance(token, str) else None


def _restores(run_dir: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The lines of `logs/restores.jsonl` that name a step (none: no memory tier ran)."""
    read = _jsonl(run_dir / LOGS_DIR / RESTORES_FILE)
    if read is None:
        return []
    rows, bad = read
    if bad:
        notes.append(f"{bad} line{'s' if bad != 1 else ''} of {LOGS_DIR}/{RESTORES_FILE} "
                     "could not be read")  # fmt: skip
    return [row for row in rows if _step(row.get("step")) is not None]


def _match_restores(attempts: Sequence[_Attempt], restores: list[dict[str, Any]]) -> None:
    """Give each attempt its restore line: the one carrying its token; only where
    neither the attempt nor the line has a token, the one written inside its span (a
    token says whose a line is: a time might be another attempt's in the same second)."""
    for attempt in attempts:
        if attempt.token is not None:
            mine = [r for r in restores if r.get("token") == attempt.token]
        else:
            mine = [
                r for r in restores
                if not isinstance(r.get("token"), str)
                and (when := _number(r.get("time"))) is not None
                and attempt.start <= when <= attempt.end + SLACK_S
            ]  # fmt: skip
        attempt.restore = mine[-1] if mine else None


def _resume_steps(attempts: Sequence[_Attempt], resumed: int) -> None:
    """Set where each attempt resumed (its restore line's step, else the checkpoint
    the attempt before it left; `resumed` for the first) and how far its steps were
    kept: up to where the next attempt resumed; the last attempt's all of them when
    the job finished or runs on, else only up to its last checkpoint."""
    for attempt in attempts:
        if attempt.restore is not None:
            resumed = attempt.restore["step"]
        attempt.resumed = resumed
        resumed = attempt.checkpoint_step or 0
    for attempt, nxt in pairwise(attempts):
        attempt.kept_until = float(nxt.resumed)
    last = attempts[-1]
    if last.kind not in (None, "done"):
        last.kept_until = float(last.checkpoint_step or 0)


def goodput(
    run_dir: str | Path,
    job: str,
    *,
    running: bool = False,
    now: float,
    submitted: float | None = None,
) -> Goodput | None:
    """The goodput of `job` (its id in attempts.jsonl) in `run_dir`; `running`: the
    job has not ended (its open attempt counts up to `now`); `submitted`: when it was
    submitted, the open attempt's start when nothing better is known. None when there
    is nothing to measure (no attempt of the job, or no run dir here)."""
    root = Path(run_dir)
    notes: list[str] = []
    read = _jsonl(root / ATTEMPTS_FILE)
    lines, bad = read if read is not None else ([], 0)
    if bad:
        notes.append(f"{bad} line{'s' if bad != 1 else ''} of {ATTEMPTS_FILE} could not be read")
    mine = [e for e in lines if e.get("job") == job]
    attempts: list[_Attempt] = []
    untimed = 0
    for entry in mine:
        start, end = _number(entry.get("start")), _number(entry.get("end", entry.get("time")))
        if start is None or end is None or end < start:
            untimed += 1
            continue
        attempts.append(
            _Attempt(start, end, str(entry.get("kind")), str(entry.get("decision")),
                     _step(entry.get("checkpoint_step")), _token(entry.get("token")))
        )  # fmt: skip
    if untimed:
        notes.append(f"{untimed} attempt{'s' if untimed != 1 else ''} recorded without times")
    # An attempt begins once the one before it was judged. Its start is recorded in
    # whole seconds (rounded down), so it may read up to a second before that end, and
    # the ranks' last step records before the fault would be taken for its own (its
    # recovery read as 0 s).
    for before, after in pairwise(attempts):
        after.start = min(max(after.start, before.end), after.end)
    if running:
        claim_at, claim_token = _claimed(root, job) or (None, None)
        known = [t for t in (claim_at, submitted) if t is not None]
        if attempts:  # a restart starts once the attempt before it was judged
            known.append(attempts[-1].end)
        start = max(known, default=None)
        if start is not None and start <= now:
            attempts.append(_Attempt(start, now, None, None, None, claim_token))
    restarts = sum(1 for e in mine if e.get("decision") in WENT_AGAIN)
    if not attempts:
        if not mine:
            return None
        return Goodput(None, 0.0, 0.0, restarts, 0, (), tuple(notes))
    # A job that resumed from an earlier submission's checkpoint starts from its step.
    first = lines.index(mine[0]) if mine else len(lines)
    before = [_step(e.get("checkpoint_step")) for e in lines[:first]]
    resumed = next((s for s in reversed(before) if s is not None), 0)
    _match_restores(attempts, _restores(root, notes))
    _resume_steps(attempts, resumed)
    metrics = _metrics_rows(root / LOGS_DIR / METRICS_FILE, attempts)
    if metrics is None:
        notes.append(f"no readable {LOGS_DIR}/{METRICS_FILE}: training time unknown")
    else:
        _assign(attempts, metrics)
    measured = _measure(attempts, restarts, running, now, notes)
    if not any(attempt.records for attempt in attempts):
        # Nothing says how far any attempt got: 0 % and "0 steps lost" would be false.
        return replace(measured, effective=None, lost_steps=None)
    return measured if metrics is not None else replace(measured, effective=None)


def _assign(attempts: Sequence[_Attempt], rows: list[dict[str, Any]]) -> None:
    """Give each step record to the attempt whose time span holds it."""
    for row in rows:
        step, when = _step(row.get("step")), _number(row.get("time"))
        if step is None or when is None:
            continue
        # The newest attempt started by then (a start is never late: bash's whole
        # seconds round down), if the record is not past its end.
        attempt = next((a for a in reversed(attempts) if a.start <= when), None)
        if attempt is not None and when <= attempt.end + SLACK_S:
            attempt.records.append((step, when))


def _overlap(low: float, high: float, keep_low: float, keep_high: float) -> float:
    """The share of the steps (low, high] that lies in (keep_low, keep_high]."""
    if high <= low:
        return 0.0
    return max(0.0, min(high, keep_high) - max(low, keep_low)) / (high - low)


def _ascending(records: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """An attempt's (step, time) records in time order; steps only go up within an
    attempt, so a record that does not is left out."""
    steps: list[tuple[int, float]] = []
    for step, when in sorted(records, key=lambda r: r[1]):
        if not steps or step > steps[-1][0]:
            steps.append((step, when))
    return steps


def _pace(steps: list[tuple[int, float]]) -> float | None:
    """Seconds per step between an attempt's first and last records (None: one record)."""
    if len(steps) < 2:
        return None
    (first_step, first_t), (last_step, last_t) = steps[0], steps[-1]
    return (last_t - first_t) / (last_step - first_step)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _measure(
    attempts: list[_Attempt],
    restarts: int,
    running: bool,
    now: float,
    notes: list[str],
) -> Goodput:
    """The definitions of the module docstring, each attempt's `resumed` and
    `kept_until` set (`_resume_steps`)."""
    training = 0.0
    lost = 0
    recoveries: list[Recovery] = []
    ascending = [_ascending(attempt.records) for attempt in attempts]
    job_pace = _median([p for p in map(_pace, ascending) if p is not None])
    unpaced = 0
    for i, attempt in enumerate(attempts):
        last = i == len(attempts) - 1
        resumed, limit = attempt.resumed, attempt.kept_until
        steps = ascending[i]
        if steps:
            first_step, first_t = steps[0]
            last_step = steps[-1][0]
            # The first record's steps at the attempt's own pace, else the job's: the
            # time before it is start-up too. With no pace anywhere (every attempt logged
            # one step) it counts as start-up whole: a run that requeues after each step
            # trains nothing to speak of, and a first step is no 100 %.
            own = _pace(steps)
            per_step = own if own is not None else job_pace
            startup = max(0.0, first_t - attempt.start)
            covered = first_step - resumed
            first_s = 0.0 if per_step is None else min(per_step * covered, startup)
            unpaced += per_step is None
            training += first_s * _overlap(resumed, first_step, resumed, limit)
            for (s0, t0), (s1, t1) in pairwise(steps):
                training += (t1 - t0) * _overlap(s0, s1, resumed, limit)
            if not attempt.kept_all:
                lost += max(0, last_step - max(int(limit), resumed))
        if attempt.decision in WENT_AGAIN:
            nxt = attempts[i + 1] if not last else None
            first = min((t for _, t in nxt.records), default=None) if nxt else None
            if first is not None:
                seconds: float | None = max(0.0, first - attempt.end)
            else:
                seconds = now - attempt.end if running else None
            tier = nxt.restore.get("tier") if nxt is not None and nxt.restore else None
            recoveries.append(
                Recovery(attempt.kind or "?", seconds, tier if isinstance(tier, str) else None)
            )
    if unpaced:
        notes.append(
            f"{unpaced} attempt{'s' if unpaced != 1 else ''} logged one step and no step "
            "time is known: counted as start-up"
        )
    wall = sum(a.end - a.start for a in attempts)
    effective = min(1.0, training / wall) if wall > 0 else None
    return Goodput(effective, training, wall, restarts, lost, tuple(recoveries), tuple(notes))
