"""`shardctl doctor SPEC --cluster C`: the checks that catch a broken multi-node job
before anything is queued, one line each, with the fix.

- node rank: each node reads it from its own environment (the rendered script);
- master address: one the other nodes reach (Slurm: every node resolves the first
  host, in a short srun; local: 127.0.0.1 is one machine only);
- master port: free (here; Slurm: on the first node);
- checkpoint dir: one shared file system (Slurm: every node writes a file and must
  see all; k8s: the PVC exists, ReadWriteMany for several pods);
- preemption budget: `slurm.signal_delay_s` or `k8s.termination_grace_s` against the
  p95 of the save times the run's earlier checkpoints record (`save_s`);
- network interface: NCCL_/GLOO_SOCKET_IFNAME on multi-node specs;
- k8s: the operator's CRD, a TrainJob's runtime, the service account (through the API).

A check that cannot run (no srun, no allocation in time, an unreachable API server)
says so and is skipped; it never passes silently.
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from .spec import JobSpec

Status = Literal["ok", "warn", "fail", "skip"]
PROBE_WAIT_S = 30  # srun --immediate: how long to wait for an allocation
PROBE_TIMEOUT_S = 120
# A save must fit the budget with room for the step in flight when the signal comes.
BUDGET_MARGIN = 0.8


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}[self.status]
        fix = f"\n      fix: {self.fix}" if self.fix and self.status in ("warn", "fail") else ""
        return f"{mark}  {self.name}: {self.detail}{fix}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_doctor(spec: JobSpec, cluster: str, checkpoints: str | None = None) -> list[Check]:
    checks = [node_rank_check(spec, cluster)]
    interfaces: list[str] | None = None
    if cluster == "local":
        checks += local_checks(spec)
    elif cluster == "slurm":
        found, rows = slurm_checks(spec)
        checks += found
        if rows:  # what every node has: the names they share
            sets = [set(filter(None, r["ifaces"].split(","))) for r in rows]
            interfaces = sorted(set.intersection(*sets))
    else:
        checks += k8s_checks(spec)
    checks.append(budget_check(spec, cluster, checkpoints))
    checks.append(interface_check(spec, cluster, interfaces))
    return checks


# ------------------------------------------------------------------ every cluster


def node_rank_check(spec: JobSpec, cluster: str) -> Check:
    from .clusters import get_cluster

    lines = [line.text for line in get_cluster(cluster).runtime_env(spec)]
    rank = next((t for t in lines if "SHARDCTL_NODE_RANK=" in t), "")
    value = rank.split("=", 1)[1] if "=" in rank else ""
    if "${" in value:
        source = value.strip('"').removeprefix("${").split(":")[0].split("}")[0]
        return Check("node rank", "ok", f"each node reads it from its own ${source}")
    return Check(
        "node rank",
        "fail" if spec.resources.nodes > 1 else "ok",
        f"the launch script sets it to {value or 'nothing'} on every node",
        "render with a cluster that gives each node its rank (slurm, k8s)",
    )


def budget_check(spec: JobSpec, cluster: str, checkpoints: str | None) -> Check:
    name = "preemption budget"
    if cluster == "slurm":
        budget, field = spec.slurm.signal_delay_s, "slurm.signal_delay_s"
    elif cluster == "k8s":
        budget, field = spec.k8s.termination_grace_s, "k8s.termination_grace_s"
    else:
        return Check(name, "skip", "a local run is stopped by `shardctl cancel`, no deadline")
    folder = Path(checkpoints or spec.checkpoint_dir)
    saves = measured_saves(folder)
    if not saves:
        return Check(
            name,
            "skip",
            f"{field} is {budget} s; no earlier checkpoint in {folder} records its save time "
            "(run the job once, or point --checkpoints at a run of the same model)",
        )
    p95 = percentile(saves, 95)
    detail = (
        f"{field} is {budget} s; saves in {folder} took p95 {p95:.1f} s "
        f"(max {max(saves):.1f} s, {len(saves)} measured)"
    )
    raise_to = math.ceil(p95 / BUDGET_MARGIN)
    if p95 > budget:
        return Check(
            name, "fail", detail + ": a save will not fit", f"raise {field} to at least {raise_to}"
        )
    if p95 > BUDGET_MARGIN * budget:
        return Check(
            name,
            "warn",
            detail + ": little room for the step in flight",
            f"raise {field} to {raise_to} or more",
        )
    return Check(name, "ok", detail)


def measured_saves(folder: Path) -> list[float]:
    """`save_s` of every complete checkpoint's manifest in the folder."""
    out = []
    if not folder.is_dir():
        return out
    for step in sorted(folder.glob("step-*")):
        try:
            data = json.loads((step / "manifest.json").read_text())
            value = float(data["save_s"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if math.isfinite(value) and value >= 0:
            out.append(value)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[k]


def interface_check(spec: JobSpec, cluster: str, node_interfaces: list[str] | None = None) -> Check:
    name = "network interface"
    var = "NCCL_SOCKET_IFNAME" if spec.resources.device == "cuda" else "GLOO_SOCKET_IFNAME"
    if spec.resources.nodes == 1 or cluster == "local":
        return Check(name, "ok", "one machine: collectives stay inside it")
    chosen = spec.env.get(var)
    if cluster == "k8s":
        detail = (
            f"{var}={chosen}"
            if chosen
            else (
                f"{var} is not set: pods have one interface (eth0) unless the network plugin "
                f"adds more (Multus, RDMA); then set env.{var}"
            )
        )
        return Check(name, "ok", detail)
    if node_interfaces is None:
        return Check(name, "skip", "the nodes' interfaces are unknown (the probe did not run)")
    here = node_interfaces
    if chosen is None:
        others = [i for i in here if i != "lo"]
        status: Status = "warn" if len(others) != 1 else "ok"
        return Check(
            name,
            status,
            f"{var} is not set; the nodes pick an interface themselves "
            f"(interfaces on every node: {', '.join(here) or 'none'})",
            f"set env.{var} to the interface the nodes reach each other on, e.g. "
            f"{others[0] if others else 'eth0'}",
        )
    wanted = [w.lstrip("^=") for w in str(chosen).split(",")]
    if str(chosen).startswith("^"):  # an exclusion list: any other interface will do
        return Check(name, "ok", f"{var}={chosen}")
    missing = [w for w in wanted if w and not any(i.startswith(w) for i in here)]
    if missing:
        return Check(
            name,
            "fail",
            f"{var}={chosen}, but {', '.join(missing)} is not an interface here "
            f"({', '.join(here)})",
            f"set env.{var} to one of {', '.join(here)}",
        )
    return Check(name, "ok", f"{var}={chosen}")


# -------------------------------------------------------------------------- local


def local_checks(spec: JobSpec) -> list[Check]:
    checks = []
    if spec.resources.nodes > 1:
        checks.append(
            Check(
                "master address",
                "warn",
                f"127.0.0.1: all {spec.resources.nodes} nodes must start on this machine "
                "(SHARDCTL_NODE_RANK preset per node); no other machine can reach it",
                "use --cluster slurm or k8s for nodes on different machines",
            )
        )
    else:
        checks.append(Check("master address", "ok", "127.0.0.1 (one node)"))
    checks.append(port_check(spec.local.master_port))
    checks.append(writable_check(Path(spec.checkpoint_dir)))
    return checks


def port_check(port: int, host: str = "127.0.0.1") -> Check:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return Check(
                "master port",
                "fail",
                f"{port} is taken on {host} ({exc.strerror})",
                "stop what holds it (a finished run's ranks?) or change the spec's master_port",
            )
    return Check("master port", "ok", f"{port} is free on {host}")


def writable_check(folder: Path) -> Check:
    """The folder, or the nearest ancestor that exists, takes a file (nothing is left)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return Check(
            "checkpoint dir",
            "fail",
            f"{existing} is a file, so {folder} cannot be a folder",
            "set checkpoint.dir to a folder path",
        )
    probe = existing / f".shardctl-doctor-{uuid.uuid4().hex}"
    try:
        probe.write_text("x")
        probe.unlink()
    except OSError as exc:
        return Check(
            "checkpoint dir",
            "fail",
            f"cannot write in {existing}: {exc.strerror or exc}",
            "set checkpoint.dir to a writable folder",
        )
    return Check("checkpoint dir", "ok", f"{folder} can be written (one machine)")


# -------------------------------------------------------------------------- slurm

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
    token_dir = Path(spec.checkpoint_dir) / f".shardctl-doctor-{uuid.uuid4().hex}"
    argv = [
        srun,
        f"--nodes={spec.resources.nodes}",
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
        str(spec.resources.nodes),
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
    if len(rows) < spec.resources.nodes:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        skipped = [
            Check(
                n,
                "skip",
                f"no allocation of {spec.resources.nodes} node(s) for the probe "
                f"within {PROBE_WAIT_S} s ({shlex.join(argv[:6])}: {why})",
            )
            for n in names
        ]
        return skipped, []
    return [_master_from(rows), _port_from(rows, s.master_port), _shared_from(rows, spec)], rows


def _master_from(rows: list[dict[str, str]]) -> Check:
    master = rows[0]["master"]
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


def _shared_from(rows: list[dict[str, str]], spec: JobSpec) -> Check:
    nodes = spec.resources.nodes
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


# ---------------------------------------------------------------------------- k8s


def k8s_checks(spec: JobSpec, api_client: Any = None) -> list[Check]:
    from .clusters.k8s import K8sCluster
    from .clusters.k8s.apis import job_kind
    from .errors import ClusterError, JobNotFoundError

    backend = K8sCluster(api_client=api_client)
    k = spec.k8s
    checks = [
        Check(
            "master address",
            "ok",
            "the operator's headless service name, resolved inside the cluster",
        )
    ]
    try:
        core, custom = backend._core(), backend._custom()
    except ClusterError as exc:
        return [*checks, Check("cluster", "skip", str(exc))]

    def probe(
        name: str, call: Any, ok: str | Callable[[Any], str], missing: str, fix: str
    ) -> Check:
        try:
            found = call()
        except JobNotFoundError:
            return Check(name, "fail", missing, fix)
        except ClusterError as exc:
            return Check(name, "skip", str(exc))
        return Check(name, "ok", ok if not callable(ok) else ok(found))

    ns = k.namespace
    kind = job_kind(k.api)
    group, version, plural, hint = kind.group, kind.version, kind.plural, kind.install_hint
    checks.append(
        probe(
            "operator",
            lambda: backend._call(
                "list",
                plural,
                ns,
                lambda: custom.list_namespaced_custom_object(
                    group, version, ns, plural, limit=1, _request_timeout=30
                ),
            ),
            f"the cluster serves {plural}.{group}/{version}",
            f"the cluster does not serve {plural}.{group}/{version}",
            hint,
        )
    )
    need = kind.prerequisite(spec)
    if need is not None:
        try:
            backend._check_prerequisite(custom, need, ns)
            checks.append(Check(need.what, "ok", f"{need.kind} {need.name} exists"))
        except ClusterError as exc:
            checks.append(
                Check(need.what, "fail", str(exc).split(";")[0], str(exc).split("; ", 1)[-1])
            )
    checks.append(
        probe(
            "service account",
            lambda: backend._call(
                "get",
                "serviceaccounts",
                ns,
                lambda: core.read_namespaced_service_account(
                    k.service_account, ns, _request_timeout=30
                ),
            ),
            f"{ns}/{k.service_account} exists",
            f"no service account {k.service_account!r} in namespace {ns!r}",
            "kubectl apply -f the serviceaccount.yaml of the manifests `shardctl --version` lists",
        )
    )
    if k.pvc is None:
        checks.append(
            Check(
                "checkpoint dir",
                "warn" if spec.resources.nodes == 1 else "fail",
                "no k8s.pvc: checkpoints live in the pod and die with it",
                "set k8s.pvc to a ReadWriteMany PersistentVolumeClaim",
            )
        )
        return checks

    def pvc_detail(found: Any) -> str:
        modes = list(getattr(getattr(found, "spec", None), "access_modes", None) or [])
        return f"PVC {k.pvc} exists ({', '.join(modes) or 'no access modes'})"

    pvc = probe(
        "checkpoint dir",
        lambda: backend._call(
            "get",
            "persistentvolumeclaims",
            ns,
            lambda: core.read_namespaced_persistent_volume_claim(k.pvc, ns, _request_timeout=30),
        ),
        pvc_detail,
        f"no PersistentVolumeClaim {k.pvc!r} in namespace {ns!r}",
        "create it (the pvc.yaml of the manifests `shardctl --version` lists is an example)",
    )
    if pvc.status == "ok" and spec.resources.nodes > 1 and "ReadWriteMany" not in pvc.detail:
        pvc = Check(
            "checkpoint dir",
            "fail",
            pvc.detail + f": {spec.resources.nodes} pods on different nodes cannot all mount it",
            "use a ReadWriteMany claim (NFS, CephFS, a cloud file store)",
        )
    checks.append(pvc)
    return checks
