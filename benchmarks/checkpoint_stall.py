"""Checkpoint stall: how long training is blocked per save, sync vs async.

    python benchmarks/checkpoint_stall.py [--params 150e6] [--nproc 2] [--saves 3]
    python benchmarks/checkpoint_stall.py --device cuda --nproc 1 --params 1e9 --width 4096

Launches itself under torchrun (CPU and gloo, or one GPU per rank and NCCL: then the
async save's stall is the staging from GPU to CPU memory). Every rank builds an MLP of about
`--params` fp32 parameters in blocks of Linear(width, width), shards it with FSDP2
(one unit per block + root), takes one AdamW step (so the optimizer state
exists: the checkpoint is ~3× the model), then for each mode runs `--saves`
rounds of: save → training steps until the next save. It measures, on rank 0:

- stall: wall time of `CheckpointManager.save()` as the training loop sees it
  (for async this includes waiting for the previous save, if still running);
- for async: when the background write, hashing and rename completed;
- the phases the manager records (write, hash of every file spread over the
  ranks, manifest + rename).

Prints one JSON document (and a Markdown table with --markdown).
"""

from __future__ import annotations

import argparse
import json
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
    out = Path(tempfile.mkdtemp(prefix="ckpt-stall-")) / "result.json"
    run_under_torchrun(__file__, args.nproc, [
        "--params", str(args.params), "--saves", str(args.saves),
        "--steps-between", str(args.steps_between), "--width", str(args.width),
        "--dir", args.dir or str(out.parent / "ckpt"), "--result", str(out),
        "--device", args.device,
    ])  # fmt: skip
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=2))
    if args.markdown:
        print(markdown(result))
    return 0


def markdown(r: dict) -> str:
    s, a = r["sync"], r["async"]
    return "\n".join(
        [
            "| mode | stall per save (s) | save complete after (s) | write (s) | hash (s) "
            "| publish (s) |",
            "|---|---:|---:|---:|---:|---:|",
            f"| sync | {s['stall_mean']:.2f} | {s['complete_mean']:.2f} | {s['write_mean']:.2f} | "
            f"{s['hash_mean']:.2f} | {s['publish_mean']:.2f} |",
            f"| async | {a['stall_mean']:.2f} | {a['complete_mean']:.2f} | {a['write_mean']:.2f} | "
            f"{a['hash_mean']:.2f} | {a['publish_mean']:.2f} |",
            "",
            f"async stall = {100 * r['async_over_sync']:.1f}% of the sync save time "
            f"(goal ≤ 10%); {r['params'] / 1e6:.0f}M fp32 params, checkpoint "
            f"{r['checkpoint_bytes'] / 2**30:.2f} GiB, {r['world_size']} ranks; "
            f"training step {r['step_s']:.2f} s alone, {r['step_during_async_s']:.2f} s "
            "while an async save was being written",
        ]
    )


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from shardctl.orchestrator.spec import parse_spec
    from shardctl.train.backends.fsdp import DcpStateIO
    from shardctl.train.checkpoint import CheckpointManager

    init_ranks(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mlp = build_mlp(args.params, args.width, 8, barrier=False, device=args.device)
    train_step = mlp.step
    result: dict = {
        "params": mlp.params, "world_size": world, "blocks": mlp.blocks, "width": mlp.width,
        "step_s": mlp.median_step(warmup=1, timed=3),
    }  # fmt: skip
    states = mlp.states()
    step = 0
    for mode in ("sync", "async"):
        spec = parse_spec(
            {
                "name": "stall",
                "resources": {"procs_per_node": world},
                "strategy": {"backend": "fsdp", "precision": "fp32"},
                "train": {
                    "model": {"factory": "bench.mod:fn"},
                    "data": {"builtin": "python-stdlib"},
                    "steps": 10**6,
                },
                "checkpoint": {
                    "dir": f"{args.dir}/{mode}",
                    "every_steps": 1,
                    "keep": 2,
                    "async": mode == "async",
                },
            }
        )
        mgr = CheckpointManager(
            spec.checkpoint, DcpStateIO(states, spec.strategy), rank=rank, world_size=world
        )
        stalls, phases, during = [], [], []
        for _ in range(args.saves):
            step += 1
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save(step)
            stalls.append(time.perf_counter() - t0)
            if mode == "async":
                # Train while the save is written; then wait so each round is measured
                # alone (the stall of the next save would include the wait otherwise).
                during.extend(train_step() for _ in range(args.steps_between))
                mgr.wait()
            else:
                for _ in range(args.steps_between):
                    train_step()
            phases.append(dict(mgr.timings))
        mgr.close()
        result[mode] = {
            "stalls": stalls,
            "stall_mean": statistics.mean(stalls),
            "complete_mean": statistics.mean(p["total"] for p in phases),
            "write_mean": statistics.mean(p["write"] for p in phases),
            "hash_mean": statistics.mean(p["hash"] for p in phases),
            "publish_mean": statistics.mean(p["publish"] for p in phases),
        }
        if mode == "async":
            result["step_during_async_s"] = statistics.median(during)
        if rank == 0:
            result["checkpoint_bytes"] = newest_step_bytes(Path(args.dir, mode))
    # Compare with the whole sync save: what training would otherwise wait for.
    result["async_over_sync"] = result["async"]["stall_mean"] / result["sync"]["stall_mean"]
    if rank == 0:
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=150e6)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--steps-between", type=int, default=3)
    ap.add_argument("--dir", default="", help="checkpoint folder (default: a temp dir)")
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
