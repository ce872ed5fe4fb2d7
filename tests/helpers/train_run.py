"""Run the real trainer (`python -m shardctl.train`) under torchrun from tests.

Tiny specs (hidden 32, 2 layers, seq 32) so one 2-rank run takes seconds; every run
gets its own session and is killed by process group on a timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from helpers.ckpt_run import child_env, free_port, run

TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tiny_spec(tmp: Path, name: str, **over: Any) -> Path:
    """Write a tiny 2-rank spec whose run dir is `tmp/<name>`; returns its path."""
    data: dict[str, Any] = {
        "name": name,
        # The run dir owns logs and markers; checkpoints go beneath it explicitly.
        "run_dir": str(tmp / name),
        "resources": {"nodes": 1, "procs_per_node": 2, "device": "cpu"},
        "launcher": "torchrun",
        "strategy": {"backend": "fsdp", "sharding": "full_shard", "precision": "bf16-mixed"},
        "train": {
            "model": {"llama": dict(TINY_LLAMA)},
            "data": {"builtin": "python-stdlib"},
            "steps": 4,
            "micro_batch_size": 2,
            "seq_len": 32,
            "grad_accum": 2,
            "lr": 1e-3,
            "warmup_steps": 1,
            "seed": 7,
        },
        "checkpoint": {"every_steps": 2, "keep": 2, "dir": str(tmp / name / "checkpoints")},
        "local": {"master_port": free_port()},
        # One start per submit, as these tests judge it; the tests of restarts inside
        # the allocation (test_restart_local.py) ask for them.
        "restart": {"max_in_allocation": 0},
    }
    data = _merge(data, over)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def script_spec(tmp: Path, name: str, entrypoint: dict[str, Any], **extra: Any) -> Path:
    """Write a 2-rank spec of a user's script (`entrypoint`) on this machine, run dir
    `tmp/<name>`, one start per submit (its own outcome); returns its path."""
    data = {
        "name": name,
        "run_dir": str(tmp / name),
        "resources": {"procs_per_node": 2},
        "entrypoint": entrypoint,
        "local": {"master_port": free_port()},
        "restart": {"max_in_allocation": 0},
        **extra,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return path


def train(
    spec: Path, *, nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 480
) -> subprocess.CompletedProcess:
    """torchrun -m shardctl.train SPEC; returns the finished process (output merged).
    The timeout is sized for a loaded 2-core machine: a tiny run takes seconds idle
    and took over 240 s at a load of 30."""
    return run(loop_argv(spec, nproc), timeout, {**child_env(), **(env or {})})


def loop_argv(spec: Path, nproc: int = 2) -> list[str]:
    """torchrun --standalone of `nproc` ranks of the built-in loop on SPEC."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), "-m", "shardctl.train", str(spec),
    ]  # fmt: skip


def train_ok(spec: Path, **kw: Any) -> subprocess.CompletedProcess:
    res = train(spec, **kw)
    assert res.returncode == 0, f"training failed (rc {res.returncode}):\n{res.stdout[-6000:]}"
    return res


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_weights(ckpt: Path, out: Path) -> dict[str, Any]:
    """The fp32 model weights of a checkpoint (FSDP or DeepSpeed), via consolidation."""
    from safetensors.torch import load_file
    from shardctl.train.consolidate import consolidate

    consolidate(ckpt, out, dtype="fp32")
    tensors: dict[str, Any] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def assert_bit_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same tensor names, each equal to the bit."""
    import torch

    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:5]}"
