"""`shardctl ls` and `shardctl status NAME` with many recorded jobs: 10, 100 and 1,000.

    python benchmarks/ls_many.py                          # local and slurm, 10 100 1000
    python benchmarks/ls_many.py --jobs 10 100 --clusters local --markdown

For each cluster and N, a fresh state directory (SHARDCTL_STATE_DIR) holding N job
records, each pointing at a run dir that looks like a real one:

- local: a third finished (exit 0, DONE, 20/20 steps logged), a third failed (exit 1,
  a FAILED marker from rank 1), a third running (`local.pid` names a live process of
  this script, with its start time); each with job.yaml (the rendered tiny-llama
  example's, from tests/golden), logs/metrics.jsonl, the launcher's logs,
  CURRENT_ATTEMPT and a line of attempts.jsonl, the markers written with the helpers
  the real run uses (`outcome.done_marker`, `RunDir.write_marker` ...);
- slurm: records of real job ids the dev cluster's accounting knows
  (`sacct -X -n -o JobID`, reused round-robin when there are fewer than N), each
  with a run dir on this machine (a shared file system's, as Slurm's run dirs are).
  Nothing is submitted.

Then `shardctl ls` and `shardctl status NAME` (the middle job) each run `--repeat` times
(default once; the median wall time is shown) as a user runs them (the `shardctl`
script beside this interpreter, the default `--timeout`), measured from outside: wall
time, the rows marked stale (`*`), peak threads and peak child processes (sampled from
/proc every SAMPLE_S), and the Slurm commands it ran.
Those are counted by small wrappers put first on PATH (`scontrol`, `sacct`,
`squeue`: bash, which logs each start and end with $EPOCHREALTIME and runs the real
command; about 2 ms each): how many, how many at once at most, and how many were still
running when shardctl exited (it does not wait for them). Before the next
measurement the script waits for those to end.

Prints one JSON line per measurement and, with --markdown, the table for
benchmarks/README.md. Every process is started with a timeout and ended by its id.
The numbers of the code before a change: the same script with PYTHONPATH pointing at
a folder whose `shardctl/` holds that code (the children inherit it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "tiny-llama" / "local"
SAMPLE_S = 0.005
SLURM_COMMANDS = ("scontrol", "sacct", "squeue")
STEPS = 20
RUN_TIMEOUT_S = 600.0


# ------------------------------------------------------------------ the records


def _metrics(run_dir: Path, rows: int, started: float) -> None:
    """logs/metrics.jsonl as the loop writes it (one line per logged step)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / "metrics.jsonl").open("w") as f:
        for step in range(1, rows + 1):
            f.write(
                json.dumps(
                    {"step": step, "loss": 5.0 - step / 10, "tokens_per_s": 1234.5,
                     "time": started + step, "slowest_rank": step % 2, "step_s_max": 0.52,
                     "step_s_median": 0.5}
                ) + "\n"
            )  # fmt: skip
    (logs / "launcher.out").write_text("".join(f"step {s:4d}/{STEPS}\n" for s in range(rows)))
    (logs / "launcher.err").write_text("")


def _job_yaml(run_dir: Path, name: str) -> None:
    """The job.yaml a run starts with: the rendered tiny-llama example's (127 lines, as
    `shardctl render` writes every spec), renamed; `ls` reads `train.steps` from it."""
    text = (GOLDEN / "job.yaml").read_text()
    for old, new in (
        ("name: tiny-llama\n", f"name: {name}\n"),
        ("run_dir: runs/tiny-llama\n", f"run_dir: {run_dir}\n"),
        ("\n  steps: 200\n", f"\n  steps: {STEPS}\n"),
    ):
        if old not in text:
            raise SystemExit(f"{GOLDEN / 'job.yaml'} has no {old.strip()!r}: update _job_yaml")
        text = text.replace(old, new, 1)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.yaml").write_text(text)


