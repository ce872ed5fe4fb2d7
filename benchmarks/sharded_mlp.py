"""What the save-stall benchmarks share (checkpoint_stall.py, memory_tier.py): each
launches itself under torchrun on CPU (gloo) or one CUDA GPU per rank (NCCL), and
every rank times steps of the same FSDP2 MLP (blocks of Linear(width, width), one unit
per block + root, AdamW: its checkpoint holds ~3x the parameters) against the saves
it measures.

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
        """One forward, backward and AdamW step; its wall seconds (on a GPU, until its
        kernels finished: a step's time is not when it was queued)."""
        import torch
        import torch.distributed as dist

        t = time.perf_counter()
        self.model(self.batch).pow(2).mean().backward()
        self.optim.step()
        self.optim.zero_grad()
        if self.batch.is_cuda:
            torch.cuda.synchronize()
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


def init_ranks(device: str) -> None:
    """The process group for `device`: gloo on CPU; NCCL on CUDA, one GPU per local
    rank."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def build_mlp(
    params: float, width: int, batch: int, *, barrier: bool, device: str = "cpu"
) -> ShardedMlp:
    """About `params` fp32 parameters in blocks of Linear(width, width), FSDP2-sharded
    over the process group (seeded: every run builds the same model) on `device`."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = max(1, round(float(params) / (width * width + width)))
    where = torch.device(device, torch.cuda.current_device()) if device == "cuda" else device
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(blocks))).to(where)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    total = sum(p.numel() for p in model.parameters())  # sharded numel summed = full
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(batch, width).to(where)
    return ShardedMlp(model, optim, data, total, blocks, width, barrier)


def newest_step_bytes(folder: str | Path) -> int:
    """The bytes of the newest `step-*` folder under `folder` (a checkpoint's size)."""
    newest = sorted(Path(folder).glob("step-*"))[-1]
    return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
