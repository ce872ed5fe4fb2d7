"""`shardctl doctor SPEC --cluster C`: the checks that catch a broken multi-node job
before anything is queued, one line each, with the fix.

This module holds the checks every cluster shares and the order they run in; each
cluster's own come from its `Cluster.preflight` (clusters/<name>/preflight.py), its
preemption budget from `Cluster.preemption_budget`, its network from
`Cluster.network_check`. No check here knows a cluster by name.

- node rank: each node reads it from its own environment (the rendered script);
- master address: one the other nodes reach (Slurm: every node resolves the first
  host, in a short srun; local: 127.0.0.1 is one machine only);
- master port: free (here; Slurm: on the first node);
- checkpoint dir: one shared file system (Slurm: every node writes a file and must
  see all; k8s: the PVC exists, ReadWriteMany for several pods);
- preemption budget: `slurm.signal_delay_s` or `k8s.termination_grace_s` against the
  p95 of the save times the run's earlier checkpoints record (`save_s`);
- network interface: NCCL_/GLOO_SOCKET_IFNAME on multi-node specs;
- inputs (local, Slurm): the files the ranks read, the trackers' packages and the
  factories' imports, as `submit` refuses them (`inputs.py`);
- k8s: the operator's CRD, a TrainJob's runtime, the service account (through the API).

A check that cannot run (no srun, no allocation in time, an unreachable API server)
says so and is skipped; it never passes silently.
"""

from __future__ import annotations

import math
import socket
import uuid
from dataclasses import asdict, dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Literal

from .checkpoint_list import save_times
from .spec import JobSpec
from .storage import is_object_url

Status = Literal["ok", "warn", "fail", "skip"]
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


@dataclass(frozen=True)
class Preflight:
    """What a cluster's own pre-flight found: its checks, and the network interfaces
    every node has (None: unknown, the cluster did not look)."""

    checks: list[Check] = dataclass_field(default_factory=list)
    interfaces: list[str] | None = None


def run_doctor(spec: JobSpec, cluster: str, checkpoints: str | None = None) -> list[Check]:
    from .clusters import get_cluster

    backend = get_cluster(cluster)
    own = backend.preflight(spec)
    checks = [*submit_checks(backend.submit_problems(spec), cluster)]
    checks += [node_rank_check(spec, cluster), *own.checks]
    checks.extend(input_checks(spec, cluster))
    checks.append(budget_check(spec, cluster, checkpoints))
    checks.append(interface_check(spec, cluster, own.interfaces))
    return checks


# ------------------------------------------------------------------ every cluster


def submit_checks(problems: list[str], cluster: str) -> list[Check]:
    """What `submit --cluster CLUSTER` refuses in the spec (`Cluster.submit_problems`,
    the very checks), one failing check each."""
    if not problems:
        return [Check("spec for " + cluster, "ok", f"submit --cluster {cluster} accepts it")]
    return [Check("spec for " + cluster, "fail", p, "correct the spec") for p in problems]


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


def input_checks(spec: JobSpec, cluster: str) -> list[Check]:
    """What `submit` refuses before ranks start (`inputs.py`): the files the ranks read
    and the trackers' packages, then the factories' imports; none where the ranks read
    the spec's paths elsewhere (inside a pod)."""
    from .inputs import import_problems, input_problems
    from .spec import reads_local_paths

    if not reads_local_paths(cluster):
        return []
    checks = []
    for name, problems, ok in (
        ("input files", input_problems(spec, cluster), "what the ranks read is here"),
        ("factory imports", import_problems(spec), "every factory imports (or none is given)"),
    ):
        if not problems:
            checks.append(Check(name, "ok", ok))
        for problem in problems:
            checks.append(Check(name, "fail", problem, "correct the field, or the file"))
    return checks


def budget_check(spec: JobSpec, cluster: str, checkpoints: str | None) -> Check:
    from .clusters import get_cluster

    name = "preemption budget"
    backend = get_cluster(cluster)
    found = backend.preemption_budget(spec)
    if found is None:
        return Check(name, "skip", backend.no_preemption_budget)
    budget, field = found
    where = checkpoints or spec.checkpoint_dir
    folder = where if is_object_url(where) else Path(where)  # a URL stays one
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


def measured_saves(folder: str | Path) -> list[float]:
    """`save_s` of every complete checkpoint's manifest in the folder (the one lister's
    `save_times`: complete means committed, as resume counts it)."""
    return save_times(folder)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[k]


def interface_check(spec: JobSpec, cluster: str, node_interfaces: list[str] | None = None) -> Check:
    name = "network interface"
    var = "NCCL_SOCKET_IFNAME" if spec.resources.device == "cuda" else "GLOO_SOCKET_IFNAME"
    from .clusters import get_cluster

    backend = get_cluster(cluster)
    if spec.resources.nodes == 1 or backend.one_machine:
        return Check(name, "ok", "one machine: collectives stay inside it")
    chosen = spec.env.get(var)
    own = backend.network_check(spec, var)
    if own is not None:
        return own
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


def bucket_check(location: str) -> Check:
    """An `s3://` checkpoint dir takes an object, with this machine's AWS settings
    (written and deleted again): the endpoint answers, the credentials are accepted,
    the bucket exists and may be written."""
    from .errors import ShardctlError

    try:
        from .s3.local import probe_write

        probe_write(location)
    except ShardctlError as exc:
        fix = "check the AWS variables or profile of the machine the ranks run on"
        return Check("checkpoint dir", "fail", str(exc), fix)
    return Check("checkpoint dir", "ok", f"{location} can be written (this machine's AWS settings)")
