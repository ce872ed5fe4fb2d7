"""Slurm's refusal of a submission, told in the spec's words.

`sbatch --test-only` answers with Slurm's own reason ("Node count specification
invalid", "Requested node configuration is not available", ...), which names no spec
field. `refused(spec, reason)` names the field that asked for it, its value and what
the partition offers (its nodes, their CPUs, memory and features, from `sinfo`).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...spec import JobSpec

# The sbatch options (slurm.sbatch_options) that name nodes.
NODE_OPTIONS = ("exclude", "nodelist")

# One line of `sinfo -N`: node, partition (the default one marked `*`), memory (MB),
# CPUs, features.
SINFO_NODES = ["sinfo", "-h", "-N", "-o", "%N|%P|%m|%c|%f"]


@dataclass(frozen=True)
class Node:
    """One node of a partition as `sinfo` shows it."""

    name: str
    memory_mb: int | None
    cpus: int | None
    features: frozenset[str]


@dataclass(frozen=True)
class Partition:
    """The partition a job goes to and its nodes (none when sinfo could not tell)."""

    name: str
    nodes: tuple[Node, ...]

    def offers(self) -> str:
        """What the partition offers, in one clause."""
        if not self.nodes:
            return f"partition {self.name!r}: sinfo shows no node"
        names = ", ".join(n.name for n in self.nodes)
        cpus = _span(n.cpus for n in self.nodes)
        memory = _span(n.memory_mb for n in self.nodes)
        features = sorted(set().union(*(n.features for n in self.nodes)))
        return (
            f"partition {self.name!r} has {len(self.nodes)} node(s) ({names}), "
            f"{cpus} CPUs and {memory}M memory each, features: {', '.join(features) or 'none'}"
        )


Run = Callable[[list[str]], str]


def refused(spec: JobSpec, reason: str, run: Run) -> str:
    """The one line that says which spec field Slurm refused, for Slurm's `reason`.
    `run` runs a Slurm command and returns its stdout ("" when it failed)."""
    s, low = spec.slurm, reason.lower()
    if "partition" in low:
        known = run(["sinfo", "-h", "-o", "%R"]).split()
        return (
            f"slurm.partition {s.partition!r} was refused by Slurm ({reason}); "
            f"partitions here: {', '.join(sorted(set(known))) or 'none'}"
        )
    if "time limit" in low:
        limits = run(["sinfo", "-h", "-o", "%R=%l"]).split()
        return (
            f"slurm.time {s.time!r} was refused by Slurm ({reason}); partition time limits: "
            f"{', '.join(sorted(set(limits))) or 'unknown'}"
        )
    part = partition_of(s.partition, run)
    field = _field_refused(spec, low, part, run)
    if field is None:
        return f"Slurm refused job {spec.name!r} ({reason}); {part.offers()}"
    # "<field> <value>", then why (after " — ") where the reason alone does not say.
    what, _, why = field.partition(" — ")
    because = f": {why}" if why else ""
    return f"{what} was refused by Slurm ({reason}){because}; {part.offers()}"


def _field_refused(spec: JobSpec, low: str, part: Partition, run: Run) -> str | None:
    """`<field> <value>` for Slurm's reason (lower case), or None when no field fits."""
    s, r = spec.slurm, spec.resources
    if "node count" in low:
        return _node_count(spec)
    if "feature" in low and s.constraint is not None:
        return f"slurm.constraint {s.constraint!r}"
    if "gres" in low or "generic resource" in low:
        if s.gres is not None:
            return f"slurm.gres {s.gres!r}"
        if r.device == "cuda":
            return f"resources.device 'cuda' ({r.procs_per_node} GPUs per node)"
    if "processors" in low:
        return _cpus(spec)
    if "invalid node name" in low:
        return _node_option(spec)
    if "node configuration is not available" in low:
        return _unavailable(spec, part, run)
    return None


