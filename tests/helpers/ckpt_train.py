"""Drive the real `python -m shardctl.train` from tests: tiny specs, launches,
and the final weights of a run read back from its newest checkpoint."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from .ckpt_run import child_env, run, torchrun_argv

TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def write_spec(
    path: Path,
    run_dir: Path,
    *,
    nproc: int = 2,
    backend: str = "fsdp",
    zero_stage: int | None = None,
    precision: str = "bf16-mixed",
    steps: int = 12,
    every: int = 4,
    keep: int = 2,
    async_save: bool = False,
    resume: str = "auto",
) -> Path:
    strategy: dict[str, Any] = {"backend": backend, "precision": precision}
    if zero_stage is not None:
        strategy["zero_stage"] = zero_stage
    spec = {
        "name": "ckpt-e2e",
        "run_dir": str(run_dir),
        "resources": {"nodes": 1, "procs_per_node": nproc, "device": "cpu"},
        "strategy": strategy,
        "train": {
            "model": {"llama": TINY_LLAMA},
            "data": {"builtin": "python-stdlib"},
            "steps": steps,
            "micro_batch_size": 2,
            "seq_len": 32,
            "lr": 1.0e-3,
            "warmup_steps": 2,
            "seed": 7,
        },
        "checkpoint": {
            "dir": str(run_dir / "checkpoints"),
            "every_steps": every,
            "keep": keep,
            "async": async_save,
            "resume": resume,
        },
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def train_argv(spec: Path, nproc: int) -> list[str]:
    return torchrun_argv(nproc, "-m", "shardctl.train", str(spec))


def train_env(**extra: str) -> dict[str, str]:
    env = child_env()
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def train(
    spec: Path, nproc: int = 2, timeout: float = 480, **env: str
) -> subprocess.CompletedProcess:
    return run(train_argv(spec, nproc), timeout, env=train_env(**env))


def final_weights(checkpoint_dir: Path, step: int) -> dict[str, Any]:
    """The model tensors of checkpoint `step`, full (unsharded), from DCP or DeepSpeed."""
    import json

    import torch

    step_dir = checkpoint_dir / f"step-{step:08d}"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    if manifest["backend"] == "fsdp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out = step_dir.parent / f".weights-{step}.pt"
        dcp_to_torch_save(str(step_dir / "dcp"), str(out))
        full = torch.load(out, weights_only=False)
        out.unlink()
        return dict(full["model"])
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag="deepspeed"))
