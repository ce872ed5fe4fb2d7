"""Trained runs shared by several test files (session fixtures in tests/conftest.py).

A run of the real loop costs a 2-rank launch (seconds idle, minutes on a loaded
2-core machine); tests that only read what a run leaves behind share one instead of
each training its own. A shared run is never modified by the tests that read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from helpers.train_run import tiny_spec, train_ok

TINY_RUN_STEPS = 6
TINY_RUN_LOG_EVERY = 2
TINY_RUN_LOGGING = {
    "backends": ["tensorboard", "wandb", "mlflow"],
    "wandb_mode": "offline",
    "project": "proj",
    "run_name": "r1",
}


def offline_env(tmp: Path) -> dict[str, str]:
    """W&B never reaches the network, and keeps its settings and caches in tmp."""
    wb = tmp / "wandb-home"
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(wb),
        "WANDB_CONFIG_DIR": str(wb / "config"),
        "WANDB_CACHE_DIR": str(wb / "cache"),
        "WANDB_DATA_DIR": str(wb / "data"),
        "MLFLOW_TRACKING_URI": "",
    }


@dataclass(frozen=True)
class TinyRun:
    run_dir: Path
    stdout: str  # what torchrun printed (both ranks, merged)

    @property
    def final_step(self) -> Path:
        return self.run_dir / "checkpoints" / f"step-{TINY_RUN_STEPS:08d}"


def train_tiny_run(tmp: Path) -> TinyRun:
    """The built-in loop, FSDP2 fp32 on 2 CPU ranks, 6 steps: metrics every 2 steps to
    metrics.jsonl and all three trackers (offline), tied embeddings, one checkpoint at
    the end and the consolidated model (consolidate_on_finish)."""
    spec = tiny_spec(
        tmp,
        "job",
        strategy={"precision": "fp32"},
        train={
            "steps": TINY_RUN_STEPS,
            "log_every": TINY_RUN_LOG_EVERY,
            "model": {"llama": {"tie_word_embeddings": True}},
        },
        checkpoint={"every_steps": TINY_RUN_STEPS, "consolidate_on_finish": True},
        logging=TINY_RUN_LOGGING,
    )
    res = train_ok(spec, env=offline_env(tmp))
    return TinyRun(tmp / "job", res.stdout)
