"""What every cluster backend is: `submit = schedule ∘ dryrun`.

`dryrun(spec)` is pure: it renders exactly what will be sent and talks to no
cluster. `schedule(dryrun)` sends that and nothing else. Backend states map to
`JobState` through one explicit table per backend, with UNKNOWN as the default.

Submitted jobs are remembered in a small JSON record per job name under the
state directory (`$SHARDCTL_STATE_DIR`, default `~/.local/state/shardctl`), so
`shardctl status|logs|cancel NAME` find the cluster and id without asking.
"""

from __future__ import annotations

import enum
import json
import os
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import JobNotFoundError, UsageError
from ..spec import JobSpec


class JobState(enum.StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"  # stopped by the cluster; will resume (requeue/restart)
    UNKNOWN = "UNKNOWN"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class DryRun:
    """Exactly what `schedule` will send. Never changed after it is made."""

    cluster: str
    spec: JobSpec
    # Rendered files (relative path → text) that `schedule` writes or sends.
    artifacts: dict[str, str]
    # The backend's request (submitit parameters, the PyTorchJob object, argv ...).
    request: Any
    # What `--dry-run` prints: the request in the form the cluster receives it.
    text: str


@dataclass(frozen=True)
class JobRef:
    """A submitted job: enough to find it again."""

    cluster: str
    job_id: str
    name: str
    run_dir: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class JobStatus:
    state: JobState
    native_state: str  # the backend's own word, for humans
    detail: str = ""


class Cluster(ABC):
    """One cluster backend."""

    name: str

    @abstractmethod
    def dryrun(self, spec: JobSpec) -> DryRun: ...

    @abstractmethod
    def schedule(self, dryrun: DryRun) -> JobRef: ...

    def submit(self, spec: JobSpec) -> JobRef:
        return self.schedule(self.dryrun(spec))

    @abstractmethod
    def status(self, ref: JobRef) -> JobStatus: ...

    @abstractmethod
    def logs(self, ref: JobRef, tail: int | None = None) -> str: ...

    @abstractmethod
    def cancel(self, ref: JobRef) -> None: ...

    def follow(self, ref: JobRef) -> int:
        """`submit --wait`: follow the job until it ends and return its exit code."""
        raise UsageError(f"--wait is not supported with --cluster {self.name}")


def get_cluster(name: str, *, replace: bool = False) -> Cluster:
    """The backend for a cluster name; heavy imports happen only here.

    `replace` (k8s only): delete a job of the same name before creating the new one.
    """
    if replace and name != "k8s":
        raise UsageError(f"--replace works with --cluster k8s, not --cluster {name}")
    if name == "local":
        from .local import LocalCluster

        return LocalCluster()
    if name == "slurm":
        from .slurm import SlurmCluster

        return SlurmCluster()
    if name == "k8s":
        from .k8s import K8sCluster

        return K8sCluster(replace=replace or None)
    raise UsageError(f"--cluster {name!r} is not a cluster; accepted: local, slurm, k8s")


# ----------------------------------------------------------------- job records


def state_dir() -> Path:
    base = os.environ.get("SHARDCTL_STATE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "shardctl"


def remember(ref: JobRef) -> None:
    """Record a submitted job (written atomically; the newest per name wins)."""
    folder = state_dir() / "jobs"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{ref.name}.json.tmp"
    tmp.write_text(json.dumps(ref.to_json(), indent=2, sort_keys=True))
    tmp.replace(folder / f"{ref.name}.json")


def recall(name_or_id: str) -> JobRef:
    """Find a submitted job by name, or by cluster job id."""
    folder = state_dir() / "jobs"
    records = sorted(folder.glob("*.json")) if folder.is_dir() else []
    refs = [JobRef(**json.loads(p.read_text())) for p in records]
    for ref in refs:
        if ref.name == name_or_id:
            return ref
    for ref in refs:
        if ref.job_id == name_or_id:
            return ref
    known = ", ".join(r.name for r in refs) or "none"
    raise JobNotFoundError(
        f"no submitted job named or with id {name_or_id!r} (known jobs: {known}); "
        "submit one with `shardctl submit SPEC`"
    )
