"""The clusters shardctl dispatches to, and the one registry of their names.

    local   the rendered launch script, run on this host (clusters/local.py)
    slurm   submitit, one task per node, requeue on preemption (clusters/slurm/)
    k8s     a Kubeflow PyTorchJob through the kubernetes client (clusters/k8s/)

Adding a cluster: one new module with a `Cluster` subclass (see base.py) and one
line in `REGISTRY`. Modules are imported only when their cluster is asked for,
and none imports its client library (submitit, kubernetes) before it must.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..errors import RenderError, UsageError

if TYPE_CHECKING:  # the spec's models cost ~0.1 s to build: not for `--help` or consolidate
    from ..spec import JobSpec
    from .base import Cluster

# name → "module:class", relative to this package. The only list of cluster names.
REGISTRY: dict[str, str] = {
    "local": "local:LocalCluster",
    "slurm": "slurm:SlurmCluster",
    "k8s": "k8s:K8sCluster",
}
CLUSTER_NAMES: tuple[str, ...] = tuple(REGISTRY)


def cluster_class(name: str) -> type[Cluster]:
    if name not in REGISTRY:
        raise UsageError(
            f"--cluster {name!r} is not a cluster; accepted: {', '.join(CLUSTER_NAMES)}"
        )
    module, cls = REGISTRY[name].split(":")
    full = f"{__name__}.{module}"
    try:
        return getattr(importlib.import_module(full), cls)
    except ModuleNotFoundError as exc:
        if exc.name != full:
            raise
        raise RenderError(
            f"cluster {name!r} needs the module {full}, which is missing from this "
            "installation of shardctl"
        ) from None


def get_cluster(name: str, **options: object) -> Cluster:
    """The backend for a cluster name, built with the options that cluster takes."""
    return cluster_class(name)(**options)


def render_artifacts(spec: JobSpec, cluster: str) -> dict[str, str]:
    """Every artifact of `spec` for `cluster`, portable (what the golden files hold)."""
    return get_cluster(cluster).artifacts(spec)