def _attempt_line(run_dir: Path, job: str, kind: str, decision: str, start: float) -> None:
    """One line of attempts.jsonl, the keys `outcome.record_attempt` writes."""
    entry = {
        "job": job, "attempt": 0, "restart": 0, "start": start, "end": start + STEPS,
        "time": start + STEPS, "kind": kind, "decision": decision,
        "checkpoint_step": STEPS if kind == "done" else None, "advanced": kind == "done",
        "summary": kind,
    }  # fmt: skip
    with (run_dir / "attempts.jsonl").open("a") as f:
        f.write(json.dumps(entry) + "\n")


def make_local(runs: Path, n: int, live: subprocess.Popen[bytes]) -> list[str]:
    """N local jobs (finished, failed, running in turn); their names."""
    from shardctl.orchestrator.clusters.base import JobRef
    from shardctl.orchestrator.clusters.records import remember
    from shardctl.orchestrator.outcome import done_marker, failed_marker
    from shardctl.orchestrator.proctree import start_ticks
    from shardctl.orchestrator.rundir import DONE_FILE, FAILED_FILE, RunDir

    started = time.time() - 3600
    ticks = start_ticks(live.pid) or ""
    names = []
    for i in range(n):
        name = f"local-{i:04d}"
        run_dir = runs / name
        _job_yaml(run_dir, name)
        (run_dir / "CURRENT_ATTEMPT").write_text(
            json.dumps({"token": f"local-{name}-0", "cluster": "local", "attempt": 0}) + "\n"
        )
        kind = ("done", "failed", "running")[i % 3]
        if kind == "running":
            _metrics(run_dir, STEPS // 2, started)
            (run_dir / "local.pid").write_text(f"{live.pid} {ticks}\n")
        else:
            _metrics(run_dir, STEPS if kind == "done" else STEPS // 2, started)
            (run_dir / "local.pid").write_text(f"{2**22 - 1 - i} 1\n")  # a pid long gone
            if kind == "done":
                RunDir(run_dir).write_marker(DONE_FILE, done_marker(STEPS))
                (run_dir / "local.exit").write_text("0\n")
                _attempt_line(run_dir, "local-0", "done", "finish", started)
            else:
                RunDir(run_dir).write_marker(FAILED_FILE, failed_marker(3, 1))
                (run_dir / "local.exit").write_text("1\n")
                _attempt_line(run_dir, "local-0", "failed", "stop", started)
        # The pid file is the start's clock: markers older than it are an earlier start's.
        os.utime(run_dir / "local.pid", (started, started))
        remember(JobRef("local", str(live.pid), name, str(run_dir), {"attempt": 0}))
        names.append(name)
    return names


def slurm_job_ids(tries: int = 12) -> list[str]:
    """The job ids the dev cluster's accounting knows (its controller may be
    restarting: asked again every 5 s, a minute at most)."""
    if shutil.which("sacct") is None:
        raise SystemExit("no sacct on PATH: run with --clusters local, or where Slurm is")
    for attempt in range(tries):
        out = subprocess.run(
            ["sacct", "-X", "-n", "-o", "JobID"], capture_output=True, text=True, timeout=60
        )
        ids = [w for w in out.stdout.split() if w.isdigit()]
        if out.returncode == 0 and ids:
            return ids
        if attempt < tries - 1:
            time.sleep(5)
    raise SystemExit(f"sacct lists no job ids: {out.stderr.strip() or '(no output)'}")


def make_slurm(runs: Path, n: int, ids: list[str]) -> list[str]:
    """N Slurm jobs pointing at `ids` round-robin; their names."""
    from shardctl.orchestrator.clusters.base import JobRef
    from shardctl.orchestrator.clusters.records import remember

    started = time.time() - 3600
    names = []
    for i in range(n):
        name, job_id = f"slurm-{i:04d}", ids[i % len(ids)]
        run_dir = runs / name
        _job_yaml(run_dir, name)
        _metrics(run_dir, STEPS, started)
        _attempt_line(run_dir, job_id, "done", "finish", started)
        extra = {"folder": str(run_dir / "submitit" / job_id), "nodes": 2}
        remember(JobRef("slurm", job_id, name, str(run_dir), extra))
        names.append(name)
    return names


# -------------------------------------------------------------- measuring


SHIM = """#!/bin/bash
# Logs this Slurm command's start and end for benchmarks/ls_many.py, then runs it.
printf 'start %s %s %s\\n' "$$" "$EPOCHREALTIME" "${0##*/}" >>"$SHARDCTL_BENCH_LOG"
"$REAL" "$@"
rc=$?
printf 'end %s %s\\n' "$$" "$EPOCHREALTIME" >>"$SHARDCTL_BENCH_LOG"
exit $rc
"""


def install_shims(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for command in SLURM_COMMANDS:
        real = shutil.which(command)
        if real is None:
            continue
        path = folder / command
        path.write_text(SHIM.replace('"$REAL"', f'"{real}"'))
        path.chmod(0o755)


@dataclass
class SlurmCalls:
    count: dict[str, int] = field(default_factory=dict)
    peak_at_once: int = 0
    running_at_exit: int = 0


def read_calls(log: Path, exited: float) -> SlurmCalls:
    """What the wrappers logged: commands by name, most at once, still running at
    `exited` (shardctl's exit, time.time())."""
    events: list[tuple[float, int]] = []
    calls = SlurmCalls()
    ends: dict[str, float] = {}
    starts: dict[str, float] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        words = line.split()
        if words[0] == "start":
            calls.count[words[3]] = calls.count.get(words[3], 0) + 1
            starts[words[1]] = float(words[2])
            events.append((float(words[2]), 1))
        elif words[0] == "end":
            ends[words[1]] = float(words[2])
            events.append((float(words[2]), -1))
    now = 0
    for _, step in sorted(events):
        now += step
        calls.peak_at_once = max(calls.peak_at_once, now)
    calls.running_at_exit = sum(1 for pid in starts if ends.get(pid, float("inf")) > exited)
    return calls


def wait_calls_ended(log: Path, seconds: float = 300.0) -> None:
    """Wait until every logged Slurm command has ended (shardctl left some running)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if text.count("start ") <= text.count("end "):
            return
        time.sleep(0.2)


@dataclass
class Peaks:
    threads: int = 0
    children: int = 0
    samples: int = 0


def _children(pid: int) -> int:
    count = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                count += len(f.read().split())
        except OSError:
            continue
    return count


def _threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _sample(pid: int, peaks: Peaks, done: threading.Event) -> None:
    while not done.is_set():
        peaks.threads = max(peaks.threads, _threads(pid))
        peaks.children = max(peaks.children, _children(pid))
        peaks.samples += 1
        done.wait(SAMPLE_S)


@dataclass
class Measured:
    cluster: str
    jobs: int
    command: str
    wall_s: float
    code: int
    stale: int
    threads: int
    children: int
    samples: int
    slurm: SlurmCalls
    stderr: str


def shardctl() -> list[str]:
    """The `shardctl` console script beside this interpreter, else `python -m`."""
    script = Path(sys.executable).parent / "shardctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardctl.orchestrator.cli"]


def run(cluster: str, jobs: int, args: list[str], env: dict[str, str], log: Path) -> Measured:
    log.unlink(missing_ok=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [*shardctl(), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    peaks, done = Peaks(), threading.Event()
    sampler = threading.Thread(target=_sample, args=(proc.pid, peaks, done), daemon=True)
    sampler.start()
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=30)
        stderr += f"\n(killed after {RUN_TIMEOUT_S:g} s)"
    finally:
        done.set()
        sampler.join(5)
    wall = time.monotonic() - t0
    exited = time.time()
    wait_calls_ended(log)
    calls = read_calls(log, exited)
    stale = sum(1 for line in stdout.splitlines() if line.startswith("* "))
    return Measured(
        cluster, jobs, " ".join(args[:1]), round(wall, 2), proc.returncode, stale,
        peaks.threads, peaks.children, peaks.samples, calls, stderr[-2000:],
    )  # fmt: skip


def one(
    cluster: str,
    n: int,
    ids: list[str],
    live: subprocess.Popen[bytes],
    keep: Path | None,
    repeat: int,
) -> list[Measured]:
    with tempfile.TemporaryDirectory(prefix="ls-many-") as home:
        base = keep / f"{cluster}-{n}" if keep is not None else Path(home)
        os.environ["SHARDCTL_STATE_DIR"] = str(base / "state")  # for remember()
        names = (
            make_local(base / "runs", n, live)
            if cluster == "local"
            else make_slurm(base / "runs", n, ids)
        )
        shims, log = base / "bin", base / "slurm-calls.log"
        install_shims(shims)
        env = {
            **os.environ,
            "PATH": f"{shims}{os.pathsep}{os.environ.get('PATH', '')}",
            "SHARDCTL_BENCH_LOG": str(log),
            "SHARDCTL_STATE_DIR": str(base / "state"),
        }
        out = [
            best_of([run(cluster, n, args, env, log) for _ in range(repeat)])
            for args in (["ls"], ["status", names[len(names) // 2]])
        ]
    return out


def best_of(runs: list[Measured]) -> Measured:
    """Several runs of one command as one: the median wall time, the largest peaks and
    stale count (the Slurm commands are the same every time), the first failure."""
    walls = sorted(m.wall_s for m in runs)
    failed = next((m for m in runs if m.code != 0), runs[-1])
    return Measured(
        failed.cluster, failed.jobs, failed.command, walls[len(walls) // 2], failed.code,
        max(m.stale for m in runs), max(m.threads for m in runs),
        max(m.children for m in runs), sum(m.samples for m in runs),
        max(runs, key=lambda m: m.slurm.peak_at_once).slurm, failed.stderr,
    )  # fmt: skip


def markdown(rows: list[Measured]) -> str:
    head = (
        "| cluster | jobs | command | wall s | stale rows | peak threads | peak children "
        "| Slurm commands | most at once | running at exit |\n"
        "|---|---:|---|---:|---:|---:|---:|---|---:|---:|"
    )
    lines = [head]
    for m in rows:
        cmds = ", ".join(f"{v} {k}" for k, v in sorted(m.slurm.count.items())) or "0"
        lines.append(
            f"| {m.cluster} | {m.jobs:,} | `{m.command}` | {m.wall_s:.2f} | {m.stale} | "
            f"{m.threads} | {m.children} | {cmds} | {m.slurm.peak_at_once} | "
            f"{m.slurm.running_at_exit} |"
        )
    return "\n".join(lines)


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    info = dict(
        (key.strip(), value.strip())
        for key, sep, value in (ln.partition(":") for ln in out.splitlines())
        if sep
    )
    return (
        f"{info.get('Model name', '?')} (family {info.get('CPU family', '?')}, model "
        f"{info.get('Model', '?')}), {os.cpu_count()} CPUs"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--clusters", nargs="+", choices=("local", "slurm"), default=["local", "slurm"])
    p.add_argument("--markdown", action="store_true")
    p.add_argument(
        "--repeat", type=int, default=1, help="run each command this many times (median wall)"
    )
    p.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="build the records and run dirs under this folder (CLUSTER-N/) and keep them",
    )
    args = p.parse_args()
    if any(n < 1 for n in args.jobs):
        p.error("--jobs: every count must be at least 1")
    if args.repeat < 1:
        p.error("--repeat: at least 1")
    ids = slurm_job_ids() if "slurm" in args.clusters else []
    # The "running" local jobs' process: alive for the whole benchmark, then ended.
    live = subprocess.Popen(["sleep", "3600"], start_new_session=True)
    rows: list[Measured] = []
    try:
        for cluster in args.clusters:
            for n in args.jobs:
                for m in one(cluster, n, ids, live, args.keep, args.repeat):
                    print(json.dumps({**asdict(m), "stderr": m.stderr[-300:]}), flush=True)
                    rows.append(m)
    finally:
        os.killpg(live.pid, signal.SIGTERM)
        live.wait(10)
    print(f"\nCPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
