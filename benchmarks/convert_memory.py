"""Peak memory of `shardctl convert --to deepspeed`: the engine writer (N CPU ranks run a
ZeRO engine over the whole fp32 state and save it; `--ds-writer engine`, the only way
before) against the direct writer (one process writes DeepSpeed's files; the default).

    python benchmarks/convert_memory.py                  # the small Llama, then the 551M one
    python benchmarks/convert_memory.py --size small     # a quick run (about a minute)

1. Builds the source checkpoint: the Llama of benchmarks/consolidate.py (small: 7.3M
   parameters; 550m: hidden 1536, 16 layers, vocab 32000, 551M parameters, 2.21 GB in
   fp32) after one AdamW step over shardctl's two param groups, saved as an FSDP run
   saves it (torch.distributed.checkpoint: `model` and `optim` state dicts by parameter
   name) with a shardctl manifest — in one process, no process group: fp32 weights plus
   both Adam moments, 3 × 2.21 GB for 550m.
2. Runs `shardctl convert STEP --to deepspeed` as its own process per row, on a warm
   page cache and after a `sync`: ZeRO-3 on 2 ranks directly; for 550m also directly
   ZeRO-1 on 2 ranks (the whole module in one model-states file) and ZeRO-2 on 1 rank
   (a 6.6 GB optimizer file: ZIP64; its masters and moments are compared with the
   source's, tensor by tensor, and its zip CRCs checked); last, ZeRO-3 on 2 ranks
   through the engine (unless --no-engine). Peak RSS: wait4's
   ru_maxrss of the command's process, and the sum over its process tree (psutil,
   every 20 ms; the engine writer's ranks are child processes, so the tree is the
   number to compare).
3. Checks the direct ZeRO-3 output against the engine's (every file, key by key:
   tests/helpers/ds_compare.py, each file loaded with mmap) unless --no-compare;
   prints a Markdown table with the CPU model; deletes what it wrote unless --keep.
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

from consolidate import _config, _gb, _warm, measure  # benchmarks/consolidate.py

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def make_source(size: str, step_dir: Path) -> None:
    """One AdamW step of the Llama, saved with DCP as an FSDP run saves it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from shardctl.train.manifest import describe_files, list_files, write_manifest
    from shardctl.train.optim import BETAS, EPS, param_groups
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = _config(size)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=BETAS, eps=EPS)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    names = {id(p): n for n, p in model.named_parameters()}
    saved = opt.state_dict()
    ids_in_order = [p for group in opt.param_groups for p in group["params"]]
    fqn = {i: names[id(p)] for i, p in enumerate(ids_in_order)}
    optim = {
        "state": {fqn[i]: s for i, s in saved["state"].items()},
        "param_groups": [
            {**g, "params": [fqn[i] for i in g["params"]]} for g in saved["param_groups"]
        ],
    }
    tmp = step_dir.with_name(step_dir.name + ".tmp")
    dcp.save({"model": model.state_dict(), "optim": optim}, checkpoint_id=str(tmp / "dcp"),
             no_dist=True)  # fmt: skip
    manifest = {
        "format_version": 1,
        "step": 1,
        "world_size": 1,
        "backend": "fsdp",
        "sharding": "full_shard",
        "zero_stage": 3,
        "precision": "fp32",
        "model": {"source": "llama", "dtype": "fp32", "hf_config": config.to_dict()},
        "versions": {"torch": torch.__version__, "shardctl": "", "deepspeed": None},
        "files": describe_files(tmp, list_files(tmp)),
    }
    write_manifest(tmp, manifest)
    os.replace(tmp, step_dir)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _compare(a: Path, b: Path) -> list[str]:
    """Key-by-key differences of two DeepSpeed checkpoints (tensors mapped, not read in)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.ds_compare import folder_differences

    return folder_differences(a, b, mmap=True)


def _check(src: Path, dst: Path) -> str:
    """A 1-rank ZeRO-1/2 checkpoint holds every group's masters and moments whole, in
    order: compare them with the source's, tensor by tensor (the files mapped, the
    source read one tensor at a time); the optimizer file's zip CRCs are checked too."""
    import zipfile

    import torch
    from shardctl.train.backends.deepspeed import import_deepspeed
    from shardctl.train.portable.state import materialize, read_state

    import_deepspeed()
    state = read_state(src, json.loads((src / "manifest.json").read_text()))
    optim = next((dst / "deepspeed").glob("*optim_states.pt"))
    with zipfile.ZipFile(optim) as zf:
        bad = zf.testzip()
    sd = torch.load(optim, map_location="cpu", weights_only=False, mmap=True)
    inner = sd["optimizer_state_dict"]
    for g, names in enumerate(state.groups):
        flat = {
            "master": inner["single_partition_of_fp32_groups"][g],
            **{k: inner["base_optimizer_state"]["state"][g][k] for k in ("exp_avg", "exp_avg_sq")},
        }
        at = 0
        for name in names:
            n = state.master[name].numel
            for kind, tensor in flat.items():
                src_tensor = state.master[name] if kind == "master" else state.moments[kind][name]
                if not torch.equal(tensor[at : at + n], materialize(src_tensor).reshape(-1)):
                    return f"{name} {kind} differs"
            at += n
    size = optim.stat().st_size
    return f"{'CRC error in ' + bad if bad else 'equal'} ({optim.name}: {size / 1e9:.2f} GB)"


