"""The clusters shardctl dispatches to, and the one registry of their names.

    local   the rendered launch script, run on this host (clusters/local/)
    slurm   submitit, one task per node, requeue on preemption (clusters/slurm/)
    k8s     a Kubeflow PyTorchJob or TrainJob through the kubernetes client (clusters/k8s/)

A cluster is a plugin: a `Cluster` subclass (see base.py) that owns its spec
section (a `ClusterSection` under the cluster's name: `slurm:` in a job spec),
its pre-flight checks (`preflight`, for `shardctl doctor`) and its capabilities.
A built-in cluster is one package here plus one line in `REGISTRY`; a cluster
outside this repository is an installed distribution with an entry point in the
group `shardctl.clusters` (name = "module:Class"), its section the class's
`spec_section`.

Start-up stays light: a built-in cluster's module is imported only when that
cluster is asked for, its section when a spec is read (every spec holds every
built-in section), and entry points are read only for a name that is not built in.
None of it imports a client library (submitit, kubernetes) before it must.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import keyword
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import RenderError, UsageError

if TYPE_CHECKING:  # the spec's models cost ~0.1 s to build: not for `--help` or consolidate
    from ..spec import JobSpec
    from .base import Cluster

ENTRY_POINT_GROUP = "shardctl.clusters"


class Builtin(NamedTuple):
    """Where a built-in cluster lives: "module:Class", relative to this package."""

    cluster: str  # the `Cluster` subclass
    section: str  # its spec section (the same class as the cluster's `spec_section`)


# The only list of built-in cluster names; their sections are written in this order.
REGISTRY: dict[str, Builtin] = {
    "local": Builtin("local:LocalCluster", "local.section:LocalSection"),
    "slurm": Builtin("slurm:SlurmCluster", "slurm.section:SlurmSection"),
    "k8s": Builtin("k8s:K8sCluster", "k8s.section:K8sSection"),
}
CLUSTER_NAMES: tuple[str, ...] = tuple(REGISTRY)


def _load(name: str, ref: str) -> Any:
    module, attr = ref.split(":")
    full = f"{__name__}.{module}"
    try:
        return getattr(importlib.import_module(full), attr)
    except ModuleNotFoundError as exc:
        if exc.name != full:
            raise
        raise RenderError(
            f"cluster {name!r} needs the module {full}, which is missing from this "
            "installation of shardctl"
        ) from None


def _load_section(name: str, ref: str) -> Any:
    """A built-in cluster's section class, loaded without its package's `__init__` (the
    backend, which stays there: submitit pickles the Slurm node task by that path).
    Reading a spec thus costs no backend module; importing the backend later finds
    this same module in `sys.modules`, so there is one class."""
    module = ref.split(":")[0]
    full = f"{__name__}.{module}"
    package = full.rpartition(".")[0]
    if full not in sys.modules and package not in sys.modules:
        path = Path(__file__).parent.joinpath(*module.split(".")).with_suffix(".py")
        spec = importlib.util.spec_from_file_location(full, path)
        if spec is None or spec.loader is None or not path.is_file():
            raise RenderError(
                f"cluster {name!r} needs the module {full}, which is missing from this "
                "installation of shardctl"
            )
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[full] = loaded
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules[full]
            raise
    return _load(name, ref)


@functools.cache
def _entry_points() -> dict[str, Any]:
    """The installed plugin clusters: name → entry point (not loaded). Reading them
    scans every installed distribution's metadata: only for names not built in."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def plugin_names() -> tuple[str, ...]:
    """Names of the clusters installed as plugins (a built-in name is never one)."""
    return tuple(sorted(n for n in _entry_points() if n not in REGISTRY))


def _accepted() -> str:
    return ", ".join((*CLUSTER_NAMES, *plugin_names()))


def _plugin_class(name: str) -> type[Cluster]:
    from ..spec.job import JobSpec
    from .base import Cluster

    ep = _entry_points()[name]
    where = f"cluster {name!r} (entry point {ep.value!r} of {ENTRY_POINT_GROUP})"
    if not name.isidentifier() or keyword.iskeyword(name) or name in JobSpec.model_fields:
        raise UsageError(
            f"{where}: its name must be a Python identifier and not a core section of "
            f"the spec ({', '.join(JobSpec.model_fields)}); rename the entry point"
        )
    try:
        cls = ep.load()
    except Exception as exc:  # an installed plugin's own import error, named as such
        raise RenderError(f"{where} cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Cluster)):
        raise RenderError(f"{where} is not a shardctl Cluster subclass")
    if getattr(cls, "name", None) != name:
        raise RenderError(
            f"{where}: its class says name = {getattr(cls, 'name', None)!r}; the entry "
            "point's name and the class's must be the same (it names the spec section)"
        )
    return cls


def cluster_class(name: str) -> type[Cluster]:
    if name in REGISTRY:
        return _load(name, REGISTRY[name].cluster)  # type: ignore[no-any-return]
    if name in _entry_points():
        return _plugin_class(name)
    raise UsageError(f"--cluster {name!r} is not a cluster; accepted: {_accepted()}")


def section_model(name: str) -> Any:
    """The spec section (a pydantic model) of cluster `name`, or None for a plugin
    without one. A built-in's loads without its backend's client libraries."""
    if name in REGISTRY:
        return _load_section(name, REGISTRY[name].section)
    return cluster_class(name).spec_section


def get_cluster(name: str, **options: object) -> Cluster:
    """The backend for a cluster name, built with the options that cluster takes."""
    return cluster_class(name)(**options)


def render_artifacts(spec: JobSpec, cluster: str) -> dict[str, str]:
    """Every artifact of `spec` for `cluster`, portable (what the golden files hold)."""
    return get_cluster(cluster).artifacts(spec)
