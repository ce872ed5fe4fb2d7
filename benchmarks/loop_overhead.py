"""Loop overhead: tokens/s of `shardctl.train` vs a bare hand-written FSDP2 loop.

    python benchmarks/loop_overhead.py [--nproc 2] [--steps 30] [--warmup 5] [--rounds 2]

Both train the same Llama (transformers, built from the same config and seed),
sharded the same way (FSDP2 `fully_shard` per decoder layer + root, bf16-mixed:
fp32 masters, bf16 compute, fp32 reductions), with AdamW, clipping, the same
micro-batch and sequence length, under torchrun on CPU (gloo). The bare loop is what
one writes by hand: forward, cross-entropy, backward, clip, step, zero_grad — no
logging, no preemption agreement, no checkpoint. shardctl does its full loop (lr
schedule, data loading from the stdlib corpus, per-step loss/preemption all-reduce,
JSON-lines metrics, per-rank step times, a heartbeat per step under the node
watchdog, as launch.sh runs it); its checkpoint is written once, after the last
step, outside the timed steps.

Two measures. Wall: tokens/s over steps `warmup+1 .. steps` (the first steps pay
for lazy initialisation); shardctl's rate comes from the timestamps of its own
metrics lines, the bare loop measures the same span with perf_counter on rank 0.
CPU: tokens per CPU-second of all ranks, from the CPU time (user + sys) of a long
and a short run whose difference is the extra steps alone — far less sensitive than
wall time to other jobs sharing the machine, and still counting everything the loop
itself does per step. Fastest step: tokens/s of the single fastest timed step over
all rounds (each step timed on rank 0 from the end of the previous one, everything
but checkpoint saves included) — the least disturbed sample of what a step costs,
so the most robust figure on a busy machine. The two loops alternate `--rounds`
times (ABAB) so drifting machine load hits both; the wall and CPU slowdowns are
computed per round (a back-to-back pair) and their median reported.
Prints JSON, and a Markdown row with --markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

MODEL = {
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 256,
}
SEQ, MBS, SEED, LR = 256, 4, 1234, 1e-3


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), *args,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _timed(cmd: list[str]) -> float:
    """Run `cmd` to completion; the CPU seconds (user + sys) it and its children used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        cmd, check=True, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_shardctl(
    work: Path, nproc: int, steps: int, warmup: int
) -> tuple[float, float, list[float]]:
    name = f"overhead-{time.monotonic_ns()}"
    spec = {
        "name": name,
        "run_dir": str(work / name),  # metrics land in <run_dir>/logs/metrics.jsonl
        "resources": {"nodes": 1, "procs_per_node": nproc, "device": "cpu"},
        "strategy": {"backend": "fsdp", "sharding": "full_shard", "precision": "bf16-mixed"},
        "train": {
            "model": {"llama": MODEL},
            "data": {"builtin": "python-stdlib"},
            "steps": steps,
            "micro_batch_size": MBS,
            "seq_len": SEQ,
            "lr": LR,
            "seed": SEED,
        },
        "checkpoint": {"every_steps": steps, "dir": str(work / name / "checkpoints")},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    # Under the node watchdog, as launch.sh runs it: the ranks write their heartbeats.
    watchdog = [sys.executable, "-m", "shardctl.train.watchdog", "--"]
    cpu = _timed([*watchdog, *_torchrun(nproc, "-m", "shardctl.train", str(path))])
    rows = [
        json.loads(x) for x in (work / name / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    by_step = {r["step"]: r["time"] for r in rows}
    span = by_step[steps] - by_step[warmup]
    tokens = nproc * MBS * SEQ
    # Each metrics line's rate covers exactly its own step (save time excluded).
    step_s = [tokens / r["tokens_per_s"] for r in rows if r["step"] > warmup]
    return (steps - warmup) * tokens / span, cpu, step_s


def run_bare(work: Path, nproc: int, steps: int, warmup: int) -> tuple[float, float, list[float]]:
    out = work / f"bare-{time.monotonic_ns()}.json"
    cpu = _timed(_torchrun(nproc, __file__, "--bare-worker", str(out), str(steps), str(warmup)))
    data = json.loads(out.read_text())
    return float(data["tokens_per_s"]), cpu, data["step_s"]


def bare_worker(out: str, steps: int, warmup: int) -> None:
    """The hand-written FSDP2 loop (runs under torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, use_cache=False)).float()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(SEED + rank)
    t0 = 0.0
    step_s: list[float] = []
    t_prev = time.perf_counter()
    for step in range(1, steps + 1):
        batch = torch.randint(0, 256, (MBS, SEQ + 1), generator=gen)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        if step > warmup:
            step_s.append(now - t_prev)
        t_prev = now
        if step == warmup:
            dist.barrier()
            t0 = time.perf_counter()
    dist.barrier()
    span = time.perf_counter() - t0
    if rank == 0:
        rate = (steps - warmup) * world * MBS * SEQ / span
        Path(out).write_text(json.dumps({"tokens_per_s": rate, "step_s": step_s}))
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--bare-worker":
        bare_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    runners = {"bare": run_bare, "shardctl": run_shardctl}
    wall: dict[str, list[float]] = {k: [] for k in runners}
    per_cpu: dict[str, list[float]] = {k: [] for k in runners}
    fastest: dict[str, list[float]] = {k: [] for k in runners}
    short = args.warmup + 1
    timed_tokens = (args.steps - short) * args.nproc * MBS * SEQ
    with tempfile.TemporaryDirectory(prefix="loop-overhead-") as tmp:
        work = Path(tmp)
        for _ in range(args.rounds):
            for name, runner in runners.items():
                rate, cpu_long, step_s = runner(work, args.nproc, args.steps, args.warmup)
                _, cpu_short, _ = runner(work, args.nproc, short, args.warmup)
                wall[name].append(rate)
                fastest[name].append(args.nproc * MBS * SEQ / min(step_s))
                # The start-up (imports, model build, final save) is the same in both
                # runs, so the difference is the CPU time of the extra steps alone.
                per_cpu[name].append(timed_tokens / max(cpu_long - cpu_short, 1e-9))

    def slowdowns(rates: dict[str, list[float]]) -> list[float]:
        # Each round's pair ran back to back: its ratio is the least load-sensitive number.
        return [100 * (b - o) / b for b, o in zip(rates["bare"], rates["shardctl"], strict=True)]

    result = {
        "nproc": args.nproc,
        "model": MODEL,
        "seq_len": SEQ,
        "micro_batch_size": MBS,
        "steps_timed": args.steps - args.warmup,
        "wall_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in wall.items()},
        "tokens_per_cpu_s": {k: [round(x, 1) for x in v] for k, v in per_cpu.items()},
        "fastest_step_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in fastest.items()},
        "fastest_step_slowdown_percent": round(
            100 * (max(fastest["bare"]) - max(fastest["shardctl"])) / max(fastest["bare"]), 2
        ),
        "wall_slowdown_percent": round(statistics.median(slowdowns(wall)), 2),
        "cpu_slowdown_percent": round(statistics.median(slowdowns(per_cpu)), 2),
    }
    print(json.dumps(result, indent=2))
    if args.markdown:
        med = {k: statistics.median(v) for k, v in wall.items()}
        cpu = {k: statistics.median(v) for k, v in per_cpu.items()}
        best = {k: max(v) for k, v in fastest.items()}
        print(
            f"| FSDP2 full_shard bf16-mixed, {args.nproc} CPU ranks | {med['bare']:,.0f} | "
            f"{med['shardctl']:,.0f} | {result['wall_slowdown_percent']:+.1f} % | "
            f"{cpu['bare']:,.0f} | {cpu['shardctl']:,.0f} | "
            f"{result['cpu_slowdown_percent']:+.1f} % | {best['bare']:,.0f} | "
            f"{best['shardctl']:,.0f} | {result['fastest_step_slowdown_percent']:+.1f} % |"
        )


if __name__ == "__main__":
    main()