def run(size: str, workdir: Path, compare: bool, engine: bool) -> list[dict]:
    src = workdir / f"src-{size}" / "checkpoints" / "step-00000001"
    if not src.is_dir():
        print(f"[{size}] building the source checkpoint (one AdamW step, DCP) ...", flush=True)
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, __file__, "--make", "--size", size, "--step-dir", str(src)],
            check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )  # fmt: skip
        print(f"  {time.perf_counter() - t:.0f} s, {_gb(_du(src))} GB", flush=True)
    shardctl = str(BIN / "shardctl")
    rows = [("direct", 3, 2)]
    if size == "550m":
        rows += [("direct", 1, 2), ("direct", 2, 1)]
    if engine:  # last: it needs the memory of the whole fp32 state
        rows.append(("engine", 3, 2))
    out: list[dict] = []
    kept: dict[str, Path] = {}
    for writer, stage, world in rows:
        dst = workdir / f"out-{size}-{writer}-z{stage}-w{world}"
        shutil.rmtree(dst, ignore_errors=True)
        _warm(src)
        os.sync()
        cmd = [shardctl, "convert", str(src), "--to", "deepspeed", "--world-size", str(world),
               "--zero-stage", str(stage), "--ds-writer", writer, "--out", str(dst)]  # fmt: skip
        m = measure(cmd)
        row = {"size": size, "writer": writer, "stage": stage, "world": world,
               "read": _du(src), "written": _du(dst), **m}  # fmt: skip
        out.append(row)
        print(
            f"  [{size}] {writer:6} ZeRO-{stage} × {world}: {m['wall']:6.1f} s, peak RSS "
            f"{_gb(m['maxrss'])} GB, tree {_gb(m['tree'])} GB", flush=True,
        )  # fmt: skip
        if stage == 3 and world == 2:
            kept[writer] = dst
            continue
        if world == 1 and compare:
            print(f"  [{size}] the 1-rank files hold the source's tensors: {_check(src, dst)}")
        shutil.rmtree(dst, ignore_errors=True)
    if compare and engine:
        diff = _compare(kept["direct"], kept["engine"])
        print(f"  [{size}] direct vs engine, key by key: {'identical' if not diff else diff[:5]}")
        for row in out:
            row["identical"] = not diff if row["stage"] == 3 and row["world"] == 2 else None
    for dst in kept.values():
        shutil.rmtree(dst, ignore_errors=True)
    return out


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def table(rows: list[dict]) -> str:
    lines = [
        "| model | writer | target | GB read | GB written | wall s | peak RSS GB "
        "| tree peak RSS GB |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['writer']} | ZeRO-{r['stage']} × {r['world']} | "
            f"{_gb(r['read'])} | {_gb(r['written'])} | {r['wall']:.1f} | {_gb(r['maxrss'])} | "
            f"{_gb(r['tree'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=["small", "550m", "both"], default="both")
    p.add_argument("--workdir", type=Path, default=None, help="default: a fresh temp folder")
    p.add_argument("--keep", action="store_true", help="keep the source checkpoints")
    p.add_argument("--no-compare", action="store_true", help="skip the key-by-key check")
    p.add_argument(
        "--no-engine", action="store_true", help="skip the engine writer (it needs ~16 GB at 550m)"
    )
    p.add_argument("--make", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--step-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make:
        make_source(args.size, args.step_dir)
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardctl-bench-convert-mem-"))
    try:
        rows: list[dict] = []
        for size in ("small", "550m") if args.size == "both" else (args.size,):
            rows += run(size, workdir, not args.no_compare, not args.no_engine)
        print()
        print(table(rows))
        print(f"\n(lscpu model name: {cpu_model()}, {os.cpu_count()} CPUs)")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
