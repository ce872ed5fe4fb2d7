"""The memory tier's cost: the stall per copy and per step at K=10, vs step time.

    python benchmarks/memory_tier.py [--params 0.1e6 20e6 100e6] [--nproc 2] [--markdown]
    python benchmarks/memory_tier.py --device cuda --nproc 1 --params 100e6 1e9 \
        --width 4096 --batch 64 --markdown            # one CUDA GPU (NCCL)

Launches itself under torchrun (CPU and gloo, or one GPU per rank and NCCL: then the
copy's stall is the staging from GPU to CPU memory). For each size, every rank builds an MLP of
about that many fp32 parameters (blocks of Linear(width, width), FSDP2, one unit per
block), takes AdamW steps (the copy holds model + optimizer, ~3x the parameters),
and runs `--steps` steps with a memory copy every `--every` steps
(`shardctl.train.memory_tier.MemoryTier`, the loop's own code) into a fresh folder
under `--dir` (default /dev/shm: the tier's tmpfs), once blocking and once in the
background (the default where the backend saves asynchronously). Rank 0 reports:

- step s: the median step with no copy in flight (in the same run as the copies);
- stall per copy: what `MemoryTier.copy` held the loop (the median of the copies);
- committed after: from the copy's start until its manifest was written (for a
  background copy: while training went on);
- step while written: the median of the steps run right after a copy (the background
  write shares the cores with training: on 2 cores it slows them);
- stall per step at K: stall / K, and that as a share of step_s.

Prints one JSON document (and a Markdown table with --markdown). The folders it
writes are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sharded_mlp import (  # beside this file
    build_mlp,
    init_ranks,
    newest_step_bytes,
    run_under_torchrun,
)


def _launch(args: argparse.Namespace) -> int:
    out = Path(tempfile.mkdtemp(prefix="memory-tier-")) / "result.json"
    results = []
    for params in args.params:
        where = Path(args.dir) / f"shardctl-bench-{os.getpid()}"
        try:
            run_under_torchrun(__file__, args.nproc, [
                "--params", str(params), "--width", str(args.width), "--batch", str(args.batch),
                "--steps", str(args.steps), "--every", str(args.every),
                "--dir", str(where), "--result", str(out), "--device", args.device,
            ])  # fmt: skip
        finally:
            shutil.rmtree(where, ignore_errors=True)
        results.append(json.loads(out.read_text()))
    print(json.dumps(results, indent=2))
    if args.markdown:
        print(markdown(results))
    return 0


def markdown(results: list[dict]) -> str:
    rows = [
        "| params | copy (MiB) | step s | mode | stall per copy s | committed after s "
        "| step while written s | stall per step at K=10 s | % of step |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for mode in ("blocking", "background"):
            m = r[mode]
            rows.append(
                f"| {r['params'] / 1e6:.1f}M | {r['copy_bytes'] / 2**20:.0f} "
                f"| {m['step_plain_s']:.3f} "
                f"| {mode} | {m['stall_s']:.3f} | {m['committed_s']:.3f} "
                f"| {m['step_while_written_s']:.3f} | {m['per_step_s']:.4f} "
                f"| {100 * m['per_step_s'] / m['step_plain_s']:.1f} % |"
            )
    return "\n".join(rows)


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from shardctl.train.api_states import Strategy
    from shardctl.train.backends.fsdp import DcpStateIO
    from shardctl.train.memory_tier import MemoryTier

    init_ranks(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    wanted = float(args.params[0])
    width = min(args.width, max(16, int(wanted**0.5)))
    # Each step ends with a barrier: the ranks end a step together, as the loop's do.
    mlp = build_mlp(wanted, width, args.batch, barrier=True, device=args.device)
    train_step = mlp.step
    step_s = mlp.median_step(warmup=2, timed=5)
    io = DcpStateIO(mlp.states(), Strategy("full_shard", 3, "fp32"))
    result: dict = {"params": mlp.params, "world_size": world, "step_s": step_s}
    for mode in ("blocking", "background"):
        tier = MemoryTier(
            args.every, Path(args.dir) / mode, io, rank=rank, world_size=world,
            background=mode == "background",
        )  # fmt: skip
        stalls, committed, after, plain = [], [], [], []
        for step in range(1, args.steps + 1):
            spent = train_step()
            # The two steps after a copy run while a background copy is written.
            (after if 1 <= step % args.every <= 2 and step > args.every else plain).append(spent)
            if tier.due(step):
                t0 = time.perf_counter()
                tier.copy(step, None)
                stalls.append(time.perf_counter() - t0)
            if step % args.every == args.every - 1 and step > args.every:
                tier.manager.wait()  # the copy before is committed: its time is known
                committed.append(tier.manager.timings["total"])
        tier.close()
        committed.append(tier.manager.timings["total"])
        stall = statistics.median(stalls)
        result[mode] = {
            "stalls": stalls,
            "stall_s": stall,
            "committed_s": statistics.median(committed),
            "step_while_written_s": statistics.median(after),
            "step_plain_s": statistics.median(plain),
            "per_step_s": stall / args.every,
        }
        if rank == 0:
            result["copy_bytes"] = newest_step_bytes(Path(args.dir) / mode)
    io.close()
    if rank == 0:
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, nargs="+", default=[0.1e6, 20e6, 100e6])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--dir", default="/dev/shm", help="the tmpfs to copy into")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return 0
    return _launch(args)


if __name__ == "__main__":
    sys.exit(main())
