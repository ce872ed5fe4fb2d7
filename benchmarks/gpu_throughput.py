"""GPU throughput: shardctl's loop (FSDP2), a bare FSDP2 loop, shardctl's loop (ZeRO-3).

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_throughput.py --device cuda --markdown \
        --rounds 2 --mode-timeout 120 --budget-s 330 --out-dir DIR
    # the DeepSpeed cross-check (benchmarks/README.md, run 2):
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_throughput.py --device cuda --markdown \
        --modes bare-fsdp,bare-deepspeed,shardctl-deepspeed --rounds 2 --mode-timeout 110 \
        --budget-s 290 --out-dir DIR
    python benchmarks/gpu_throughput.py --tiny --device cpu --markdown   # CPU smoke test

Defaults: micro-batch 8 × seq_len 2048 = 16,384 tokens per step, 10 warm-up + 30
timed steps (`--micro-batch`, `--seq-len`, `--warmup`, `--steps`); 45 GiB (FSDP2) and
50 GiB (ZeRO-3) at peak on an 80 GB H100. DeepSpeed and pydantic must be importable
(on a machine without network: wheels + the DeepSpeed sdist, benchmarks/README.md).

GPU.md items 2 and 4: tokens/s, MFU and peak GPU memory of the same Llama (built
from a transformers LlamaConfig with the same seed; default: hidden 2048, 18 layers,
16 heads (MHA), intermediate 5632, vocab 32000, untied head: 1.06 B parameters;
`attn_implementation: sdpa`), seq_len 2048, bf16-mixed (fp32 masters and optimizer
state, bf16 compute, fp32 gradient reductions), AdamW (torch's own, foreach), clip
1.0, one rank under torchrun (NCCL on CUDA, gloo on CPU), in three modes, each its
own torchrun process, one after the other:

- `shardctl-fsdp`: `python -m shardctl.train job.yaml` (FSDP2 full_shard) under the
  node watchdog, as launch.sh runs it: lr schedule, stdlib-corpus batches (byte
  tokens 0..255: only 256 of the 32000 ids occur, which does not change the work),
  per-step loss/preemption all-reduce, metrics.jsonl + TensorBoard (the `logging:`
  default), heartbeats.
- `bare-fsdp`: a hand-written FSDP2 loop — `fully_shard` per decoder layer and the
  root (root not resharded after forward, as shardctl's full_shard), random token ids
  0..255 drawn on the device, forward → cross-entropy (fp32 logits) → backward →
  `clip_grad_norm_` → step → zero_grad, nothing else.
- `shardctl-deepspeed`: the same spec with `backend: deepspeed, zero_stage: 3`.
- `bare-deepspeed` (only when `--modes` names it): the hand-written loop through
  `deepspeed.initialize` (ZeRO-3, bf16, clip 1.0, the same torch AdamW) —
  forward → cross-entropy → `engine.backward` → `engine.step`; it tells DeepSpeed's
  own cost from shardctl's.

Timing: `--warmup` steps, then `--steps` timed steps. shardctl's rate comes from the
timestamps of its own metrics.jsonl lines (written after each step's loss agreement,
which copies the loss to the host, so every stamp is after the GPU finished that
step); the bare loop synchronises the device at both ends of the same span. The loop
saves its first checkpoint after the last step (`checkpoint.every_steps` = the run's
length); the benchmark replaces `CheckpointManager.save` in the rank by a function
that records the memory counters and ends the process, so nothing after the last
timed step runs and no 17 GB checkpoint is written. Each mode has its own timeout
(`--mode-timeout`); a failed mode prints its error and the others still run.

MFU = tokens/s × FLOPs per token / peak, with FLOPs per token = 6·N + 12·L·h·s
(N: the parameters that take part in matrix products, i.e. all but the input
embedding; the attention term counts QKᵀ and AV without the causal half, as in the
PaLM paper's appendix B) and peak = 989 TFLOP/s (H100 SXM, dense bf16; `--peak-tflops`).
`mfu_6n` in the JSON leaves the attention term out. Peak memory is the rank's
`torch.cuda.max_memory_allocated` (and `_reserved`); "after step" is what stays
allocated after the optimizer step and zero_grad of the last step; both beside the
ZeRO arithmetic for one rank: 16 bytes per parameter (FSDP2: fp32 parameters 4 +
fp32 gradients 4 + Adam moments 8; DeepSpeed bf16 ZeRO-3: bf16 parameters 2 + bf16
gradients 2 + fp32 masters 4 + Adam moments 8).

Prints JSON and, with --markdown, a Markdown table; `--out-dir` also gets
`results.json` and one log per mode.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

MODEL_1B: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 18,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 2048,
    "attn_implementation": "sdpa",
}
MODEL_TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 256,
    "attn_implementation": "sdpa",
}
SEED, LR, CLIP = 1234, 3e-4, 1.0
DATA_VOCAB = 256  # byte-level corpus: the ids the stdlib data (and the bare loop) use
MODES = ("shardctl-fsdp", "bare-fsdp", "shardctl-deepspeed")
EXTRA_MODES = ("bare-deepspeed",)  # only when --modes names it


# ------------------------------------------------------------------ arithmetic


def param_counts(model: dict[str, Any]) -> dict[str, int]:
    """Parameter counts of a Llama config (untied head, no biases)."""
    h, i, v, n_layers = (
        model["hidden_size"],
        model["intermediate_size"],
        model["vocab_size"],
        model["num_hidden_layers"],
    )
    heads = model["num_attention_heads"]
    kv = model.get("num_key_value_heads") or heads
    head_dim = h // heads
    attn = h * h * 2 + 2 * h * kv * head_dim  # q, o + k, v
    mlp = 3 * h * i
    per_layer = attn + mlp + 2 * h  # + two RMSNorm weights
    embed = v * h
    total = embed + n_layers * per_layer + h + v * h  # + final norm + lm_head
    return {"total": total, "matmul": total - embed, "embedding": embed}


def flops_per_token(model: dict[str, Any], seq: int) -> tuple[float, float]:
    """(6·N + 12·L·h·s, 6·N) with N the matmul parameters."""
    n = param_counts(model)["matmul"]
    attn = 12 * model["num_hidden_layers"] * model["hidden_size"] * seq
    return 6.0 * n + attn, 6.0 * n


# ------------------------------------------------------------------ processes


def _torchrun(*args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "1", *args,
    ]  # fmt: skip


def _env(device: str, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    # shardctl from this checkout: the package is the repo root (as gpu_hang_check.sh).
    pkg = work / "pkg"
    pkg.mkdir(exist_ok=True)
    link = pkg / "shardctl"
    if not link.exists():
        link.symlink_to(ROOT)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(pkg), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    return env


def _run(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    """Run `cmd` in its own process group, output to `log`; kill the group at `timeout`."""
    with log.open("a") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"killed after {timeout:.0f} s") from None


def _tail(log: Path, lines: int = 25) -> str:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(text[-lines:])


def _spec(args: argparse.Namespace, work: Path, mode: str) -> Path:
    name = f"{mode}-{time.monotonic_ns()}"
    total = args.warmup + args.steps
    strategy: dict[str, Any] = {"backend": "fsdp", "sharding": "full_shard"}
    if mode == "shardctl-deepspeed":
        strategy = {"backend": "deepspeed", "zero_stage": 3}
    spec = {
        "name": name,
        "run_dir": str(work / name),  # metrics land in <run_dir>/logs/metrics.jsonl
        "resources": {"nodes": 1, "procs_per_node": 1, "device": args.device},
        "strategy": {**strategy, "precision": "bf16-mixed"},
        "train": {
            "model": {"llama": args.model},
            "data": {"builtin": "python-stdlib"},
            "steps": total,
            "micro_batch_size": args.micro_batch,
            "seq_len": args.seq_len,
            "lr": LR,
            "clip": CLIP,
            "seed": SEED,
            "log_every": 1,
        },
        # The first save would come after the last step; the worker stops there.
        "checkpoint": {"every_steps": total, "dir": str(work / name / "checkpoints")},
    }
    path = work / f"{name}.yaml"
    import yaml

    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_shardctl(
    args: argparse.Namespace, work: Path, mode: str, log: Path, timeout: float
) -> dict[str, Any]:
    path = _spec(args, work, mode)
    out = work / f"{path.stem}.memory.json"
    watchdog = [sys.executable, "-m", "shardctl.train.watchdog", "--"]
    cmd = [*watchdog, *_torchrun(__file__, "--shardctl-worker", str(path), str(out))]
    t0 = time.perf_counter()
    code = _run(cmd, _env(args.device, work), log, timeout)
    wall = time.perf_counter() - t0
    if code != 0 or not out.exists():
        raise RuntimeError(f"exit code {code}; last lines of {log.name}:\n{_tail(log)}")
    metrics = work / path.stem / "logs" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    by_step = {r["step"]: r["time"] for r in rows if "time" in r}
    total = args.warmup + args.steps
    span = by_step[total] - by_step[args.warmup]
    tokens = args.micro_batch * args.seq_len
    step_rates = sorted(r["tokens_per_s"] for r in rows if r.get("step", 0) > args.warmup)
    return {
        "tokens_per_s": args.steps * tokens / span,
        "median_step_tokens_per_s": step_rates[len(step_rates) // 2],
        "process_wall_s": round(wall, 1),
        **json.loads(out.read_text()),
    }


def run_bare(
    args: argparse.Namespace, work: Path, mode: str, log: Path, timeout: float
) -> dict[str, Any]:
    out = work / f"bare-{time.monotonic_ns()}.json"
    conf = work / f"{out.stem}.config.json"
    conf.write_text(
        json.dumps(
            {
                "device": args.device,
                "backend": mode.removeprefix("bare-"),
                "model": args.model,
                "seq_len": args.seq_len,
                "micro_batch": args.micro_batch,
                "warmup": args.warmup,
                "steps": args.steps,
            }
        )
    )
    t0 = time.perf_counter()
    code = _run(
        _torchrun(__file__, "--bare-worker", str(conf), str(out)),
        _env(args.device, work),
        log,
        timeout,
    )
    wall = time.perf_counter() - t0
    if code != 0 or not out.exists():
        raise RuntimeError(f"exit code {code}; last lines of {log.name}:\n{_tail(log)}")
    return {**json.loads(out.read_text()), "process_wall_s": round(wall, 1)}


# ------------------------------------------------------------------ inside the ranks


def _memory(device: Any) -> dict[str, Any]:
    import torch

    if device.type != "cuda":
        import resource

        return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    torch.cuda.synchronize(device)
    gib = 2**30
    return {
        "max_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
        "max_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
        "after_step_allocated_gib": torch.cuda.memory_allocated(device) / gib,
        "gpu": torch.cuda.get_device_name(device),
    }


def shardctl_worker(spec: str, out: str) -> int:
    """`python -m shardctl.train SPEC` in this rank, stopped where it would first save."""
    import torch
    from shardctl.train import checkpoint
    from shardctl.train.__main__ import main

    def stop_at_save(self: Any, step: int, state: Any, final: bool = False) -> None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_initialized()
            else torch.device("cpu")
        )
        Path(out).write_text(json.dumps({"stopped_at_step": step, **_memory(device)}))
        sys.stdout.flush()
        sys.stderr.flush()
        # After the last timed step: skip the save, the DONE marker and the teardown.
        os._exit(0)

    checkpoint.CheckpointManager.save = stop_at_save  # type: ignore[method-assign]
    return main([spec])


def bare_worker(conf_path: str, out: str) -> None:
    """The hand-written loop (runs under torchrun): FSDP2, or DeepSpeed ZeRO-3."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    c = json.loads(Path(conf_path).read_text())
    mbs, seq, warmup, steps = c["micro_batch"], c["seq_len"], c["warmup"], c["steps"]
    cuda = c["device"] == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    config = LlamaConfig(**c["model"], use_cache=False)
    model = LlamaForCausalLM(config).float()  # built on CPU, fp32 masters
    attn = model.config._attn_implementation
    opt_kwargs: dict[str, Any] = {"lr": LR, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if c["backend"] == "deepspeed":
        import deepspeed

        if not cuda:  # no JIT build of DeepSpeed's CPU shared-memory op for a smoke test
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        ds_config = {
            "train_micro_batch_size_per_gpu": mbs,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3},
            "steps_per_print": 10**9,
        }
        opt = torch.optim.AdamW(model.parameters(), **opt_kwargs)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)

        def forward(inputs: Any) -> Any:
            return engine(input_ids=inputs).logits

        def update(loss: Any) -> None:
            engine.backward(loss)
            engine.step()  # clip, AdamW step, zero grads
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), **opt_kwargs)

        def forward(inputs: Any) -> Any:
            return model(input_ids=inputs).logits

        def update(loss: Any) -> None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)

    gen = torch.Generator(device=device).manual_seed(SEED + rank)
    vocab = config.vocab_size

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    t0 = 0.0
    for step in range(1, warmup + steps + 1):
        batch = torch.randint(0, DATA_VOCAB, (mbs, seq + 1), generator=gen, device=device)
        logits = forward(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
        update(loss)
        if step == warmup:
            sync()
            t0 = time.perf_counter()
    sync()
    span = time.perf_counter() - t0
    if rank == 0:
        rate = steps * world * mbs * seq / span
        result = {"tokens_per_s": rate, "attn_implementation": attn, "loss": loss.detach().item()}
        Path(out).write_text(json.dumps({**result, **_memory(device)}))
    dist.destroy_process_group()


# ------------------------------------------------------------------ the report


def _versions() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "deepspeed", "pydantic"):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info["nvidia_smi"] = smi.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["nvidia_smi"] = None
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        model = [x.split(":", 1)[1].strip() for x in lscpu.splitlines() if "Model name" in x]
        info["cpu"] = model[0] if model else None
    except (OSError, subprocess.SubprocessError):
        info["cpu"] = None
    info["cpu_count"] = os.cpu_count()
    return info


