"""Consolidation: peak RSS and throughput of `shardctl consolidate` against the usual tools.

    python benchmarks/consolidate.py                 # ~550M-param Llama, fp32 (2.2 GB)
    python benchmarks/consolidate.py --size small    # a quick smoke run (~30 MB)

1. Builds a checkpoint of a Llama (hidden 1536, 16 layers, vocab 32000: 551M params,
   2.2 GB in fp32) the way training leaves it: FSDP2 on 2 CPU ranks (torchrun, gloo)
   saved with torch.distributed.checkpoint into `step-N/dcp/` (model state only, so
   that `accelerate merge-weights` can read it too), and the same model under DeepSpeed
   ZeRO-3 saved with `engine.save_checkpoint` into `step-N/deepspeed/`; each with the
   shardctl manifest.
2. Runs every tool as its own process, 3 rounds over all tools (median reported), on a warm
   page cache (each input is read once before every run) and with nothing left to
   flush (`sync` before every run: on ext4 an fsync also waits for every other dirty
   page, e.g. the checkpoint just written). Measures wall time, the peak RSS of the
   process (wait4's ru_maxrss) and of its whole process tree (psutil, every 20 ms):
   - both: `cp -r` of the step folder (the same bytes read and written once: the floor);
   - FSDP/DCP: `shardctl consolidate` (into a new folder: no fsync, like the others;
     also with `--fsync`, the output on disk when it returns), `dcp_to_torch_save`,
     `accelerate merge-weights`;
   - DeepSpeed ZeRO-3: `shardctl consolidate`, DeepSpeed's `zero_to_fp32.py`
     (`--safe_serialization`).
   Throughput = model bytes (fp32) / wall time of the whole command (start-up included).
3. Prints a Markdown table and deletes everything it wrote (unless --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

SIZES = {
    # hidden, intermediate, layers, heads, vocab
    "550m": (1536, 4096, 16, 12, 32000),
    "small": (256, 688, 4, 4, 8000),
}


# ----------------------------------------------------------------- checkpoint makers


def _config(size: str):
    from transformers import LlamaConfig

    hidden, inter, layers, heads, vocab = SIZES[size]
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def _manifest(step_dir: Path, backend: str, config, world: int) -> None:
    import torch
    from shardctl.train.manifest import describe_files, list_files
    from shardctl.train.model import state_keys
    from transformers import LlamaForCausalLM

    with torch.device("meta"):  # the names shardctl's loop records (model.state_keys)
        keys = state_keys(LlamaForCausalLM(config))

    files = describe_files(step_dir, list_files(step_dir))
    manifest = {
        "format_version": 1,
        "step": 1,
        "world_size": world,
        "backend": backend,
        "sharding": "full_shard" if backend == "fsdp" else None,
        "zero_stage": 3,
        "precision": "fp32",
        "model": {
            "source": "llama",
            "dtype": "fp32",
            "hf_config": config.to_dict(),
            "state_keys": keys,
        },
        "versions": {"torch": "", "shardctl": "", "deepspeed": None},
        "files": files,
    }
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def make_worker(kind: str, size: str, step_dir: Path) -> None:
    """Runs under torchrun: builds the model sharded and saves one checkpoint."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    config = _config(size)
    tmp = step_dir.with_name(step_dir.name + ".tmp")
    if kind == "fsdp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.fsdp import fully_shard

        # Built on the meta device and materialised shard by shard: each rank only
        # ever holds its own half, as in a real large-model run.
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(0, 0.02)
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(tmp / "dcp"))
    else:
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=_ds_config()):
            model = LlamaForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_ds_config())
        engine.save_checkpoint(save_dir=str(tmp), tag="deepspeed")
    dist.barrier()
    if rank == 0:
        _manifest(tmp, kind, config, world)
        os.replace(tmp, step_dir)
    dist.barrier()
    dist.destroy_process_group()


def _ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def make_checkpoint(kind: str, size: str, step_dir: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", "29677",
        __file__, "--make", kind, "--size", size, "--step-dir", str(step_dir),
    ]  # fmt: skip
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=900)
    return time.perf_counter() - t


# ------------------------------------------------------------------------- measuring


def _warm(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                while f.read(1 << 24):
                    pass


# ru_maxrss counts the memory of the process a child was forked (or vforked) from,
# until its exec: spawning from this process (torch imported) would put a floor under
# every tool's number. A small interpreter in between starts each tool instead.
_SPAWN = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL); "
    "_, status, usage = os.wait4(p.pid, 0); "
    "print(usage.ru_maxrss * 1024 if os.waitstatus_to_exitcode(status) == 0 else -1)"
)


