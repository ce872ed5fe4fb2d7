"""What the save-stall benchmarks share (checkpoint_stall.py, memory_tier.py): each
launches itself under torchrun on CPU (gloo), and every rank times steps of the same
FSDP2 MLP (blocks of Linear(width, width), one unit per block + root, AdamW: its
checkpoint holds ~3x the parameters) against the saves it measures.

Imported by those scripts as a sibling module (a script's folder is first on
`sys.path`, under torchrun too); torch is imported inside the functions, so the
launching side stays light.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def run_under_torchrun(script: str, nproc: int, worker_args: list[str]) -> None:
    """Run `script --worker WORKER_ARGS` on `nproc` CPU ranks (torchrun --standalone);
    one thread per rank unless OMP_NUM_THREADS says otherwise."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), script, "--worker", *worker_args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env)


@dataclass
class ShardedMlp:
    """The model, its optimizer and one batch; `step()` times one training step."""

    model: Any
    optim: Any
    batch: Any
    params: int  # the full (unsharded) parameter count
    blocks: int
    width: int
    barrier: bool  # each step ends with a barrier (the ranks end a step together)

    def step(self) -> float:
        """One forward, backward and AdamW step; its wall seconds."""
        import torch.distributed as dist

        t = time.perf_counter()
        self.model(self.batch).pow(2).mean().backward()
        self.optim.step()
        self.optim.zero_grad()
        if self.barrier:
            dist.barrier()
        return time.perf_counter() - t

    def median_step(self, warmup: int, timed: int) -> float:
        for _ in range(warmup):
            self.step()
        return statistics.median(self.step() for _ in range(timed))

    def states(self) -> dict[str, Any]:
        """The model's and optimizer's `Stateful`s, as the FSDP backend saves them."""
        from shardctl.train.backends.fsdp import ModelState, OptimizerState

        return {"model": ModelState(self.model), "optim": OptimizerState(self.model, self.optim)}


def build_mlp(params: float, width: int, batch: int, *, barrier: bool) -> ShardedMlp:
    """About `params` fp32 parameters in blocks of Linear(width, width), FSDP2-sharded
    over the process group (seeded: every run builds the same model)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = max(1, round(float(params) / (width * width + width)))
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(blocks)))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    total = sum(p.numel() for p in model.parameters())  # sharded numel summed = full
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return ShardedMlp(model, optim, torch.randn(batch, width), total, blocks, width, barrier)


def newest_step_bytes(folder: str | Path) -> int:
    """The bytes of the newest `step-*` folder under `folder` (a checkpoint's size)."""
    newest = sorted(Path(folder).glob("step-*"))[-1]
    return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
