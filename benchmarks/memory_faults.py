"""One fault schedule, the memory tier off and on, side by side (issue 34, item 5).

    python benchmarks/memory_faults.py --markdown
    python benchmarks/memory_faults.py --steps 160 --kill-every 30 --hang 3 --every 50 -k 10 \
        --tier-stall-json memory_tier.json --markdown
    python benchmarks/memory_faults.py --from-json saved.out     # the tables again

Two runs of the tests' tiny Llama (recovery.py's spec: FSDP2 full_shard, bf16-mixed,
gloo, a metrics line every step, the same seed) on the Slurm dev cluster, one node ×
`--procs` ranks (the memory tier runs on one node), `--steps` steps, a durable
checkpoint every `--every` steps; the second run also copies every rank's state into
the node's memory every `-k` steps (`checkpoint.memory_every_steps`). Both get the
same schedule, by the step the run has reached: a fault 3 steps after every
`--kill-every` steps (33, 63, ...: 3 steps after a memory copy when K divides it),
each a SIGKILL of rank 1, but the `--hang`-th, a SIGSTOP of rank 1 (the node's
watchdog ends the ranks after `--hang-timeout`); every fault is restarted in place.

For each fault: the step the run had reached, the step and tier it resumed from
(`logs/restores.jsonl`; none there: from scratch), the steps lost (reached − resumed),
and the seconds from the fault to the first step of the restarted ranks
(`logs/metrics.jsonl`). For each run: its wall time, its median step and `shardctl
status`'s goodput (`orchestrator/goodput.py`, which reads the same restores).

Then the 1,000-node goodput on paper (docs/guides/faults.md, "Goodput of a 1,000-node
job, on paper") recomputed with the tier:

    goodput ≈ (1 − C/T − S) × (1 − (D + R + L) / M)

S the tier's stall per step (benchmarks/memory_tier.py: `--tier-stall-json` its
output, the largest model's background copy; else `--tier-stall-pct`), L the work
redone per fault (K/2 steps × `--paper-step-s`), R the measured crash recovery with
the tier (median) + the 1,000-node rendezvous (30–60 s, assumed, as in the guide) +
the load from memory (the restore's own seconds, measured), D 0.2 s for a crash and
120 s (the hang timeout) for a hang; M, C, T as in the guide.

Prints one JSON document, and with --markdown the tables for benchmarks/README.md.
Every job is cancelled by its id and every process left is ended by its pid (through
recovery.py's `Run.cleanup`); the work folder is removed unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recovery as rec  # beside this file (sys.path above)

FIRST_STEP_TIMEOUT_S = 600.0  # from submit (a queue, imports) to the first step
FAULT_TIMEOUT_S = 300.0  # from a fault to the restarted ranks' first step
END_TIMEOUT_S = 600.0  # from the last fault to the job's end
LOOK_AHEAD_STEPS = 5  # the ranks are found this many steps before a fault's step
RUNNING_EVERY_S = 5.0  # how often the cluster is asked whether the job still runs
# The guide's terms (docs/guides/faults.md, "on paper"): a failure an hour, a durable
# save stalling 10 s every 30 minutes, a 1,000-node rendezvous of 30-60 s.
PAPER = {"M": 3600.0, "C": 10.0, "T": 1800.0, "rdzv": (30.0, 60.0), "hang_D": 120.0}


@dataclass(frozen=True)
class Fault:
    kind: str  # crash | hang
    at_step: int


def schedule(steps: int, every: int, hang: int) -> list[Fault]:
    """A fault 3 steps past every `every` steps (short of the run's last `every`/2),
    the `hang`-th (from 1; 0: none) a hang."""
    ats = [every * i + 3 for i in range(1, steps) if every * i + 3 <= steps - every // 2]
    return [Fault("hang" if i + 1 == hang else "crash", at) for i, at in enumerate(ats)]


class TierRun(rec.Run):
    """recovery.py's run on one node × `--procs` ranks, with or without the tier (mixed
    into its Slurm or local run: `tier_run`)."""

    def __init__(self, work: Path, args: argparse.Namespace, memory: bool) -> None:
        super().__init__(work, args)
        self.memory = memory
        self.world = args.procs
        self.name = f"memfaults-{'on' if memory else 'off'}-{os.getpid()}"
        self.run_dir = work / self.name
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.spec_path = work / f"{self.name}.yaml"

    def spec(self) -> dict[str, Any]:
        spec = super().spec()
        spec["resources"] = {"nodes": 1, "procs_per_node": self.args.procs, "device": "cpu"}
        spec["train"]["steps"] = self.args.steps
        spec["checkpoint"]["every_steps"] = self.args.every
        if self.memory:
            spec["checkpoint"]["memory_every_steps"] = self.args.k
        faults = schedule(self.args.steps, self.args.kill_every, self.args.hang)
        spec["restart"] = {"max_in_allocation": len(faults) + 1}
        if "slurm" in spec:
            spec["slurm"]["max_requeues"] = 1
        return spec

    def victim(self, ranks: list[rec.RunProc]) -> rec.RunProc:
        return next(p for p in ranks if p.rank == 1)


class SlurmTierRun(TierRun, rec.SlurmRun):
    pass


class LocalTierRun(TierRun, rec.LocalRun):
    pass


def tier_run(work: Path, args: argparse.Namespace, memory: bool) -> TierRun:
    kind = SlurmTierRun if args.cluster == "slurm" else LocalTierRun
    return kind(work, args, memory)


class Steps:
    """The run's logged (step, time) records, read as metrics.jsonl grows."""

    def __init__(self, run: TierRun) -> None:
        self.tail = rec.Tail(run.run_dir / "logs" / "metrics.jsonl", at_end=False)
        self.seen: list[tuple[int, float]] = []

    def pump(self) -> list[tuple[int, float]]:
        self.seen += rec.metrics_steps(self.tail.new())
        return self.seen


