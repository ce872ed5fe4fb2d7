"""How far a run got, read from its run directory, and the `submit --wait` progress bar.

Torch-free: the built-in loop's rank 0 appends one JSON line per logged step to
`<run dir>/logs/metrics.jsonl` (`step, loss, lr, grad_norm, tokens_per_s, elapsed,
time`; see `shardctl.train.metrics`); the total number of steps is `train.steps` of
the rendered `<run dir>/job.yaml`. `MetricsTail` reads only what was appended since
its last read (a line still being written waits for its newline); `read_progress`
reads the end of the file once, for `shardctl ls` and `status`; `straggler` reads the
per-rank times of the last logged steps (`step_s_*`, `slowest_rank`, `data_s_*`,
`data_slowest_rank`: written with more than one rank) and names a rank that is the
slowest step after step, for `status`.

`ProgressDisplay` is what `submit --wait` shows on a terminal: one rich progress bar
(step / total, loss, tokens/s, ETA) fed from metrics.jsonl, with every other line the
run prints (warnings, errors, resume notes) above it; the per-step lines the loop
prints are left out, since the bar shows them. Without a terminal the logs stream as
plain lines (`submit --wait` does not build a display then).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .rundir import LOGS_DIR, SPEC_FILE

METRICS_FILE = "metrics.jsonl"  # the name shardctl.train.metrics writes
# The end of metrics.jsonl read by `read_progress`: many lines, whatever the run's length.
TAIL_BYTES = 64 * 1024
# The line rank 0 prints per logged step (shardctl.train.metrics.MetricsLogger.log).
STEP_LINE = re.compile(r"^step\s+\d+/\d+\s+loss\s")


@dataclass(frozen=True)
class Progress:
    """The newest logged step of a run."""

    step: int
    total: int | None  # train.steps; None for a user script (no train section)
    loss: float | None
    tokens_per_s: float | None
    time: float | None  # unix time the step was logged

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def short(self) -> str:
        """`12/200 loss 3.412` (what `ls` and `status` show)."""
        total = f"/{self.total}" if self.total is not None else ""
        loss = f" loss {self.loss:.4g}" if self.loss is not None else ""
        return f"step {self.step}{total}{loss}"


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOGS_DIR / METRICS_FILE


def metrics_row(line: bytes | str) -> dict[str, Any] | None:
    """One metrics line as a dict with an integer step, or None (blank, cut short, odd)."""
    try:
        row = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(row, dict):
        return None
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    return row


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def total_steps(run_dir: str | Path) -> int | None:
    """`train.steps` of the job.yaml the run was started with, or None (no such file, a
    user script without a train section, or a file that does not parse)."""
    from .errors import ShardctlError
    from .yamlio import read_yaml_file

    path = Path(run_dir) / SPEC_FILE
    if not path.is_file():
        return None
    try:
        data = read_yaml_file(path, written=True)  # `ls`: once per job
    except (OSError, ShardctlError, ValueError):
        return None
    train = data.get("train") if isinstance(data, dict) else None
    steps = train.get("steps") if isinstance(train, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def progress_of(row: dict[str, Any], total: int | None) -> Progress:
    return Progress(
        step=row["step"],
        total=total,
        loss=_number(row.get("loss")),
        tokens_per_s=_number(row.get("tokens_per_s")),
        time=_number(row.get("time")),
    )


def _tail(path: Path) -> bytes:
    """The last TAIL_BYTES of `path` (OSError when it cannot be read)."""
    with path.open("rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - TAIL_BYTES))
        return f.read()


def read_progress(run_dir: str | Path) -> tuple[Progress | None, str]:
    """(the newest logged step, "") or (None, why there is none)."""
    path = metrics_path(run_dir)
    if not Path(run_dir).is_dir():
        return None, f"run dir {run_dir} is not on this machine"
    try:
        tail = _tail(path)
    except FileNotFoundError:
        return None, f"no step logged yet ({path} does not exist)"
    except OSError as exc:
        return None, f"cannot read {path}: {exc}"
    for line in reversed(tail.splitlines()):
        row = metrics_row(line)
        if row is not None:
            return progress_of(row, total_steps(run_dir)), ""
    return None, f"no step logged yet in {path}"


# `straggler`: the logged steps looked at, how many of them must carry per-rank times,
# the share of them one rank must be the slowest in, and how much slower than the
# median rank it must be on average (data: its extra data time, as a share of the
# median step time: a rank that loads data slowly holds every rank up by that much).
STRAGGLER_WINDOW = 10
STRAGGLER_MIN_ROWS = 5
STRAGGLER_SHARE = 0.8
STRAGGLER_EXCESS = 0.10


def _tail_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of the end of metrics.jsonl (TAIL_BYTES) in file order; [] when it
    cannot be read."""
    try:
        tail = _tail(metrics_path(run_dir))
    except OSError:
        return []
    return [row for row in map(metrics_row, tail.splitlines()) if row is not None]


