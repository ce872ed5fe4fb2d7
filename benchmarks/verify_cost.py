"""What verifying against the manifest costs: `shardctl consolidate` with its default
sha256 check (hashed alongside the copy) against `--no-verify` and `cp -r`.

    python benchmarks/verify_cost.py                # ~512 MiB checkpoint, 5 rounds
    python benchmarks/verify_cost.py --mib 64 --rounds 2   # a quick smoke run

1. Writes a synthetic DCP checkpoint in the shardctl layout, its data in `--shards`
   files as that many ranks would write them (default 2; fp32
   weights plus an Adam moment of the same size, so half the bytes are optimizer
   state that consolidation does not copy but verification hashes), with its
   manifest through shardctl's own writer.
2. Runs each command as its own process, interleaved round by round, on a warm
   page cache (every file read once first), and reports median wall seconds:
   `cp -r` of the step folder (the floor: every byte read and written once),
   sha256 of every file alone (the hashing floor: what verification must compute),
   `shardctl consolidate --no-verify` (sizes only) and `shardctl consolidate`
   (every file's sha256 checked while the weights are copied).
3. Prints a Markdown table and deletes what it wrote.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
HASH_ALL = (
    "import sys; from shardctl.train.manifest import sha256_file\n"
    "for path in sys.argv[1:]: sha256_file(path)"
)


def make_checkpoint(step_dir: Path, mib: int, shards: int = 2) -> int:
    """A DCP step folder whose weights total `mib` MiB (+ the same again of Adam state),
    written in `shards` data files as `shards` ranks would write them."""
    import torch
    import torch.distributed.checkpoint as dcp
    from shardctl.train import manifest as contract
    from torch.distributed.checkpoint import FileSystemWriter

    side = 2048  # 16 MiB per fp32 tensor
    count = max(1, mib // 16)
    gen = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(side, side, generator=gen) for i in range(count)}
    optim = {"state": {k: {"exp_avg": torch.randn_like(v)} for k, v in model.items()}}
    writer = FileSystemWriter(str(step_dir / "dcp"), thread_count=shards)
    dcp.save({"model": model, "optim": optim}, storage_writer=writer, no_dist=True)
    files = contract.describe_files(step_dir, contract.list_files(step_dir))
    contract.write_manifest(
        step_dir,
        {
            "format_version": contract.FORMAT_VERSION,
            "step": 1,
            "world_size": 1,
            "backend": "fsdp",
            "sharding": "full_shard",
            "zero_stage": 3,
            "precision": "fp32",
            "model": {"source": "synthetic", "dtype": "fp32", "hf_config": None},
            "versions": {},
            "files": files,
        },
    )
    return sum(f["size"] for f in files.values())


def _warm(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with f.open("rb") as fh:
                while fh.read(8 << 20):
                    pass


def _time(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="fp32 weights in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--shards", type=int, default=2, help="data files, as that many ranks would write"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shardctl-verify-bench-"))
    try:
        step = work / "checkpoints" / "step-00000001"
        nbytes = make_checkpoint(step, args.mib, args.shards)
        _warm(step)
        shardctl = str(BIN / "shardctl")
        hashed = [str(f) for f in sorted(step.rglob("*")) if f.is_file()]
        base = [shardctl, "consolidate", str(step), "--no-progress", "--out"]
        commands = {
            "`cp -r` of the step folder": lambda out: ["cp", "-r", str(step), str(out)],
            # The hashing floor: every byte through hashlib's sha256 once (what the
            # verification thread computes), file after file, in a fresh interpreter.
            "sha256 of every file (hashlib, alone)": lambda out: [
                sys.executable,
                "-c",
                HASH_ALL,
                *hashed,
            ],
            "`shardctl consolidate --no-verify`": lambda out: [*base, str(out), "--no-verify"],
            "`shardctl consolidate` (verify, default)": lambda out: [*base, str(out)],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for r in range(args.rounds):
            for i, (name, cmd) in enumerate(commands.items()):
                out = work / f"out-{r}-{i}"
                times[name].append(_time(cmd(out)))
                shutil.rmtree(out, ignore_errors=True)
        floor = statistics.median(times["`cp -r` of the step folder"])
        print(f"checkpoint: {nbytes / 2**20:.0f} MiB ({args.mib} MiB of weights), "
              f"{args.rounds} rounds, warm page cache\n")  # fmt: skip
        print("| command | median s | min s | max s | × cp -r |")
        print("|---|---:|---:|---:|---:|")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name} | {med:.2f} | {min(ts):.2f} | {max(ts):.2f} | {med / floor:.2f}× |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
