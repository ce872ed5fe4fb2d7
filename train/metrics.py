"""Per-step metrics: one JSON line per logged step, plus a short human line.

Only rank 0 writes, to `<run_dir>/logs/metrics.jsonl`, appending (a resumed run
continues the same file; a step logged twice — after a crash between checkpoints —
appears twice, and readers keep the last line of each step).
Fields: step, loss, lr, grad_norm, tokens_per_s, elapsed (seconds since the process
started), time (unix time).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


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


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, enabled: bool, total_steps: int) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.start = time.time()
        self._file = None
        self._console = None
        if enabled:
            path = metrics_path(run_dir)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8", buffering=1)
            from rich.console import Console

            self._console = Console(stderr=False, highlight=False, soft_wrap=True)

    def log(
        self, step: int, *, loss: float, lr: float, grad_norm: float, tokens_per_s: float
    ) -> None:
        if not self.enabled:
            return
        now = time.time()
        row = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
            "tokens_per_s": round(tokens_per_s, 1),
            "elapsed": round(now - self.start, 3),
            "time": round(now, 3),
        }
        assert self._file is not None
        self._file.write(json.dumps(row) + "\n")
        assert self._console is not None
        self._console.print(
            f"step {step:>6}/{self.total_steps}  loss {loss:.4f}  lr {lr:.2e}  "
            f"grad_norm {grad_norm:.3f}  {tokens_per_s:,.0f} tok/s"
        )

    def info(self, text: str) -> None:
        if self.enabled:
            assert self._console is not None
            self._console.print(text)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
