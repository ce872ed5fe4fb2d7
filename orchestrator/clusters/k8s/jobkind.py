"""What every Kubernetes job API shardctl speaks provides: the `JobKind` protocol.

One object per API implements it (`pytorchjob.PYTORCHJOB`, `trainjob.TRAINJOB`) and
owns everything that differs between the APIs: the chart values only it reads, its
job object (and what it needs beside it), what its stock setup cannot carry, the
variables its operator gives the pods, its state table, how its pods are found and
ordered, and what must exist in the cluster before a job is created.
`apis.job_kind` is the one place that picks a kind from `k8s.api`; nothing else
asks which API a spec or a job uses.

This module imports no kind; the kinds import it for the small types below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ...spec import JobSpec
from ..base import JobStatus


@dataclass(frozen=True)
class AdminRuntime:
    """An object a cluster admin installs once for the job's kind (written as a file
    beside the job, never sent by `submit`)."""

    file: str  # its file name among the rendered artifacts
    header: str  # a comment above it: what it is and how to install it
    object: dict[str, Any]


@dataclass(frozen=True)
class Prerequisite:
    """An object the job names that must exist before the job is created."""

    what: str  # the doctor check's name
    group: str
    version: str
    kind: str
    plural: str
    name: str
    namespaced: bool
    missing: str  # the message when it does not exist: which, and how to get it


class JobKind(Protocol):
    """A Kubernetes job API: its object, its states and its pods."""

    api: str  # the value of k8s.api (also the key of the job among the rendered objects)
    kind: str
    group: str
    version: str
    plural: str
    container: str  # the training container, for logs
    pod_label: str  # the label naming the job on each of its pods
    install_hint: str  # how to get the CRD when the cluster does not serve it
    env_source: str  # who sets the variables below (a comment in env.sh)
    master_env: tuple[str, str]  # the variables giving the master's address and port

    # ----------------------------------------------------------------- rendering

    def values(self, spec: JobSpec) -> dict[str, Any]:
        """The chart values only this kind reads (`None` where the other kind's)."""
        ...

    def job_object(self, values: dict[str, Any], name: str) -> dict[str, Any]:
        """The job laid out from chart values (mirrored by the chart's template)."""
        ...

    def admin_runtime(self, spec: JobSpec, values: dict[str, Any]) -> AdminRuntime | None:
        """What an admin installs for this job, if anything."""
        ...

    def problems(self, spec: JobSpec) -> list[str]:
        """Why this spec cannot run as this kind, if it cannot."""
        ...

    def next_step(self, spec: JobSpec) -> str:
        """How to apply what `render` wrote ({out}, {name}, {chart} filled in later)."""
        ...

    # ------------------------------------------------------- the job in a cluster

    def state_of(self, job: dict[str, Any]) -> JobStatus:
        """The job object's state in shardctl's terms (its state table)."""
        ...

    def prerequisite(self, spec: JobSpec) -> Prerequisite | None:
        """What must exist before the job is created, if anything."""
        ...

    def rejection(self, spec: JobSpec) -> Callable[[str], str | None] | None:
        """A better message for the API server's refusal of the job, when one is known."""
        ...

    # ------------------------------------------------------------------ its pods

    def pod_order(self, pod: dict[str, Any]) -> tuple[int, int, str]:
        """Sort key of a pod: node 0 (the master) first."""
        ...

    def role(self, pod: dict[str, Any]) -> str:
        """A pod's place in the job, as its labels say it (for `logs`)."""
        ...

    def node(self, pod: dict[str, Any]) -> int | None:
        """The node rank a pod runs; None when its labels do not say."""
        ...

    def procs_per_node(self, job: dict[str, Any]) -> int | None:
        """Processes per node, from the job object (`--rank` → node)."""
        ...


def positive_int(raw: Any) -> int | None:
    """A count read off a job object: a positive integer, else None."""
    return int(raw) if str(raw).isdigit() and int(raw) > 0 else None
