"""Per-step metrics: one JSON line per logged step, plus a short human line.

Only rank 0 writes, to `<run_dir>/logs/metrics.jsonl`, appending (a resumed run
continues the same file; a step logged twice — after a crash between checkpoints —
appears twice, and readers keep the last line of each step).
Fields: step, loss, lr, grad_norm, tokens_per_s, elapsed (seconds since the process
started), time (unix time); a user script's lines (`api.log_metrics`) hold its own
scalars instead of loss ... tokens_per_s. The same scalars go to the trackers of the
spec's `logging:` section (`train/trackers.py`).

With more than one rank a line also holds the per-rank times (`rank_times`):
step_s_min, step_s_median, step_s_max and slowest_rank (the rank with the longest step
time), and from the built-in loop data_s_median, data_s_max and data_slowest_rank
(time spent loading the step's batches). `shardctl status` names a rank that is the
slowest step after step (`shardctl.orchestrator.progress.straggler`).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardctl.orchestrator.spec import Logging

    from .trackers import Trackers

METRICS_FILE = "metrics.jsonl"
# The console line names the slowest rank when its step takes this much longer than
# the median rank's (the metrics line always holds the numbers).
SLOW_RATIO = 1.2


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "logs" / METRICS_FILE


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The logged steps in step order, the last line of each step winning."""
    path = metrics_path(run_dir)
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill; the rest is fine
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def rank_times(
    step_s: Sequence[float], data_s: Sequence[float] | None = None
) -> dict[str, float | int]:
    """The per-rank fields of a metrics line from every rank's step time (and data
    time), indexed by rank: min / median / max over ranks and the slowest rank."""

    def slowest(times: Sequence[float]) -> int:
        return max(range(len(times)), key=times.__getitem__)

    out: dict[str, float | int] = {
        "step_s_min": round(min(step_s), 6),
        "step_s_median": round(statistics.median(step_s), 6),
        "step_s_max": round(max(step_s), 6),
        "slowest_rank": slowest(step_s),
    }
    if data_s is not None:
        out["data_s_median"] = round(statistics.median(data_s), 6)
        out["data_s_max"] = round(max(data_s), 6)
        out["data_slowest_rank"] = slowest(data_s)
    return out


def slow_note(ranks: Mapping[str, Any] | None) -> str:
    """`  slowest rank 1 (1.45× the median)` when one rank's step took SLOW_RATIO times
    the median rank's or longer, else ""."""
    if not ranks:
        return ""
    median, worst = ranks.get("step_s_median"), ranks.get("step_s_max")
    if not median or worst is None or worst / median < SLOW_RATIO:
        return ""
    return f"  slowest rank {ranks['slowest_rank']} ({worst / median:.2f}× the median)"


class MetricsLogger:
    """Rank 0's metrics: `metrics.jsonl`, a console line and the spec's trackers.

    `logging` (the spec's section, resolved or not) turns the trackers on; they open
    in `begin(step)`, once the step training resumes from is known, and close in
    `close(outcome)`. Without it (or on other ranks) only the file and console exist.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        logging: Logging | None = None,
        job_name: str | None = None,
        console: bool = True,
    ) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.start = time.time()
        self.run_dir = Path(run_dir)
        self._logging = (
            logging.resolved(job_name or self.run_dir.name, str(run_dir))
            if logging is not None
            else None
        )
        self.trackers: Trackers | None = None
        self._file = None
        self._console = None
        if enabled:
            path = metrics_path(run_dir)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8", buffering=1)
            if console:
                from rich.console import Console

                self._console = Console(stderr=False, highlight=False, soft_wrap=True)

    def begin(self, step: int = 0) -> None:
        """Open the trackers; `step` is the step training resumes from (0: fresh)."""
        if self.enabled and self._logging is not None and self.trackers is None:
            from .trackers import Trackers

            self.trackers = Trackers(self._logging, self.run_dir, start_step=step)

    def log(
        self,
        step: int,
        *,
        loss: float,
        lr: float,
        grad_norm: float,
        tokens_per_s: float,
        ranks: Mapping[str, float | int] | None = None,
    ) -> None:
        """The built-in loop's line; `ranks`: the fields of `rank_times` (world > 1)."""
        if not self.enabled:
            return
        self.log_scalars(
            step,
            {
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
                "tokens_per_s": round(tokens_per_s, 1),
                **(ranks or {}),
            },
        )
        if self._console is not None:
            self._console.print(
                f"step {step:>6}/{self.total_steps}  loss {loss:.4f}  lr {lr:.2e}  "
                f"grad_norm {grad_norm:.3f}  {tokens_per_s:,.0f} tok/s{slow_note(ranks)}"
            )

    def log_scalars(self, step: int, scalars: Mapping[str, float | None]) -> None:
        """One metrics.jsonl line (`step`, the scalars, `elapsed`, `time`) and the same
        scalars to the trackers."""
        if not self.enabled:
            return
        now = time.time()
        row = {
            "step": step,
            **scalars,
            "elapsed": round(now - self.start, 3),
            "time": round(now, 3),
        }
        assert self._file is not None
        self._file.write(json.dumps(row) + "\n")
        if self.trackers is not None:
            self.trackers.log(step, scalars)

    def info(self, text: str) -> None:
        if self.enabled and self._console is not None:
            self._console.print(text)

    def close(self, outcome: str = "finished") -> None:
        """Close the file and the trackers (`outcome`: finished, preempted, failed)."""
        if self.trackers is not None:
            trackers, self.trackers = self.trackers, None
            trackers.close(outcome)
        if self._file is not None:
            self._file.close()
            self._file = None
