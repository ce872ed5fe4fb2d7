"""Metrics trackers: TensorBoard event files, Weights & Biases, MLflow.

Rank 0 alone writes, the scalars of `logs/metrics.jsonl` (the built-in loop: loss, lr,
grad_norm, tokens_per_s; a user script: whatever it gives `api.log_metrics`), with the
step as the global step. The spec's `logging:` section picks the trackers
(`orchestrator/spec/sections.py`, `Logging`); each package is imported only when its tracker
is asked for, and a missing one is refused at start (`check_installed`, on every rank,
before the model is built) with the `pip install 'shardctl[...]'` that adds it.

Cost in the loop: `log` puts one tuple on a queue; a writer thread hands it to the
trackers (TensorBoard's writer is itself asynchronous; W&B's `log` goes to its own
service process; MLflow writes its store). Nothing is flushed per step; `close` drains
the queue and closes every tracker (on finish, on a preemption, on a failure).

Resume: a restarted run continues the same trackers. TensorBoard writes to the same
folder with `purge_step` = the first step of this start, so steps logged after the
last checkpoint by the interrupted start are hidden by TensorBoard's reader; W&B
resumes the run whose id `logs/trackers.json` keeps (steps at or below the W&B run's
last step are dropped by W&B itself, online); MLflow reopens the kept run id (its
metric history keeps both values of a step logged twice; readers take the last).
"""

from __future__ import annotations

import importlib.util
import json
import math
import queue
import secrets
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardctl.orchestrator.durable import write_text_atomic
from shardctl.orchestrator.errors import MissingDependencyError, ShardctlError
from shardctl.orchestrator.spec import Logging

STATE_FILE = "trackers.json"  # in <run_dir>/logs: the ids a resumed run continues

# tracker → (the module it imports, the pip extra that installs it)
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}

# What `close` records in the trackers that keep a run status.
FINISHED, PREEMPTED, FAILED = "finished", "preempted", "failed"
_MLFLOW_STATUS = {FINISHED: "FINISHED", PREEMPTED: "KILLED", FAILED: "FAILED"}
_WANDB_EXIT = {FINISHED: 0, PREEMPTED: 42, FAILED: 1}


def _installed(module: str) -> bool:
    if module in sys.modules:  # None there means "import refused"
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def requested(section: Logging) -> list[str]:
    """The trackers to open: the listed ones, or (`backends` unset) TensorBoard when its
    package is installed. An environment a user brought without tensorboard still
    trains and writes metrics.jsonl; only a tracker the spec names is required."""
    if section.backends is not None:
        return list(section.backends)
    return ["tensorboard"] if _installed(PACKAGES["tensorboard"][0]) else []


def check_installed(section: Logging) -> None:
    """Raise `MissingDependencyError` for the first listed tracker whose package is
    not installed. Cheap (no import): every rank calls it, so all of them stop."""
    for name in section.backends or []:
        module, extra = PACKAGES[name]
        if not _installed(module):
            raise MissingDependencyError(module, extra, f"logging.backends '{name}'")


def state_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "logs" / STATE_FILE