def _node_count(spec: JobSpec) -> str:
    """The fields that make the job's node count (the spares are asked for too)."""
    r, spares = spec.resources, spec.slurm.spare_nodes
    if not spares:
        return f"resources.nodes {r.nodes}"
    return f"resources.nodes {r.nodes} + slurm.spare_nodes {spares} ({r.nodes + spares} nodes)"


def _asks(spec: JobSpec) -> str:
    r, spares = spec.resources, spec.slurm.spare_nodes
    if not spares:
        return f"resources.nodes asks for {r.nodes}"
    return f"resources.nodes + slurm.spare_nodes ask for {r.nodes + spares}"


def _cpus(spec: JobSpec) -> str:
    r = spec.resources
    return (
        f"resources.procs_per_node × cpus_per_proc ({r.procs_per_node} × {r.cpus_per_proc} "
        f"= {r.procs_per_node * r.cpus_per_proc} CPUs per node)"
    )


def _node_option(spec: JobSpec) -> str | None:
    options = spec.slurm.sbatch_options
    named = [f"slurm.sbatch_options.{k} {options[k]!r}" for k in NODE_OPTIONS if k in options]
    return " or ".join(named) or None


def _unavailable(spec: JobSpec, part: Partition, run: Run) -> str | None:
    """The field no node of the partition can satisfy: memory, CPUs, or an exclude
    that leaves fewer nodes than `resources.nodes`."""
    r, s = spec.resources, spec.slurm
    if not part.nodes:
        return None
    most_mb = max((n.memory_mb or 0) for n in part.nodes)
    if r.memory is not None and r.memory.bytes > most_mb * 2**20:
        return f"resources.memory {str(r.memory)!r} — more than any node has"
    most_cpus = max((n.cpus or 0) for n in part.nodes)
    if r.procs_per_node * r.cpus_per_proc > most_cpus:
        return _cpus(spec) + " — more than any node has"
    if s.constraint is not None:
        fit = [n for n in part.nodes if s.constraint in n.features]
        if len(fit) < r.nodes + s.spare_nodes:
            return f"slurm.constraint {s.constraint!r} — {len(fit)} node(s) have it"
    excluded = s.sbatch_options.get("exclude")
    if isinstance(excluded, str):
        gone = set(run(["scontrol", "show", "hostnames", excluded]).split())
        left = [n.name for n in part.nodes if n.name not in gone]
        if len(left) < r.nodes + s.spare_nodes:
            return (
                f"slurm.sbatch_options.exclude {excluded!r} — it leaves {len(left)} node(s) "
                f"({', '.join(left) or 'none'}) and {_asks(spec)}"
            )
    return None


def partition_of(name: str | None, run: Run) -> Partition:
    """The partition `name` (None: the cluster's default one) and its nodes."""
    nodes: list[Node] = []
    default = None
    for line in run(SINFO_NODES).splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        node, partition, memory, cpus, features = fields
        if partition.endswith("*"):
            partition = partition[:-1]
            default = default or partition
        if partition == (name or default):
            nodes.append(Node(node, _int(memory), _int(cpus), _features(features)))
    return Partition(name or default or "(default)", tuple(nodes))


def _int(text: str) -> int | None:
    digits = text.strip().rstrip("+")
    return int(digits) if digits.isdigit() else None


def _features(text: str) -> frozenset[str]:
    # sinfo prints `(null)` for none; features are comma-separated.
    words = text.strip()
    if words in ("", "(null)"):
        return frozenset()
    return frozenset(w for w in words.split(",") if w)


def _span(values: Iterable[int | None]) -> str:
    known = sorted({v for v in values if v is not None})
    if not known:
        return "?"
    return str(known[0]) if len(known) == 1 else f"{known[0]}-{known[-1]}"


def run_quietly(argv: list[str]) -> str:
    """A Slurm query's stdout; "" when it could not run (the refusal is still told)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""