def _pct(a: float | None, b: float | None) -> float | None:
    """How much slower `b` is than `a`, in percent of `a` (positive: b slower)."""
    if a is None or b is None:
        return None
    return round(100 * (a - b) / a, 2)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summary(mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode over its rounds: median rate, the rates, memory of its first good run."""
    good = [r for r in runs if r["mode"] == mode and "error" not in r]
    if not good:
        errors = [r["error"] for r in runs if r["mode"] == mode]
        return {"error": errors[-1] if errors else "not run"}
    keys = ("tokens_per_s", "mfu", "mfu_6n")
    out: dict[str, Any] = {k: _median([r[k] for r in good]) for k in keys}
    out["tokens_per_s_rounds"] = [round(r["tokens_per_s"], 1) for r in good]
    out.update({k: v for k, v in good[0].items() if k.endswith("_gib") or k == "gpu"})
    return out


def comparisons(runs: list[dict[str, Any]], modes: dict[str, Any]) -> dict[str, Any]:
    """Slowdowns in percent: of each round's pair and of the medians."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if "error" not in r:
            by_round.setdefault(r["round"], {})[r["mode"]] = r["tokens_per_s"]
    pairs = {
        "shardctl_vs_bare_percent": ("bare-fsdp", "shardctl-fsdp"),
        "deepspeed_vs_fsdp_percent": ("shardctl-fsdp", "shardctl-deepspeed"),
        "bare_deepspeed_vs_bare_fsdp_percent": ("bare-fsdp", "bare-deepspeed"),
        "shardctl_deepspeed_vs_bare_deepspeed_percent": ("bare-deepspeed", "shardctl-deepspeed"),
    }
    out: dict[str, Any] = {}
    for key, (base, other) in pairs.items():
        rate = {m: modes.get(m, {}).get("tokens_per_s") for m in (base, other)}
        out[key] = _pct(rate[base], rate[other])
        out[f"{key}_rounds"] = [
            _pct(rates[base], rates[other])
            for _, rates in sorted(by_round.items())
            if base in rates and other in rates
        ]
    return out


def markdown(result: dict[str, Any]) -> str:
    modes = result["modes"]
    arith = result["arithmetic"]
    lines = [
        "| mode | tokens/s | rounds | ms/step | MFU (6N + attn) | MFU (6N) | peak alloc GiB "
        "| peak reserved GiB | after step GiB | 16 B/param GiB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    tokens = result["micro_batch"] * result["seq_len"]
    for name, r in modes.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[0][:80]} ||||||||")
            continue
        rate = r["tokens_per_s"]
        rounds = ", ".join(f"{x:,.0f}" for x in r["tokens_per_s_rounds"])

        def gib(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]:.1f}" if r.get(key) is not None else "–"

        lines.append(
            f"| {name} | {rate:,.0f} | {rounds} | {1000 * tokens / rate:.0f} "
            f"| {100 * r['mfu']:.1f} % "
            f"| {100 * r['mfu_6n']:.1f} % | {gib('max_allocated_gib')} "
            f"| {gib('max_reserved_gib')} | {gib('after_step_allocated_gib')} "
            f"| {arith['zero_16_bytes_per_param_gib']:.1f} |"
        )
    cmp = result["comparisons"]
    names = {
        "shardctl_vs_bare_percent": "shardctl FSDP2 vs bare FSDP2",
        "deepspeed_vs_fsdp_percent": "shardctl DeepSpeed ZeRO-3 vs shardctl FSDP2",
        "bare_deepspeed_vs_bare_fsdp_percent": "bare DeepSpeed ZeRO-3 vs bare FSDP2",
        "shardctl_deepspeed_vs_bare_deepspeed_percent": "shardctl DeepSpeed vs bare DeepSpeed",
    }
    lines.append("")
    lines.append("Slowdown of the second against the first (negative: faster), median (rounds):")
    for key, text in names.items():
        if cmp.get(key) is not None:
            lines.append(f"- {text}: {cmp[key]:+.2f} % ({cmp[f'{key}_rounds']})")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--shardctl-worker":
        sys.exit(shardctl_worker(sys.argv[2], sys.argv[3]))
    if len(sys.argv) > 1 and sys.argv[1] == "--bare-worker":
        bare_worker(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 3 M-parameter model (smoke test)")
    p.add_argument("--hidden", type=int, help="hidden_size (default: 2048)")
    p.add_argument("--layers", type=int, help="num_hidden_layers (default: 18)")
    p.add_argument("--heads", type=int, help="num_attention_heads = kv heads (default: 16)")
    p.add_argument("--intermediate", type=int, help="intermediate_size (default: 5632)")
    p.add_argument("--vocab", type=int, help="vocab_size (default: 32000)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: 2048; tiny 256)")
    p.add_argument("--micro-batch", type=int, help="samples per step (default: 8; tiny 2)")
    p.add_argument("--warmup", type=int, help="untimed first steps (default: 10; tiny 2)")
    p.add_argument("--steps", type=int, help="timed steps (default: 30; tiny 3)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    p.add_argument("--mode-timeout", type=float, default=150.0, help="seconds per mode")
    p.add_argument("--rounds", type=int, default=1, help="all modes this many times")
    p.add_argument("--budget-s", type=float, default=float("inf"), help="start no mode after this")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak")
    p.add_argument("--out-dir", type=Path, help="also write results.json and mode logs here")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    model = dict(MODEL_TINY if args.tiny else MODEL_1B)
    for flag, key in (
        ("hidden", "hidden_size"),
        ("layers", "num_hidden_layers"),
        ("intermediate", "intermediate_size"),
        ("vocab", "vocab_size"),
    ):
        if getattr(args, flag) is not None:
            model[key] = getattr(args, flag)
    if args.heads is not None:
        model["num_attention_heads"] = model["num_key_value_heads"] = args.heads
    defaults = (256, 2, 2, 3) if args.tiny else (2048, 8, 10, 30)
    for flag, default in zip(("seq_len", "micro_batch", "warmup", "steps"), defaults, strict=True):
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    model["max_position_embeddings"] = max(model["max_position_embeddings"], args.seq_len)
    args.model = model
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES) - set(EXTRA_MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; accepted: {', '.join(MODES + EXTRA_MODES)}")

    counts = param_counts(model)
    fpt, fpt_6n = flops_per_token(model, args.seq_len)
    peak = args.peak_tflops * 1e12
    result: dict[str, Any] = {
        "device": args.device,
        "versions": _versions(),
        "model": model,
        "params": counts,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "tokens_per_step": args.micro_batch * args.seq_len,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "flops_per_token": fpt,
        "flops_per_token_6n": fpt_6n,
        "peak_tflops": args.peak_tflops,
        "arithmetic": {
            "zero_16_bytes_per_param_gib": 16 * counts["total"] / 2**30,
            "fsdp_after_step_12_bytes_per_param_gib": 12 * counts["total"] / 2**30,
        },
        "modes": {},
    }
    print(json.dumps({k: result[k] for k in ("versions", "model", "params")}), flush=True)
    runners = {
        "shardctl-fsdp": run_shardctl,
        "bare-fsdp": run_bare,
        "bare-deepspeed": run_bare,
        "shardctl-deepspeed": run_shardctl,
    }
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as tmp:
        work = Path(tmp)
        for rnd in range(1, args.rounds + 1):
            # Every other round in reverse order, so that a drift hits all modes alike.
            for mode in modes if rnd % 2 else modes[::-1]:
                log = (args.out_dir or work) / f"mode-{mode}.log"
                left = args.budget_s - (time.perf_counter() - started)
                if left < min(args.mode_timeout, 60.0):
                    print(f"== {mode} round {rnd}: skipped ({left:.0f} s of budget left)")
                    continue
                with log.open("a") as f:
                    f.write(f"\n===== round {rnd} =====\n")
                t0 = time.perf_counter()
                print(f"== {mode} round {rnd}: starting", flush=True)
                timeout = min(args.mode_timeout, left)
                try:
                    r = runners[mode](args, work, mode, log, timeout)
                    r["mfu"] = r["tokens_per_s"] * fpt / peak
                    r["mfu_6n"] = r["tokens_per_s"] * fpt_6n / peak
                except Exception as exc:  # one failed mode must not stop the others
                    r = {"error": f"{type(exc).__name__}: {exc}"}
                took = time.perf_counter() - t0
                print(f"== {mode} round {rnd} ({took:.0f} s): {json.dumps(r)}", flush=True)
                runs.append({"round": rnd, "mode": mode, **r})
    result["runs"] = runs
    result["modes"] = {m: summary(m, runs) for m in modes}
    result["comparisons"] = comparisons(runs, result["modes"])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out_dir is not None:
        (args.out_dir / "results.json").write_text(text + "\n")
    if args.markdown:
        print(markdown(result))


if __name__ == "__main__":
    main()