def all_alive(ranks: list[rec.RunProc], world: int) -> bool:
    """Whether `ranks` are the run's `world` ranks, every one still alive."""
    return len(ranks) == world and all(rec.alive(p.pid, p.ticks) for p in ranks)


def _claim_token(run: TierRun) -> str | None:
    token = (rec._json(run.run_dir / "CURRENT_ATTEMPT") or {}).get("token")
    return str(token) if token else None


def _restores_since(run: TierRun, since: float) -> list[dict[str, Any]]:
    lines = rec._jsonl(run.run_dir / "logs" / "restores.jsonl")
    return [r for r in lines if isinstance(r.get("time"), int | float) and r["time"] >= since]


def inject(run: TierRun, steps: Steps, fault: Fault) -> dict[str, Any]:
    """Wait until the run reached `fault.at_step` with all its ranks up, inject the
    fault, wait for the restarted ranks' first step; what it cost."""

    # The ranks are found ahead of the step (a walk of /proc takes a while on a loaded
    # host: found at the step, the kill would land steps late), and the cluster asked
    # whether the job still runs only every few seconds (squeue is not free either).
    ranks: list[rec.RunProc] = []
    looked = [time.monotonic()]

    def due() -> list[rec.RunProc] | None:
        time.sleep(0.02)
        seen = steps.pump()
        step = seen[-1][0] if seen else 0
        if step >= fault.at_step - LOOK_AHEAD_STEPS and not all_alive(ranks, run.world):
            ranks[:] = [p for p in rec.scan(run.run_dir) if p.role == "rank"]
        if step >= fault.at_step and all_alive(ranks, run.world):
            return ranks
        if time.monotonic() - looked[0] > RUNNING_EVERY_S:
            looked[0] = time.monotonic()
            if not run.running():
                raise RuntimeError(f"{run.name}: the job ended before step {fault.at_step}")
        return None

    rec._until(f"step {fault.at_step}", due, FIRST_STEP_TIMEOUT_S, run)
    token_before = _claim_token(run)
    victim = run.victim(ranks)
    t_fault = time.time()
    if fault.kind == "crash":
        os.kill(victim.pid, signal.SIGKILL)
    else:
        os.kill(victim.pid, signal.SIGSTOP)
        run.stopped.append(victim)
    claimed: list[float] = []

    def restarted() -> tuple[int, float] | None:
        time.sleep(0.02)
        seen = steps.pump()
        if not claimed:
            token = _claim_token(run)
            mtime = rec._mtime(run.run_dir / "CURRENT_ATTEMPT")
            if token is None or token == token_before or mtime is None:
                return None
            claimed.append(mtime)
        return next(((s, t) for s, t in seen if t > claimed[0]), None)

    timeout = FAULT_TIMEOUT_S + (run.args.hang_timeout if fault.kind == "hang" else 0)
    first_step, first_t = rec._until(f"the first step after the {fault.kind}", restarted,
                                     timeout, run)  # fmt: skip
    reached = max((s for s, t in steps.seen if t <= claimed[0]), default=0)
    restore = next(iter(_restores_since(run, t_fault)), None)
    resumed = restore["step"] if restore else first_step - 1
    return {
        "fault": fault.kind,
        "at_step": fault.at_step,
        "reached": reached,
        "resumed": resumed,
        "tier": restore.get("tier") if restore else "scratch",
        "lost_steps": reached - resumed,
        "recovery_s": round(first_t - t_fault, 2),
        "load_s": restore.get("seconds") if restore else None,
    }