def _read_state(run_dir: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(state_path(run_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, section: Logging, run_dir: Path, start_step: int, state: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard's reader drops what earlier event files hold for the
        # steps this start logs again (a crash after the last checkpoint).
        self.writer = SummaryWriter(
            log_dir=str(section.tensorboard_dir),
            purge_step=start_step + 1 if start_step else None,
            flush_secs=30,
        )

    def log(self, step: int, scalars: Mapping[str, float], wall: float) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step, walltime=wall)

    def close(self, outcome: str) -> None:
        self.writer.close()


class _Wandb:
    name = "wandb"

    def __init__(self, section: Logging, run_dir: Path, start_step: int, state: dict) -> None:
        import wandb

        kept = state.get("wandb") or {}
        run_id = kept.get("id") or secrets.token_hex(4)  # W&B ids: [a-z0-9]
        self.run = wandb.init(
            project=section.project,
            name=section.run_name,
            id=run_id,
            resume="allow",
            mode=section.wandb_mode,
            dir=str(run_dir),
            # shardctl's own logs hold the console; W&B's capture would wrap every rank's
            # stdout in its service.
            settings=wandb.Settings(console="off"),
        )
        state["wandb"] = {"id": run_id, "project": section.project}

    def log(self, step: int, scalars: Mapping[str, float], wall: float) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self, outcome: str) -> None:
        if outcome == PREEMPTED:
            self.run.mark_preempting()
        self.run.finish(exit_code=_WANDB_EXIT[outcome])


class _Mlflow:
    name = "mlflow"

    def __init__(self, section: Logging, run_dir: Path, start_step: int, state: dict) -> None:
        from mlflow.tracking import MlflowClient

        uri = str(section.mlflow_tracking_uri)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            kept = state.get("mlflow") or {}
            if kept.get("tracking_uri") == uri and kept.get("run_id"):
                self.run_id = str(kept["run_id"])
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                exp = self.client.get_experiment_by_name(str(section.project))
                exp_id = (
                    exp.experiment_id
                    if exp is not None
                    else self.client.create_experiment(str(section.project))
                )
                run = self.client.create_run(exp_id, run_name=section.run_name)
                self.run_id = run.info.run_id
        except Exception as exc:  # MLflow raises its own types; say which setting failed
            raise ShardctlError(
                f"logging.mlflow_tracking_uri {uri!r}: MLflow could not open the run: {exc}"
            ) from exc
        state["mlflow"] = {"tracking_uri": uri, "run_id": self.run_id}

    def log(self, step: int, scalars: Mapping[str, float], wall: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall * 1000)
        metrics = [Metric(key, value, ms, step) for key, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, status=_MLFLOW_STATUS[outcome])


_OPENERS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow}


class Trackers:
    """The trackers of one rank-0 process; `log` is a queue put, `close` drains.

    `section` must be resolved (`Logging.resolved`): project, run name, TensorBoard
    folder and MLflow URI filled in. `start_step` is the step training resumes from
    (0 on a fresh start).
    """

    def __init__(self, section: Logging, run_dir: str | Path, start_step: int = 0) -> None:
        check_installed(section)
        self.run_dir = Path(run_dir)
        state = _read_state(self.run_dir)
        self._open: list[Any] = []
        names = requested(section)
        if section.backends is None and not names:
            print(
                "shardctl: no TensorBoard event files (the tensorboard package is not "
                "installed: pip install 'shardctl[tensorboard]'); metrics go to "
                "logs/metrics.jsonl only",
                file=sys.stderr,
            )
        try:
            for name in names:
                self._open.append(_OPENERS[name](section, self.run_dir, start_step, state))
        except BaseException:
            self._close_all(FAILED)
            raise
        if self._open:
            path = state_path(self.run_dir)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(state, indent=1) + "\n", durable=False)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if self._open:
            self._thread = threading.Thread(
                target=self._write, name="shardctl-trackers", daemon=True
            )
            self._thread.start()

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._open]

    def log(self, step: int, scalars: Mapping[str, float | None]) -> None:
        """Queue `scalars` at `step` (non-finite and None values are left out)."""
        if self._thread is None:
            return
        clean = {
            k: float(v) for k, v in scalars.items() if v is not None and math.isfinite(float(v))
        }
        if clean:
            self._queue.put((step, clean, time.time()))

    def close(self, outcome: str = FINISHED, timeout: float = 120.0) -> None:
        """Write what is queued, then close every tracker with `outcome` (finished,
        preempted, failed). Idempotent."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
        self._close_all(outcome)

    def _close_all(self, outcome: str) -> None:
        opened, self._open = self._open, []
        for tracker in opened:
            try:
                tracker.close(outcome)
            except Exception as exc:  # one tracker's failure must not hide the others'
                _warn(f"closing {tracker.name} failed: {exc!r}")

    def _write(self) -> None:
        failed: set[str] = set()
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, scalars, wall = item
            for tracker in self._open:
                if tracker.name in failed:
                    continue
                try:
                    tracker.log(step, scalars, wall)
                except Exception as exc:  # training goes on; this tracker stops, loudly
                    failed.add(tracker.name)
                    _warn(f"{tracker.name} stopped logging at step {step}: {exc!r}")


def _warn(text: str) -> None:
    print(f"[shardctl] warning: metrics tracker {text}", file=sys.stderr, flush=True)
