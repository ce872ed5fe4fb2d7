"""Helpers shared by the consolidation tests: checkpoints in the shardctl layout.

`make_dcp_step` writes a real (single-process, `no_dist`) DCP checkpoint with a
manifest exactly like the checkpoint contract; the multi-rank FSDP and DeepSpeed
checkpoints come from tests/helpers/consolidate_make_ckpt.py under torchrun.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MAKE_CKPT = ROOT / "tests" / "helpers" / "consolidate_make_ckpt.py"


def write_manifest(step_dir: Path, *, backend: str, hf_config: dict | None, step: int) -> None:
    """The manifest through shardctl's own writer (`train/manifest.py`): its file
    table, encoding and durability are the checkpoint contract's, not a copy."""
    from shardctl.train import manifest as contract

    files = contract.describe_files(step_dir, contract.list_files(step_dir))
    manifest = {
        "format_version": 1,
        "step": step,
        "world_size": 1,
        "backend": backend,
        "sharding": "full_shard",
        "zero_stage": 3,
        "precision": "fp32",
        "model": {"source": "llama", "dtype": "fp32", "hf_config": hf_config},
        "versions": {"torch": "x", "shardctl": "0.1.0", "deepspeed": None},
        "files": files,
    }
    contract.write_manifest(step_dir, manifest)


def make_dcp_step(
    checkpoint_dir: Path, step: int, model_sd: dict[str, Any], hf_config: dict | None
) -> Path:
    """A complete step folder whose dcp/ holds {'model': model_sd, 'optim': {...}}."""
    import torch
    import torch.distributed.checkpoint as dcp

    step_dir = checkpoint_dir / f"step-{step:08d}"
    optim = {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in model_sd.items()}}
    dcp.save({"model": model_sd, "optim": optim}, checkpoint_id=str(step_dir / "dcp"), no_dist=True)
    write_manifest(step_dir, backend="fsdp", hf_config=hf_config, step=step)
    return step_dir


def tiny_llama(tied: bool = False, seed: int = 0, **shape: Any):  # type: ignore[no-untyped-def]
    """A tiny Llama in eval mode, its weights drawn from `seed`; `shape` overrides the
    config (the foreign-format tests take the built-in loop's, `train_run.TINY_LLAMA`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        **{
            "vocab_size": 131,
            "hidden_size": 32,
            "intermediate_size": 72,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32,
            "tie_word_embeddings": tied,
            **shape,
        }
    )
    return LlamaForCausalLM(config).eval()


def torchrun_ckpt(out_step: Path, *args: str, timeout: float = 480) -> None:
    """Run the checkpoint maker on 2 CPU ranks (a free port each time: a fixed one can
    meet another run's store), bounded by `timeout` (`ckpt_run.run`)."""
    from helpers.ckpt_run import free_port, run

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(MAKE_CKPT),
        "--out", str(out_step), *args,
    ]  # fmt: skip
    res = run(cmd, timeout, env)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stdout[-4000:]}")