def measure(cmd: list[str]) -> dict[str, float]:
    """Wall seconds, peak RSS of the process and of its process tree (bytes)."""
    import psutil

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SPAWN, *cmd],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tree_peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal tree_peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                procs = root.children(recursive=True)  # the tool and what it starts
                tree_peak = max(tree_peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t
    done.set()
    sampler.join()
    if proc.returncode != 0 or int(out or -1) <= 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return {"wall": wall, "maxrss": int(out), "tree": max(tree_peak, 1)}


def summarize(done: list[dict[str, float]]) -> dict[str, float]:
    """The rounds of one tool: the median wall time, the highest peak RSS."""
    walls = sorted(r["wall"] for r in done)
    return {
        "wall": walls[len(walls) // 2],
        "maxrss": max(r["maxrss"] for r in done),
        "tree": max(r["tree"] for r in done),
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def run(
    size: str, workdir: Path, skip_deepspeed: bool, rounds: int, reuse: bool = False
) -> list[dict]:
    config = _config(size)
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model_bytes = sum(p.numel() * 4 for p in LlamaForCausalLM(config).parameters())
    rows: list[dict] = []
    dcp_step = workdir / "fsdp" / "checkpoints" / "step-00000001"
    print(f"building the FSDP/DCP checkpoint ({_gb(model_bytes)} GB of fp32 weights) ...")
    if not (reuse and dcp_step.is_dir()):
        made = make_checkpoint("fsdp", size, dcp_step)
        print(f"  {made:.0f} s")
    out = workdir / "out"
    py = str(BIN / "python")
    tools = [
        ("FSDP/DCP", "`cp -r` of the step folder (the floor)",
         ["cp", "-r", str(dcp_step), str(out / "copy")]),
        ("FSDP/DCP", "shardctl consolidate (safetensors)",
         [str(BIN / "shardctl"), "consolidate", str(dcp_step), "--out", str(out), "--no-progress"]),
        ("FSDP/DCP", "shardctl consolidate --fsync",
         [str(BIN / "shardctl"), "consolidate", str(dcp_step), "--out", str(out), "--no-progress",
          "--fsync"]),
        ("FSDP/DCP", "torch dcp_to_torch_save (.pt)",
         [py, "-c", "import sys; from torch.distributed.checkpoint.format_utils import "
          "dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])", str(dcp_step / "dcp"),
          str(out / "model.pt")]),
        ("FSDP/DCP", "accelerate merge-weights (safetensors)",
         [str(BIN / "accelerate"), "merge-weights", str(dcp_step / "dcp"), str(out)]),
    ]  # fmt: skip
    if not skip_deepspeed:
        ds_step = workdir / "ds" / "checkpoints" / "step-00000001"
        print("building the DeepSpeed ZeRO-3 checkpoint ...")
        if not (reuse and ds_step.is_dir()):
            made = make_checkpoint("deepspeed", size, ds_step)
            print(f"  {made:.0f} s")
        tools += [
            ("DeepSpeed ZeRO-3", "`cp -r` of the step folder (the floor)",
             ["cp", "-r", str(ds_step), str(out / "copy")]),
            ("DeepSpeed ZeRO-3", "shardctl consolidate (safetensors)",
             [str(BIN / "shardctl"), "consolidate", str(ds_step), "--out", str(out),
              "--no-progress"]),
            ("DeepSpeed ZeRO-3", "shardctl consolidate --fsync",
             [str(BIN / "shardctl"), "consolidate", str(ds_step), "--out", str(out),
              "--no-progress", "--fsync"]),
            ("DeepSpeed ZeRO-3", "DeepSpeed zero_to_fp32 (safetensors)",
             [py, str(ds_step / "zero_to_fp32.py"), str(ds_step), str(out), "--tag",
              "deepspeed", "--safe_serialization"]),
        ]  # fmt: skip
    # Rounds go over every tool in turn, so load from other processes on the machine
    # spreads over all tools alike; the median round is reported.
    runs: dict[tuple[str, str], list[dict[str, float]]] = {(s, n): [] for s, n, _ in tools}
    for _ in range(rounds):
        for source, name, cmd in tools:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            if cmd[0].endswith("shardctl"):
                out.rmdir()  # shardctl refuses a non-empty folder; an absent one is fine
            _warm(dcp_step if source.startswith("FSDP") else workdir / "ds")
            os.sync()
            runs[source, name].append(measure(cmd))
    for source, name, _ in tools:
        m = summarize(runs[source, name])
        rows.append({"source": source, "tool": name, **m, "bytes": model_bytes})
        print(
            f"  {source:17} {name:40} {m['wall']:6.1f} s  "
            f"{model_bytes / m['wall'] / 1e9:5.2f} GB/s  peak RSS {_gb(m['maxrss'])} GB "
            f"(tree {_gb(m['tree'])} GB)"
        )
    shutil.rmtree(out, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| checkpoint | tool | wall s | × cp | GB/s | peak RSS GB | tree peak RSS GB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    floor = {r["source"]: r["wall"] for r in rows if r["tool"].startswith("`cp")}
    for r in rows:
        ratio = f"{r['wall'] / floor[r['source']]:.1f}×" if r["source"] in floor else "—"
        lines.append(
            f"| {r['source']} | {r['tool']} | {r['wall']:.1f} | {ratio} "
            f"| {r['bytes'] / r['wall'] / 1e9:.2f} | {_gb(r['maxrss'])} | {_gb(r['tree'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default="550m")
    p.add_argument("--workdir", type=Path, default=None, help="default: a fresh temp folder")
    p.add_argument("--skip-deepspeed", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    p.add_argument("--rounds", type=int, default=3, help="runs of every tool (median shown)")
    p.add_argument("--reuse", action="store_true", help="use checkpoints left by --keep")
    p.add_argument("--make", choices=["fsdp", "deepspeed"], help=argparse.SUPPRESS)
    p.add_argument("--step-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make:
        make_worker(args.make, args.size, args.step_dir)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardctl-bench-"))
    try:
        rows = run(args.size, workdir, args.skip_deepspeed, args.rounds, args.reuse)
        print()
        print(table(rows))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