def _rank(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _consistently_slowest(
    rows: list[dict[str, Any]], rank_key: str, max_key: str, median_key: str
) -> tuple[int, int, int, float, float] | None:
    """(rank, rows it is the slowest in, rows, its mean time, the median rank's mean
    time) when one rank is the slowest in STRAGGLER_SHARE of the last rows carrying
    `rank_key`; None otherwise (or with fewer than STRAGGLER_MIN_ROWS of them)."""
    usable = [
        r
        for r in rows
        if _rank(r.get(rank_key)) is not None
        and _number(r.get(max_key)) is not None
        and _number(r.get(median_key)) is not None
    ][-STRAGGLER_WINDOW:]
    if len(usable) < STRAGGLER_MIN_ROWS:
        return None
    ranks = [r[rank_key] for r in usable]
    rank = max(set(ranks), key=ranks.count)
    count = ranks.count(rank)
    if count < STRAGGLER_SHARE * len(usable):
        return None
    mine = [r for r in usable if r[rank_key] == rank]
    slow = sum(float(r[max_key]) for r in mine) / len(mine)
    median = sum(float(r[median_key]) for r in mine) / len(mine)
    return rank, count, len(usable), slow, median


def straggler(run_dir: str | Path) -> str | None:
    """A line naming a rank that is consistently the slowest, or None.

    Over the last (up to) STRAGGLER_WINDOW logged steps with per-rank times, at least
    STRAGGLER_MIN_ROWS of them: one rank is the slowest in STRAGGLER_SHARE of them and
    its step time is STRAGGLER_EXCESS longer than the median rank's on average; or
    (data) one rank is the slowest at loading data as often and its extra data time
    is STRAGGLER_EXCESS of the median step time. Both findings are joined by "; ".
    """
    rows = _tail_rows(run_dir)
    found = []
    step = _consistently_slowest(rows, "slowest_rank", "step_s_max", "step_s_median")
    if step is not None:
        rank, count, n, slow, median = step
        if slow >= (1 + STRAGGLER_EXCESS) * median:
            found.append(
                f"rank {rank} is the slowest in {count} of the last {n} logged steps "
                f"(step time {slow:.3g} s vs a median {median:.3g} s)"
            )
    data = _consistently_slowest(rows, "data_slowest_rank", "data_s_max", "data_s_median")
    if data is not None:
        rank, count, n, slow, median = data
        usable = [r for r in rows if _number(r.get("step_s_median")) is not None]
        usable = usable[-STRAGGLER_WINDOW:]
        step_median = sum(float(r["step_s_median"]) for r in usable) / max(len(usable), 1)
        if usable and slow - median >= STRAGGLER_EXCESS * step_median:
            found.append(
                f"rank {rank} is the slowest at loading data in {count} of the last {n} "
                f"logged steps (data time {slow:.3g} s vs a median {median:.3g} s)"
            )
    return "; ".join(found) or None


class MetricsTail:
    """Reads metrics.jsonl as it grows: `poll()` returns the rows appended since the
    previous call (complete lines only; a line cut short by a kill is skipped)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = metrics_path(run_dir)
        self.offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self.offset:  # replaced by a new file: start again
                    self.offset, self._partial = 0, b""
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return []
        self.offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # b"" after a final newline
        return [row for row in map(metrics_row, lines) if row is not None]


class ProgressDisplay:
    """`submit --wait` on a terminal: a progress bar from metrics.jsonl, other output above.

    `write(text)` takes the run's output (any chunking); `tick()` reads new metrics;
    use it as a context manager around the follow. `console`: a rich Console (tests
    pass one with `force_terminal=True` writing to a StringIO).
    """

    def __init__(self, run_dir: str | Path, name: str, total: int, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.console = console or Console(highlight=False)
        self.metrics = MetricsTail(run_dir)
        self._line = ""
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._bar.add_task(name, total=total, loss="—", tps="—")

    def __enter__(self) -> ProgressDisplay:
        self._bar.start()
        self.tick()
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()
        self.tick()
        self._bar.stop()

    def tick(self) -> None:
        rows = self.metrics.poll()
        if not rows:
            return
        last = rows[-1]
        loss, tps = _number(last.get("loss")), _number(last.get("tokens_per_s"))
        self._bar.update(
            self._task,
            completed=last["step"],
            loss=f"{loss:.4f}" if loss is not None else "—",
            tps=f"{tps:,.0f}" if tps is not None else "—",
        )

    def write(self, text: str) -> None:
        self._line += text
        *lines, self._line = self._line.split("\n")
        for line in lines:
            self._print(line)

    def flush(self) -> None:
        if self._line:
            self._print(self._line)
            self._line = ""

    def _print(self, line: str) -> None:
        if STEP_LINE.match(line):
            return  # the bar shows it
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)