def _status(run: TierRun) -> dict[str, Any]:
    proc = subprocess.run(
        [*rec.SHARDCTL, "status", run.name, "-o", "json"], cwd=run.work, env=run.env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    try:
        return dict(json.loads(proc.stdout))
    except ValueError:
        return {"status_error": (proc.stderr or proc.stdout)[-500:]}


def median_step_s(seen: list[tuple[int, float]]) -> float | None:
    """The median of the steps logged one after the other (a restart's gap left out)."""
    gaps = [t1 - t0 for (s0, t0), (s1, t1) in pairwise(seen)
            if s1 == s0 + 1 and t1 > t0]  # fmt: skip
    return round(statistics.median(gaps), 4) if gaps else None


def one_run(work: Path, args: argparse.Namespace, memory: bool) -> dict[str, Any]:
    """Submit, inject the schedule, wait for the end; the run's report."""
    run = tier_run(work, args, memory)
    steps = Steps(run)
    t_submit = time.time()
    try:
        run.submit()
        print(f"{run.name}: job {run.ref.get('job_id')}", file=sys.stderr, flush=True)
        faults = []
        for fault in schedule(args.steps, args.kill_every, args.hang):
            faults.append(inject(run, steps, fault))
            print(f"{run.name}: {json.dumps(faults[-1])}", file=sys.stderr, flush=True)

        def ended() -> bool:
            time.sleep(0.5)
            steps.pump()
            return (run.run_dir / "DONE").exists() and not run.running()

        rec._until("the job's end", ended, END_TIMEOUT_S, run)
        t_end = time.time()
        status = _status(run)
    finally:
        run.cleanup()
    return {
        "memory_tier": memory,
        "job": run.ref.get("job_id"),
        "faults": faults,
        "wall_s": round(t_end - t_submit, 1),
        "step_s": median_step_s(steps.seen),
        "last_step": max((s for s, _ in steps.seen), default=None),
        "state": status.get("state"),
        "goodput": status.get("goodput"),
    }


# ------------------------------------------------------------------ on paper


def tier_stall_pct(args: argparse.Namespace) -> tuple[float, str]:
    """The tier's stall per step at K, % of a step: the largest model's background
    copy in memory_tier.py's output, else `--tier-stall-pct`."""
    if args.tier_stall_json:
        results = json.JSONDecoder().raw_decode(Path(args.tier_stall_json).read_text())[0]
        largest = max(results, key=lambda r: r["params"])
        copy = largest["background"]
        pct = 100 * float(copy["per_step_s"]) / float(copy["step_plain_s"])
        return pct, f"memory_tier.py, {largest['params'] / 1e6:.0f} M parameters, background"
    return args.tier_stall_pct, "--tier-stall-pct (benchmarks/README.md, memory tier)"


def on_paper(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The guide's 1,000-node model with the tier, from the measured terms."""
    on = next(r for r in runs if r["memory_tier"])
    crashes = [f["recovery_s"] for f in on["faults"] if f["fault"] == "crash"]
    loads = [f["load_s"] for f in on["faults"] if f["load_s"] is not None]
    r_node = statistics.median(crashes) if crashes else float("nan")
    load = statistics.median(loads) if loads else 0.0
    stall_pct, stall_from = tier_stall_pct(args)
    m, c, t = PAPER["M"], PAPER["C"], PAPER["T"]
    lost = args.k / 2 * args.paper_step_s
    keep = 1 - c / t - stall_pct / 100

    def good(d: float, rdzv: float) -> float:
        return round(keep * (1 - (d + r_node + rdzv + load + lost) / m), 4)

    return {
        "terms": {
            "M_s": m,
            "C_s": c,
            "T_s": t,
            "S_pct": stall_pct,
            "S_from": stall_from,
            "L_s": lost,
            "step_s_assumed": args.paper_step_s,
            "K": args.k,
            "R_node_s": r_node,
            "load_s": load,
            "rendezvous_s": PAPER["rdzv"],
        },
        "crash": [good(0.2, r) for r in PAPER["rdzv"]],
        "hang": [good(PAPER["hang_D"], r) for r in PAPER["rdzv"]],
        "without_tier_same_T": [
            round((1 - c / t) * (1 - (0.2 + r_node + r + t / 2) / m), 4) for r in PAPER["rdzv"]
        ],
    }


# ------------------------------------------------------------------ report


def _f(value: Any, fmt: str = "{:.1f}") -> str:
    return "—" if value is None else fmt.format(value)


def markdown(report: dict[str, Any]) -> str:
    off, on = (next(r for r in report["runs"] if r["memory_tier"] is m) for m in (False, True))
    lines = [
        "| fault | at step | tier off: resumed from | lost steps | fault → first step s "
        "| tier on: resumed from | lost steps | fault → first step s |",
        "|---|---:|---|---:|---:|---|---:|---:|",
    ]
    for a, b in zip(off["faults"], on["faults"], strict=True):
        lines.append(
            f"| {a['fault']} | {a['at_step']} | {a['tier']} {a['resumed']} | {a['lost_steps']} "
            f"| {a['recovery_s']:.1f} | {b['tier']} {b['resumed']} | {b['lost_steps']} "
            f"| {b['recovery_s']:.1f} |"
        )
    lines += ["", "| run | wall s | median step s | goodput (status) | steps lost (status) "
              "| restarts |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for run in (off, on):
        g = run.get("goodput") or {}
        eff = g.get("effective")
        lines.append(
            f"| tier {'on, K = ' + str(report['args']['k']) if run['memory_tier'] else 'off'} "
            f"| {_f(run['wall_s'])} | {_f(run['step_s'], '{:.3f}')} "
            f"| {_f(None if eff is None else eff * 100, '{:.1f} %')} "
            f"| {_f(g.get('lost_steps'), '{}')} | {_f(g.get('restarts'), '{}')} |"
        )
    paper = report["paper"]
    terms = paper["terms"]
    lines += [
        "",
        f"On paper, 1,000 nodes, a failure an hour (M {terms['M_s']:.0f} s), durable C "
        f"{terms['C_s']:.0f} s every T {terms['T_s']:.0f} s, tier stall S "
        f"{terms['S_pct']:.2f} % ({terms['S_from']}), L = K/2 × {terms['step_s_assumed']} s "
        f"= {terms['L_s']:.0f} s, R = {terms['R_node_s']:.1f} s measured + rendezvous "
        f"{terms['rendezvous_s'][0]:.0f}–{terms['rendezvous_s'][1]:.0f} s + load "
        f"{terms['load_s']:.2f} s:",
        "",
        "| fault | goodput with the tier | without it (same T) |",
        "|---|---:|---:|",
        f"| crash | {_range(paper['crash'])} | {_range(paper['without_tier_same_T'])} |",
        f"| hang (D = {PAPER['hang_D']:.0f} s) | {_range(paper['hang'])} | — |",
    ]
    return "\n".join(lines)


def _range(values: list[float]) -> str:
    lo, hi = min(values) * 100, max(values) * 100
    return f"{lo:.1f}–{hi:.1f} %"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", choices=("slurm", "local"), default="slurm",
                   help="local: a try of the schedule on this machine")  # fmt: skip
    p.add_argument("--steps", type=int, default=160, help="train.steps")
    p.add_argument("--every", type=int, default=50, help="checkpoint.every_steps (durable)")
    p.add_argument("-k", type=int, default=10, help="checkpoint.memory_every_steps")
    p.add_argument("--kill-every", type=int, default=30, help="a fault every N steps")
    p.add_argument("--hang", type=int, default=3, help="which fault is a hang (from 1; 0: none)")
    p.add_argument("--hang-timeout", type=int, default=15, help="watchdog.hang_timeout_s")
    p.add_argument("--procs", type=int, default=2, help="ranks on the one node")
    p.add_argument("--tier-stall-json", default=None, help="memory_tier.py's JSON output")
    p.add_argument("--tier-stall-pct", type=float, default=0.2)
    p.add_argument("--paper-step-s", type=float, default=5.0, help="a step at 1,000 nodes")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--work", type=Path, default=None, help="default: a temporary folder")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--from-json", type=Path, default=None, help="run nothing: tables of a report")
    args = p.parse_args()
    if args.from_json:
        print(markdown(json.JSONDecoder().raw_decode(args.from_json.read_text())[0]))
        return
    if not 1 <= args.k < args.every or args.kill_every < 4 or args.procs < 2:
        p.error(f"-k {args.k}: 1 to --every - 1; --kill-every ≥ 4; --procs ≥ 2 (rank 1 is hit)")
    args.nodes = 1  # recovery.SlurmRun's logs: one node
    args.rounds, args.faults = 1, []  # recovery.Run.spec's (restart: set in TierRun.spec)
    work = args.work or Path(tempfile.mkdtemp(prefix="shardctl-memory-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"host_before": rec.host(), "args": {
        k: getattr(args, k) for k in ("cluster", "steps", "every", "k", "kill_every", "hang",
                                      "hang_timeout", "procs", "paper_step_s")}}  # fmt: skip
    try:
        report["runs"] = [one_run(work, args, memory) for memory in (False, True)]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report["host_after"] = rec.host()
    report["paper"] = on_paper(report["runs"], args)
    print(json.dumps(report, indent=2))
    if args.markdown:
        print(markdown(report))


if __name__ == "__main__":
    main()
