"""What every cluster backend is: `submit = schedule ∘ dryrun`.

A cluster class declares, in one place, everything that differs between
clusters:

- `runtime_env(spec)`: how a node learns its rank, the node count, the master
  address and port on that cluster (env lines of the launch script);
- `node_view(spec)`: the spec as its nodes read it and the path they read it
  from (Slurm makes the run dir absolute, Kubernetes moves it onto the volume);
- `own_artifacts(...)`: the files only that cluster needs (the Slurm
  submission, the PyTorchJob and Helm values);
- `dryrun(spec)`: pure; renders exactly what will be sent and talks to no
  cluster. `shardctl render` writes the dry run's artifacts.
- `schedule(dryrun)`: sends that and nothing else; `status`, `logs`, `cancel`.

Backend states map to `JobState` through one explicit table per backend, with
UNKNOWN as the default. This module imports no cluster module.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..errors import RenderError, SpecError, UsageError
from ..launch import TRAIN_MODULE, EnvLine, env_file, launch_script
from ..render import common_artifacts
from ..rundir import SPEC_FILE
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
class NodeView:
    """The spec as a cluster's nodes read it, and the path of their job.yaml."""

    spec: JobSpec
    spec_path: str = SPEC_FILE
    # The spec as the user gave it, where the node view changed paths (k8s: the
    # entrypoint's script is read here and travels to the pods).
    origin: JobSpec | None = None


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


def require_script(spec: JobSpec, where: str) -> None:
    """An entrypoint's script (and code_dir) must exist where the nodes will read it: on
    this machine's file system, which `where` says the nodes share."""
    ep = spec.entrypoint
    if ep is None:
        return
    for name, path, ok in (
        ("entrypoint.script", ep.script, Path.is_file),
        ("entrypoint.code_dir", ep.code_dir, Path.is_dir),
    ):
        if path is not None and not ok(Path(path)):
            what = "a Python file" if name.endswith("script") else "a folder"
            shown = SpecError.show_value(path)
            raise SpecError([f"{name} {shown} is not {what}; accepted: {what} that {where}"])


class Cluster(ABC):
    """One cluster backend."""

    name: ClassVar[str]
    # What `shardctl render` prints after writing the files ({out}, {name}, {spec},
    # {chart}, {manifests}); `next_step_for` may pick it per spec.
    next_step: ClassVar[str] = ""

    def next_step_for(self, spec: JobSpec) -> str:
        return self.next_step

    # -- what the nodes get ----------------------------------------------------------

    @abstractmethod
    def runtime_env(self, spec: JobSpec) -> list[EnvLine]:
        """Env lines that set SHARDCTL_NNODES, SHARDCTL_NODE_RANK, SHARDCTL_NPROC_PER_NODE,
        MASTER_ADDR and MASTER_PORT on a node of this cluster (see launch.RUNTIME_VARS)."""

    def node_view(self, spec: JobSpec) -> NodeView:
        return NodeView(spec)

    def own_artifacts(self, node: NodeView, common: dict[str, str]) -> dict[str, str]:
        """Files only this cluster needs; `common` holds the shared ones already."""
        return {}

    def artifacts(self, spec: JobSpec) -> dict[str, str]:
        """Every file of the job for this cluster, sorted by name. Pure, deterministic."""
        node = self.node_view(spec)
        files = common_artifacts(node.spec, node.spec_path, self.name, self.runtime_env(node.spec))
        own = self.own_artifacts(node, dict(files))
        clash = sorted(k for k in own.keys() & files.keys() if own[k] != files[k])
        if clash:
            raise RenderError(f"{self.name} renders {', '.join(clash)} twice, differently")
        return dict(sorted({**files, **own}.items()))

    def env_file(self, spec: JobSpec) -> str:
        return env_file(spec, self.name, self.runtime_env(spec))

    def launch_script(
        self, spec: JobSpec, spec_path: str = SPEC_FILE, *, module: str = TRAIN_MODULE
    ) -> str:
        return launch_script(spec, self.name, self.runtime_env(spec), spec_path, module=module)

    # -- submit --------------------------------------------------------------------

    @abstractmethod
    def dryrun(self, spec: JobSpec) -> DryRun: ...

    @abstractmethod
    def schedule(self, dryrun: DryRun) -> JobRef: ...

    def submit(self, spec: JobSpec) -> JobRef:
        return self.schedule(self.dryrun(spec))

    # -- follow-up -------------------------------------------------------------------

    @abstractmethod
    def status(self, ref: JobRef) -> JobStatus: ...

    @abstractmethod
    def logs(self, ref: JobRef, tail: int | None = None) -> str: ...

    @abstractmethod
    def cancel(self, ref: JobRef) -> None: ...

    can_follow: ClassVar[bool] = False  # submit --wait
    supports_replace: ClassVar[bool] = False  # submit --replace

    def follow(self, ref: JobRef) -> int:
        """`submit --wait`: follow the job until it ends and return its exit code."""
        raise UsageError(f"--wait is not supported with --cluster {self.name}")
