"""The launch artifacts every cluster shares, as `{file name: content}`.

Pure and deterministic: no clock, no host names, no cluster queries, so the same
spec renders the same bytes anywhere (golden-file tests hold it to that).

    job.yaml                 the validated spec the ranks read (derived fields filled in)
    env.sh                   one node's environment (also inlined in launch.sh)
    launch.sh                run once per node: sets the env, execs the launcher
    hostfile                 launcher deepspeed: `node-i slots=N` per node
    accelerate_config.yaml   launcher accelerate: FSDP or DeepSpeed flavour
    ds_config.json           backend deepspeed: DeepSpeed's JSON config

A cluster adds its own files (the Slurm submission, the PyTorchJob and Helm
values) and decides the runtime env lines and the spec as its nodes see it;
see `shardctl.orchestrator.clusters`. This module knows no cluster.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import yaml

from .launch import (
    ACCELERATE_CONFIG,
    DS_CONFIG,
    HOSTFILE,
    EnvLine,
    env_file,
    hostfile,
    launch_script,
)
from .rundir import ENV_FILE, LAUNCH_FILE, SPEC_FILE
from .spec import JobSpec

__all__ = ["ENV_FILE", "LAUNCH_FILE", "SPEC_FILE", "common_artifacts", "launcher_files"]


def job_yaml(spec: JobSpec) -> str:
    """The spec as ranks read it: `read_job_yaml` of this text gives an equal JobSpec."""
    return yaml.safe_dump(spec.to_yaml_dict(), sort_keys=False)


def accelerate_config_yaml(spec: JobSpec) -> str:
    from .accelerate_config import accelerate_config_text

    return accelerate_config_text(spec)


def ds_config_json(spec: JobSpec) -> str:
    from .dsconfig import deepspeed_config

    return json.dumps(deepspeed_config(spec), indent=2) + "\n"


def launcher_files(spec: JobSpec) -> dict[str, str]:
    """The files the launcher reads beside launch.sh; the same on every cluster."""
    files: dict[str, str] = {}
    if spec.launcher == "deepspeed":
        files[HOSTFILE] = hostfile(spec)
    if spec.launcher == "accelerate":
        files[ACCELERATE_CONFIG] = accelerate_config_yaml(spec)
    if spec.strategy.backend == "deepspeed":
        files[DS_CONFIG] = ds_config_json(spec)
    return files


def common_artifacts(
    node_spec: JobSpec,
    spec_path: str,
    cluster: str,
    runtime: Sequence[EnvLine],
    *,
    node_agent: str | None = None,
) -> dict[str, str]:
    """Spec, env, launch script and launcher configs, as the nodes of `cluster` get them.

    `node_spec` is the spec as the nodes read it (the cluster may move its run dir)
    and `spec_path` where they read it; `runtime` sets the node's rank, the node
    count and the master address from the cluster's own variables; `node_agent`: the
    module the launch script execs the launcher under (`launch.launch_script`).
    """
    return {
        SPEC_FILE: job_yaml(node_spec),
        ENV_FILE: env_file(node_spec, cluster, runtime, spec_path),
        LAUNCH_FILE: launch_script(node_spec, cluster, runtime, spec_path, node_agent=node_agent),
        **launcher_files(node_spec),
    }
