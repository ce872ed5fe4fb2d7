"""Checkpoint conversion: time and peak RSS of `shardctl convert` beside DeepSpeed's own
`ds_to_universal` and beside `cp -r` of the same bytes.

    python benchmarks/convert.py                 # ~550M-param Llama, fp32, with Adam state
    python benchmarks/convert.py --size small    # a quick smoke run

1. Builds, on 2 CPU ranks, a DeepSpeed ZeRO-3 checkpoint of the Llama of
   benchmarks/consolidate.py (551M parameters: 2.21 GB of fp32 weights) after one
   AdamW step, so that it holds what a real run holds: fp32 masters plus both Adam
   moments (3 × 2.21 GB in `*_optim_states.pt`), with the shardctl manifest.
2. Runs each command as its own process, `--rounds` rounds over all of them (median
   reported), on a warm page cache and after a `sync`:
   - `cp -r` of the DeepSpeed folder (the floor: the same bytes, read and written once);
   - `shardctl convert --to fsdp` (DeepSpeed → DCP; start-up, manifest sha256 and
     fsyncs included);
   - DeepSpeed's `ds_to_universal` on the same folder (DeepSpeed → its universal
     checkpoint; 2 extract and 2 merge workers, the machine's core count);
   - `cp -r` of the DCP folder `convert --to fsdp` wrote;
   - `shardctl convert --to deepspeed --world-size 2` of that DCP checkpoint (DCP →
     ZeRO-3 through 2 DeepSpeed CPU ranks).
   Peak RSS: wait4's ru_maxrss of the command's process, and the sum over its
   process tree (psutil, every 20 ms) — ds_to_universal and `--to deepspeed` work in
   child processes, so the tree is the number to compare.
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
import time
from pathlib import Path

from consolidate import _config, _gb, _warm, measure, summarize  # benchmarks/consolidate.py

BIN = Path(sys.executable).parent


def make_worker(size: str, step_dir: Path) -> None:
    """Runs under torchrun: one AdamW step of ZeRO-3, then one checkpoint."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = _config(size)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        # Buckets far below DeepSpeed's defaults (5e8 elements = 2 GB per buffer in
        # fp32), so that 2 ranks fit in 24 GiB beside the optimizer state.
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 2e7,
            "stage3_prefetch_bucket_size": 2e7,
            "sub_group_size": 1e8,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    tmp = step_dir.with_name(step_dir.name + ".tmp")
    engine.save_checkpoint(save_dir=str(tmp), tag="deepspeed")
    dist.barrier()
    if rank == 0:
        from shardctl.train.manifest import describe_files, list_files

        manifest = {
            "format_version": 1,
            "step": 1,
            "world_size": world,
            "backend": "deepspeed",
            "sharding": "full_shard",
            "zero_stage": 3,
            "precision": "fp32",
            "model": {"source": "llama", "dtype": "fp32", "hf_config": config.to_dict()},
            "versions": {"torch": torch.__version__, "shardctl": "", "deepspeed": None},
            "files": describe_files(tmp, list_files(tmp)),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        os.replace(tmp, step_dir)
    dist.barrier()
    dist.destroy_process_group()


def make_checkpoint(size: str, step_dir: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", "29678",
        __file__, "--make", "--size", size, "--step-dir", str(step_dir),
    ]  # fmt: skip
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    return time.perf_counter() - t


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(size: str, workdir: Path, rounds: int, reuse: bool) -> list[dict]:
    ds_step = workdir / "ds" / "checkpoints" / "step-00000001"
    if not (reuse and ds_step.is_dir()):
        print("building the DeepSpeed ZeRO-3 checkpoint (one AdamW step) ...")
        print(f"  {make_checkpoint(size, ds_step):.0f} s")
    ds_bytes = _du(ds_step)
    shardctl = str(BIN / "shardctl")
    as_fsdp = workdir / "as-fsdp"  # kept between rounds: the input of the last two commands
    if not as_fsdp.is_dir():
        subprocess.run(
            [shardctl, "convert", str(ds_step), "--to", "fsdp", "--out", str(as_fsdp)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    fsdp_bytes = _du(as_fsdp)
    out = workdir / "out"
    tools = [
        ("DeepSpeed ZeRO-3 → …", "`cp -r` (same bytes)", ds_step, ds_bytes,
         ["cp", "-r", str(ds_step), str(out)]),
        ("DeepSpeed ZeRO-3 → …", "`shardctl convert --to fsdp`", ds_step, ds_bytes,
         [shardctl, "convert", str(ds_step), "--to", "fsdp", "--out", str(out)]),
        ("DeepSpeed ZeRO-3 → …", "DeepSpeed `ds_to_universal`", ds_step, ds_bytes,
         [str(BIN / "python"), "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
          str(ds_step / "deepspeed"), "--output_folder", str(out), "--num_extract_workers", "2",
          "--num_merge_workers", "2"]),
        ("FSDP/DCP → …", "`cp -r` (same bytes)", as_fsdp, fsdp_bytes,
         ["cp", "-r", str(as_fsdp), str(out)]),
        ("FSDP/DCP → …", "`shardctl convert --to deepspeed --world-size 2`", as_fsdp, fsdp_bytes,
         [shardctl, "convert", str(as_fsdp), "--to", "deepspeed", "--world-size", "2",
          "--out", str(out)]),
    ]  # fmt: skip
    runs: dict[tuple[str, str], list[dict[str, float]]] = {(s, n): [] for s, n, *_ in tools}
    for _ in range(rounds):
        for source, name, src, _, cmd in tools:
            shutil.rmtree(out, ignore_errors=True)
            _warm(src)
            os.sync()
            runs[source, name].append(measure(cmd))
    rows = []
    for source, name, _, nbytes, _ in tools:
        m = summarize(runs[source, name])
        rows.append({"source": source, "tool": name, "bytes": nbytes, **m})
        print(
            f"  {source:22} {name:50} {m['wall']:6.1f} s  peak RSS {_gb(m['maxrss'])} GB "
            f"(tree {_gb(m['tree'])} GB)"
        )
    shutil.rmtree(out, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| source | command | GB read | wall s | × cp | peak RSS GB | tree peak RSS GB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    floor = {r["source"]: r["wall"] for r in rows if r["tool"].startswith("`cp")}
    for r in rows:
        ratio = f"{r['wall'] / floor[r['source']]:.1f}×" if r["source"] in floor else "—"
        lines.append(
            f"| {r['source']} | {r['tool']} | {_gb(r['bytes'])} | {r['wall']:.1f} | "
            f"{ratio} | {_gb(r['maxrss'])} | {_gb(r['tree'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=["550m", "small"], default="550m")
    p.add_argument("--workdir", type=Path, default=None, help="default: a fresh temp folder")
    p.add_argument("--rounds", type=int, default=3, help="runs of every command (median shown)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    p.add_argument("--reuse", action="store_true", help="use a checkpoint left by --keep")
    p.add_argument("--make", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--step-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make:
        make_worker(args.size, args.step_dir)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardctl-bench-convert-"))
    try:
        rows = run(args.size, workdir, args.rounds, args.reuse)
        print()
        print(table(rows))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
