"""Cold start-up: `shardctl render`/`validate` vs `accelerate launch --help`, `deepspeed --help`.

Every measurement is a fresh process (nothing cached in-process), the commands are
interleaved round by round so load on the machine hits all of them alike, and the
table reports the median of N rounds. The goal: `shardctl render` at least 8× faster
than either launcher's `--help`, because shardctl never imports torch to start.

    python benchmarks/startup.py            # 5 rounds
    python benchmarks/startup.py --repeats 11
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL = 8.0


def commands(spec: Path, out: Path) -> dict[str, list[str]]:
    bindir = Path(sys.executable).parent  # the console scripts of this environment
    return {
        "shardctl render": [
            str(bindir / "shardctl"),
            "render",
            str(spec),
            "--cluster",
            "local",
            "--out",
            str(out),
        ],
        "shardctl validate": [str(bindir / "shardctl"), "validate", str(spec)],
        "accelerate launch --help": [str(bindir / "accelerate"), "launch", "--help"],
        "deepspeed --help": [str(bindir / "deepspeed"), "--help"],
        # The floor: an interpreter that imports nothing of ours.
        "python -c pass": [sys.executable, "-c", "pass"],
    }


def time_once(argv: list[str]) -> tuple[float, float]:
    """Wall-clock seconds and CPU seconds (user + sys, children included) of one run.

    CPU time is the steadier number on a shared machine: waiting for a core does
    not count, so it shows the work each command does to start.
    """
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(argv)} failed ({code}):\n{err.read().decode()}")
    return wall, usage.ru_utime + usage.ru_stime


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="rounds (each a fresh process)")
    ap.add_argument("--spec", type=Path, default=ROOT / "examples" / "tiny-llama.yaml")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")

    with tempfile.TemporaryDirectory() as tmp:
        cmds = commands(args.spec, Path(tmp) / "rendered")
        times: dict[str, list[float]] = {name: [] for name in cmds}
        cpu: dict[str, list[float]] = {name: [] for name in cmds}
        for _ in range(args.repeats):
            for name, argv in cmds.items():
                wall, used = time_once(argv)
                times[name].append(wall)
                cpu[name].append(used)

    median = {name: statistics.median(ts) for name, ts in times.items()}
    cpu_median = {name: statistics.median(ts) for name, ts in cpu.items()}
    base, cpu_base = median["shardctl render"], cpu_median["shardctl render"]
    print(
        f"{args.repeats} rounds, fresh process each; {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, torch {version('torch')}, "
        f"accelerate {version('accelerate')}, deepspeed {version('deepspeed')}, "
        f"shardctl {version('shardctl')}\n"
    )
    print("| command | wall median s | min s | max s | × render | CPU median s | × render |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, ts in times.items():
        print(
            f"| `{name}` | {median[name]:.3f} | {min(ts):.3f} | {max(ts):.3f} | "
            f"{median[name] / base:.1f}× | {cpu_median[name]:.3f} | "
            f"{cpu_median[name] / cpu_base:.1f}× |"
        )
    launchers = ("accelerate launch --help", "deepspeed --help")
    worst = min(median[n] for n in launchers) / base
    worst_cpu = min(cpu_median[n] for n in launchers) / cpu_base
    verdict = "meets" if worst >= GOAL else "MISSES"
    print(
        f"\n`shardctl render` is {worst:.1f}× faster (wall clock, median) than the faster "
        f"launcher `--help` ({verdict} the ≥ {GOAL:.0f}× goal); in CPU time {worst_cpu:.1f}×."
    )


if __name__ == "__main__":
    main()
