"""Every launch artifact of a job for one cluster, as `{file name: content}`.

Pure and deterministic: no clock, no host names, no cluster queries, so the same
spec renders the same bytes anywhere (golden-file tests hold it to that).

    job.yaml                 the validated spec the ranks read (derived fields filled in)
    env.sh                   one node's environment (also inlined in launch.sh)
    launch.sh                run once per node: sets the env, execs the launcher
    hostfile                 launcher deepspeed: `node-i slots=N` per node
    accelerate_config.yaml   launcher accelerate: FSDP or DeepSpeed flavour
    ds_config.json           backend deepspeed: DeepSpeed's JSON config
    + the Slurm submission (cluster slurm) or the PyTorchJob and Helm values
      (cluster k8s), from their own modules.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

import yaml

from .errors import RenderError
from .launch import (
    ACCELERATE_CONFIG,
    DS_CONFIG,
    HOSTFILE,
    check_cluster,
    env_file,
    hostfile,
    launch_script,
)
from .spec import JobSpec

SPEC_FILE = "job.yaml"
ENV_FILE = "env.sh"
LAUNCH_FILE = "launch.sh"

# cluster → (module, function) that adds that cluster's own artifacts.
CLUSTER_ARTIFACTS: dict[str, tuple[str, str]] = {
    "slurm": ("shardctl.orchestrator.render_slurm", "slurm_artifacts"),
    "k8s": ("shardctl.orchestrator.render_k8s", "k8s_artifacts"),
}


def job_yaml(spec: JobSpec) -> str:
    """The spec as ranks read it: `load_spec` of this text gives an equal JobSpec."""
    return yaml.safe_dump(spec.to_yaml_dict(), sort_keys=False)


def accelerate_config_yaml(spec: JobSpec) -> str:
    from .accelerate_config import accelerate_config

    header = (
        f"# accelerate config of job {spec.name}, rendered by shardctl.\n"
        "# Per-node values (--machine_rank, --main_process_ip/port) come from launch.sh.\n"
    )
    return header + yaml.safe_dump(accelerate_config(spec), sort_keys=False)


def ds_config_json(spec: JobSpec) -> str:
    from .dsconfig import deepspeed_config

    return json.dumps(deepspeed_config(spec), indent=2) + "\n"


def _node_spec(spec: JobSpec, cluster: str) -> tuple[JobSpec, str]:
    """The spec as the nodes see it and the path they read it from.

    Pods see their checkpoints on the volume, not where the submitting machine
    had them; the k8s module decides that, and the rendered node files must be
    the very ones the pods get.
    """
    if cluster == "k8s":
        module = _cluster_module("k8s")
        pod_spec = getattr(module, "pod_spec", None)
        if pod_spec is not None:
            return pod_spec(spec), f"{module.SPEC_DIR}/{module.SPEC_FILE}"
    return spec, SPEC_FILE


def local_artifacts(spec: JobSpec, cluster: str) -> dict[str, str]:
    """The files that every cluster gets: spec, env, launch script, launcher configs."""
    check_cluster(cluster)
    node_spec, spec_path = _node_spec(spec, cluster)
    files = {
        SPEC_FILE: job_yaml(node_spec),
        ENV_FILE: env_file(node_spec, cluster),
        LAUNCH_FILE: launch_script(node_spec, cluster, spec_path),
    }
    if spec.launcher == "deepspeed":
        files[HOSTFILE] = hostfile(spec)
    if spec.launcher == "accelerate":
        files[ACCELERATE_CONFIG] = accelerate_config_yaml(spec)
    if spec.strategy.backend == "deepspeed":
        files[DS_CONFIG] = ds_config_json(spec)
    return files


def _cluster_module(cluster: str) -> Any:
    module_name, _ = CLUSTER_ARTIFACTS[cluster]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise RenderError(
            f"rendering for cluster {cluster!r} needs the module {module_name}, which is "
            "missing from this installation of shardctl"
        ) from None


def cluster_renderer(cluster: str) -> Callable[[JobSpec], dict[str, str]] | None:
    """The function adding `cluster`'s own artifacts, or None for local."""
    if cluster not in CLUSTER_ARTIFACTS:
        return None
    module = _cluster_module(cluster)
    return getattr(module, CLUSTER_ARTIFACTS[cluster][1])


def render_artifacts(spec: JobSpec, cluster: str) -> dict[str, str]:
    """Every artifact for `cluster` (local | slurm | k8s), sorted by file name."""
    files = local_artifacts(spec, cluster)
    extra = cluster_renderer(cluster)
    if extra is not None:
        for name, content in extra(spec).items():
            if name in files and files[name] != content:
                raise RenderError(
                    f"{cluster} artifacts and the common artifacts both render {name!r} "
                    "with different contents"
                )
            files[name] = content
    return dict(sorted(files.items()))
