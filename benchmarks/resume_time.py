"""Resume time: from process start to the first training step after a resume.

    python benchmarks/resume_time.py [--nproc 2] [--layers 8] [--hidden 512] [--rounds 2]

Trains a Llama (vocab 256, `--layers` × `--hidden`) with FSDP2 on `--nproc` CPU
ranks for 2 steps and saves a checkpoint (model + AdamW state, ~12 bytes per
parameter). Then, `--rounds` times each:

- resume: start `torchrun -m shardctl.train` on that run dir; it verifies the
  checkpoint against its manifest (sha256 of every file), loads it through DCP,
  and runs step 3;
- fresh: the same start with `checkpoint.resume: never` (no load), running step 1.

The time is from launching torchrun to the wall-clock stamp of that step's line in
`logs/metrics.jsonl`, so it covers interpreter and library imports, the process
group, model build and sharding, checkpoint verification and load, and one step.
The resumed run also reports how long verifying (sha256 of every file) and loading
the checkpoint took inside the ranks — what resuming itself costs; resume − fresh
says the same, but within the noise of a shared machine. Each run stops right after its step
(SHARDCTL_STOP_AFTER_STEP, which saves that step like a preemption would; the
save happens after the stamp, so it is not counted). Prints JSON, and a Markdown
row with --markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def _spec(work: Path, name: str, args: argparse.Namespace, resume: str, ckpt_dir: Path) -> Path:
    h = args.hidden
    spec = {
        "name": name,
        "resources": {"nodes": 1, "procs_per_node": args.nproc, "device": "cpu"},
        "strategy": {"backend": "fsdp", "sharding": "full_shard", "precision": "bf16-mixed"},
        "train": {
            "model": {
                "llama": {
                    "vocab_size": 256,
                    "hidden_size": h,
                    "intermediate_size": int(h * 8 / 3) // 64 * 64,
                    "num_hidden_layers": args.layers,
                    "num_attention_heads": max(h // 64, 1),
                    "num_key_value_heads": max(h // 64, 1),
                    "max_position_embeddings": 128,
                }
            },
            "data": {"builtin": "python-stdlib"},
            "steps": 1000,
            "micro_batch_size": 1,
            "seq_len": 64,
        },
        "checkpoint": {"every_steps": 1000, "keep": 2, "dir": str(ckpt_dir), "resume": resume},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(spec: Path, nproc: int, stop_after: int) -> str:
    env = dict(os.environ, SHARDCTL_STOP_AFTER_STEP=str(stop_after))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), "-m", "shardctl.train", str(spec),
    ]  # fmt: skip
    # Exit status 1 is expected: the ranks stop with EXIT_PREEMPTED, which torchrun
    # reports as a failure; the PREEMPTED marker says the stop was the planned one.
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    marker = spec.parent / spec.stem / "PREEMPTED"
    if json.loads(marker.read_text())["step"] != stop_after:
        raise RuntimeError(f"run {spec} did not stop at step {stop_after}")
    return res.stdout + res.stderr


def _first_step_time(run_dir: Path, step: int) -> float:
    rows = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    return next(r["time"] for r in rows if r["step"] == step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    resume_s: list[float] = []
    fresh_s: list[float] = []
    load_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="resume-time-") as tmp:
        work = Path(tmp)
        base = work / "base"
        _run(_spec(work, "base", args, "auto", base / "checkpoints"), args.nproc, 2)
        ckpt = base / "checkpoints" / "step-00000002"
        manifest = json.loads((ckpt / "manifest.json").read_text())
        size = sum(f["size"] for f in manifest["files"].values())
        for i in range(args.rounds):
            # Resume from a pristine copy each round (a resumed run saves step 3).
            name = f"resume{i}"
            shutil.copytree(base / "checkpoints", work / name / "checkpoints")
            spec = _spec(work, name, args, "auto", work / name / "checkpoints")
            t0 = time.time()
            out = _run(spec, args.nproc, 3)
            resume_s.append(_first_step_time(work / name, 3) - t0)
            found = re.search(r"verified and loaded in ([0-9.]+) s", out)
            load_s.append(float(found.group(1)) if found else float("nan"))
            name = f"fresh{i}"
            spec = _spec(work, name, args, "never", work / name / "checkpoints")
            t0 = time.time()
            _run(spec, args.nproc, 1)
            fresh_s.append(_first_step_time(work / name, 1) - t0)
    params = manifest["model"]["hf_config"]
    result = {
        "nproc": args.nproc,
        "layers": params["num_hidden_layers"],
        "hidden": params["hidden_size"],
        "checkpoint_bytes": size,
        "resume_to_first_step_s": [round(x, 2) for x in resume_s],
        "fresh_to_first_step_s": [round(x, 2) for x in fresh_s],
        "verify_and_load_s": load_s,
        "resume_cost_s": round(statistics.median(resume_s) - statistics.median(fresh_s), 2),
    }
    print(json.dumps(result, indent=2))
    if args.markdown:
        print(
            f"| {args.layers}×{args.hidden} Llama, {args.nproc} CPU ranks, checkpoint "
            f"{size / 2**20:.0f} MiB | {statistics.median(resume_s):.1f} s | "
            f"{statistics.median(fresh_s):.1f} s | {statistics.median(load_s):.1f} s |"
        )


if __name__ == "__main__":
    main()
