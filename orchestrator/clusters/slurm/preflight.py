"""`shardctl doctor --cluster slurm`: a short srun on every node checks the master
address, the master port and that the checkpoint dir is one file system; the nodes'
network interfaces go to the interface check."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

from ...doctor import Check, Preflight
from ...spec import JobSpec

PROBE_WAIT_S = 30  # srun --immediate: how long to wait for an allocation
PROBE_TIMEOUT_S = 120


# One task per node: where it is, what the first host resolves to there, whether the
# master port is free (node 0), its interfaces, and how many nodes' tokens it sees in
# the checkpoint dir (every node writes one, then waits for the others').
_PROBE = r"""
set -u
dir="$1"; nodes="$2"; port="$3"
master="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
addr="$(getent ahostsv4 "$master" | awk 'NR==1 {print $1}')"
port_free=skip
if [ "$SLURM_NODEID" = 0 ]; then
  if python3 -c "import socket,sys; socket.socket().bind(('', int(sys.argv[1])))" \
      "$port" 2>/dev/null; then port_free=yes; else port_free=no; fi
fi
mkdir -p "$dir" 2>/dev/null && echo "$SLURMD_NODENAME" > "$dir/node-$SLURM_NODEID" 2>/dev/null
seen=0
for _ in $(seq 1 100); do
  seen="$(ls "$dir" 2>/dev/null | grep -c '^node-' || true)"
  [ "$seen" -ge "$nodes" ] && break
  sleep 0.2
done
printf 'SHARDCTL-PROBE node=%s id=%s master=%s addr=%s port_free=%s seen=%s ifaces=%s\n' \
  "$SLURMD_NODENAME" "$SLURM_NODEID" "$master" "${addr:-none}" "$port_free" "$seen" \
  "$(ls /sys/class/net 2>/dev/null | tr '\n' ',')"
"""


def slurm_checks(spec: JobSpec) -> tuple[list[Check], list[dict[str, str]]]:
    """The probe's checks and what each node reported (empty when it did not run)."""
    srun = shutil.which("srun")
    names = ("master address", "master port", "checkpoint dir")
    if srun is None:
        return [Check(n, "skip", "srun is not on PATH: no Slurm client here") for n in names], []
    s = spec.slurm
    # The job's every node, its spares too: any of them may train.
    nodes = job_nodes(spec)
    token_dir = Path(spec.checkpoint_dir) / f".shardctl-doctor-{uuid.uuid4().hex}"
    argv = [
        srun,
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--immediate={PROBE_WAIT_S}",
        "--time=2",
        "--job-name=shardctl-doctor",
        "--kill-on-bad-exit=0",
    ]
    for flag, value in (
        ("partition", s.partition),
        ("account", s.account),
        ("qos", s.qos),
        ("constraint", s.constraint),
    ):
        if value:
            argv.append(f"--{flag}={value}")
    argv += [
        "bash",
        "-c",
        _PROBE,
        "probe",
        str(token_dir),
        str(nodes),
        str(s.master_port),
    ]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        late = f"the probe did not finish in {PROBE_TIMEOUT_S} s"
        return [Check(n, "skip", late) for n in names], []
    finally:
        shutil.rmtree(token_dir, ignore_errors=True)
    rows = [
        dict(kv.split("=", 1) for kv in line.split()[1:])
        for line in done.stdout.splitlines()
        if line.startswith("SHARDCTL-PROBE ")
    ]
    if len(rows) < nodes:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        skipped = [
            Check(
                n,
                "skip",
                f"no allocation of {nodes} node(s) for the probe "
                f"within {PROBE_WAIT_S} s ({shlex.join(argv[:6])}: {why})",
            )
            for n in names
        ]
        return skipped, []
    return [_master_from(rows), _port_from(rows, s.master_port), _shared_from(rows, spec)], rows


def _master_from(rows: list[dict[str, str]]) -> Check:
    master = rows[0]["master"]
    if len(rows) == 1 and rows[0]["addr"] != "none":
        # One node: its ranks meet on the node itself, so loopback is fine; a name that
        # resolves to nothing still fails below, as the ranks could not connect to it.
        return Check(
            "master address",
            "ok",
            f"{master} resolves to {rows[0]['addr']}: one node, no other node needs to "
            "reach the rendezvous",
        )
    loopback = [r["node"] for r in rows if r["addr"].startswith("127.") or r["addr"] == "none"]
    if loopback:
        addrs = ", ".join(f"{r['node']}: {r['addr']}" for r in rows)
        return Check(
            "master address",
            "fail",
            f"{master} (the first host) resolves to a loopback address or nothing on "
            f"{', '.join(loopback)} ({addrs}): the other nodes cannot reach the rendezvous",
            f"make {master} resolve to its network address on every node (DNS or "
            "/etc/hosts), or check slurm.conf's NodeAddr",
        )
    return Check("master address", "ok", f"{master} resolves to {rows[0]['addr']} on every node")


def _port_from(rows: list[dict[str, str]], port: int) -> Check:
    first = next((r for r in rows if r["id"] == "0"), rows[0])
    if first["port_free"] == "no":
        return Check(
            "master port", "fail", f"{port} is taken on {first['node']}", "change slurm.master_port"
        )
    return Check("master port", "ok", f"{port} is free on {first['node']}")


def job_nodes(spec: JobSpec) -> int:
    """The nodes the job asks Slurm for: `resources.nodes` and `slurm.spare_nodes`."""
    return spec.resources.nodes + spec.slurm.spare_nodes


def _shared_from(rows: list[dict[str, str]], spec: JobSpec) -> Check:
    nodes = job_nodes(spec)
    blind = [f"{r['node']} saw {r['seen']}" for r in rows if int(r["seen"] or 0) < nodes]
    if blind:
        return Check(
            "checkpoint dir",
            "fail",
            f"{spec.checkpoint_dir} is not one file system for all nodes ({', '.join(blind)} "
            f"of {nodes} files the nodes wrote)",
            "set checkpoint.dir (or run_dir) to a shared file system every node mounts",
        )
    return Check(
        "checkpoint dir",
        "ok",
        f"{spec.checkpoint_dir}: every node wrote a file and saw all {nodes}",
    )


def slurm_preflight(spec: JobSpec) -> Preflight:
    found, rows = slurm_checks(spec)
    if not rows:
        return Preflight(found)
    # What every node has: the names they share.
    sets = [set(filter(None, r["ifaces"].split(","))) for r in rows]
    return Preflight(found, sorted(set.intersection(*sets)))
