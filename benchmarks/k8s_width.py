"""Kubernetes at width: `status`, `logs -f` to the job's end and `cancel` at 8, 32 and
128 pods, against kmock (the tests' Kubernetes API emulator).

    python benchmarks/k8s_width.py                       # PyTorchJob and TrainJob, 8 32 128
    python benchmarks/k8s_width.py --pods 8 128 --apis pytorchjob --markdown

For each job kind and pod count, one job in a fresh emulator (tests/helpers/kmock_server.py,
in this process): `shardctl submit`, then the test's operator creates the pods and
marks the job Running, and each command runs as its own process, measured from
outside (tests/helpers/k8s_width.py):

- `status`: wall time of the process (mostly the interpreter and the kubernetes
  client's import), its API requests;
- `logs -f`: every pod writes LINES lines over SPREAD_S seconds (each line stamped by
  the "kubelet"); the job is marked Succeeded once the last line is written. Wall time
  from start to exit and from the job's end to exit, CPU time of the process, peak
  threads and TCP connections to the API server (sampled every 20 ms), log requests
  (one per pod plus one per resumed stream) and the status + list requests (one each
  per 2 s tick); checks that every pod's lines were shown once, in order;
- `cancel`: wall time and API requests.

Prints one JSON line per job and, with --markdown, the table for benchmarks/README.md.
Every process is started with a timeout and ended by its id (its process group).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.k8s_width import LogPlayer, Measured, Width, serve, wait_until  # noqa: E402

LINES = 24
SPREAD_S = 6.0


def by_pod(stdout: str) -> dict[str, list[str]]:
    shown: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        found = re.match(r"\[pod/([^/\]]+)/[^\]]+\] (.*)$", line)
        if found:
            shown.setdefault(found.group(1), []).append(found.group(2))
    return shown


def one(api: str, pods: int) -> dict[str, Any]:
    server = serve()
    try:
        with tempfile.TemporaryDirectory(prefix="k8s-width-") as home:
            width = Width(server, Path(home), api, pods, name="wide")
            width.submit()
            width.add_pods()
            width.set_state("Running")
            status = width.run("status", "wide", timeout=120)
            player = LogPlayer(width.pods, lines=LINES, period_s=SPREAD_S / LINES)
            player.install(server)
            with width.started("logs", "wide", "-f", timeout=300) as follow:
                wait_until(lambda: time.time() > player.ends_at, 120, "the last lines")
                width.set_state("Succeeded")
                ended = time.monotonic()
                logs = follow.result()
            after_end = time.monotonic() - ended
            complete = by_pod(logs.stdout) == player.expected()
            cancel = width.run("cancel", "wide", timeout=120)
    finally:
        server.stop()
    for run in (status, logs, cancel):
        if run.code != 0:
            raise SystemExit(f"{api} × {pods}: {' '.join(run.args)} failed:\n{run.stderr}")
    return {
        "api": api,
        "pods": pods,
        "status": summary(status),
        "logs_f": {**summary(logs), "after_end_s": round(after_end, 2), "complete": complete},
        "cancel": summary(cancel),
    }


def summary(run: Measured) -> dict[str, Any]:
    return {
        "wall_s": round(run.wall_s, 2),
        "cpu_s": round(run.cpu_s, 2),
        "threads": run.peaks.threads,
        "connections": run.peaks.connections,
        "requests": dict(sorted(run.requests.items())),
    }


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    pairs = (line.partition(":") for line in out.splitlines())
    fields = {k.strip(): v.strip() for k, _, v in pairs}
    model, family, cpus = (fields.get(k, "?") for k in ("Model name", "CPU family", "CPU(s)"))
    return f"{model} (family {family}), {cpus} CPUs"


def markdown(rows: list[dict[str, Any]]) -> str:
    def reqs(d: dict[str, int], *, log: bool = False) -> str:
        if log:
            lists = d.get("LIST pods", 0)
            return f"{d.get('log', 0)} log, {lists} list + {lists} get"
        return str(sum(d.values()))

    out = [
        "| job | pods | `status` s | req | `logs -f` s | after end s | CPU s | threads | "
        "conns | requests | all lines | `cancel` s | req |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in rows:
        s, f, c = r["status"], r["logs_f"], r["cancel"]
        out.append(
            f"| {r['api']} | {r['pods']} | {s['wall_s']:.2f} | {reqs(s['requests'])} | "
            f"{f['wall_s']:.2f} | {f['after_end_s']:.2f} | {f['cpu_s']:.2f} | {f['threads']} | "
            f"{f['connections']} | {reqs(f['requests'], log=True)} | "
            f"{'yes' if f['complete'] else 'NO'} | {c['wall_s']:.2f} | {reqs(c['requests'])} |"
        )
    return "\n".join(out)


def pod_count(text: str) -> int:
    """A job's pods: 1 (a master alone) or more."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pod count; accepted: 1, 2, ...")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=pod_count, nargs="+", default=[8, 32, 128])
    parser.add_argument("--apis", nargs="+", default=["pytorchjob", "trainjob"],
                        choices=["pytorchjob", "trainjob"])  # fmt: skip
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = []
    for api in args.apis:
        for pods in args.pods:
            row = one(api, pods)
            print(json.dumps(row, sort_keys=True), flush=True)
            rows.append(row)
    if args.markdown:
        print(f"\nCPU: {cpu_model()}\n")
        print(markdown(rows))


if __name__ == "__main__":
    main()
