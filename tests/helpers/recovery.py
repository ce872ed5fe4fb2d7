"""How long a restart inside the allocation took: from the fault to the first step
of the restarted ranks, read from what the run wrote (the resume line of the log,
the step's own time in metrics.jsonl)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

RESUMED = re.compile(r"resumed at step (\d+)")


def resumed_steps(log_text: str) -> list[int]:
    """Every `resumed at step N` the ranks printed (rank 0 says it once per start)."""
    return [int(n) for n in RESUMED.findall(log_text)]


def first_step_after(run_dir: Path, resumed: int, fault_time: float) -> float | None:
    """Seconds from `fault_time` (epoch) to the restarted ranks' first step (`resumed`
    + 1, logged after the fault), or None while it has not been logged."""
    try:
        lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("step") == resumed + 1 and entry.get("time", 0) > fault_time:
            return float(entry["time"]) - fault_time
    return None


def recovered(
    run_dir: Path, log_text: Callable[[], str], resumes: int, fault_time: float
) -> Callable[[], float | None]:
    """A poll: the seconds to recovery once the `resumes`-th resume (counting the ones
    in the log) has logged its first step, else None."""

    def check() -> float | None:
        steps = resumed_steps(log_text())
        if len(steps) < resumes:
            return None
        return first_step_after(run_dir, steps[resumes - 1], fault_time)

    return check
