"""The Kubernetes side of a job: the chart values, the ConfigMap and the job object.

Python decides every value; the objects are plain data. The decisions are made
once, in `values_from(spec, ...)`, and `objects_from_values(values)` lays them out
as the ConfigMap and the job; the job is the spec's `JobKind`'s (`apis.job_kind`) to
lay out: a PyTorchJob (pytorchjob.py) or a TrainJob (trainjob.py), both built from
the pod parts in pods.py. The Helm chart in `helm/shardctl-job` is the twin of `objects_from_values`
written in Go templates, so `helm template` of the values rendered here yields the
very same objects (a test compares them).

The layout inside every pod is described in pods.py. The pods see the spec as
`pod_spec` rewrites it: the run dir and the checkpoints on the volume at RUNS_MOUNT,
an entrypoint's code where it travelled.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ...errors import SpecError
from ...launch import (
    ACCELERATE_CONFIG,
    DS_CONFIG,
    HOSTFILE,
    RENDER_DIR_VAR,
    EnvLine,
    export_from,
    launch_argv,
)
from ...render import common_artifacts
from ...rundir import ENV_EXIT_CODES, ENV_POD_RESTARTS
from ...spec import JobSpec, parse_spec
from ...storage import is_object_url
from ..base import NodeView
from .apis import job_kind
from .jobkind import AdminRuntime
from .node_agent import ENV_POD_COUNTS, counts_place
from .node_agent import MODULE as NODE_AGENT_MODULE
from .pods import (
    CACHE_MOUNT,
    CODE_DIR,
    LAUNCH_FILE,
    RUNS_MOUNT,
    SPEC_DIR,
    SPEC_FILE,
    configmap_name,
    cut_name,
    object_metadata,
)
from .section import ExtraVolume

# Kubernetes refuses a ConfigMap whose data exceeds 1 MiB.
CONFIGMAP_LIMIT = 1024 * 1024


# Writable places for tools that assume a writable HOME or cache dir; the root
# filesystem stays read-only.
CACHE_ENV = {
    "HOME": f"{CACHE_MOUNT}/home",
    "XDG_CACHE_HOME": CACHE_MOUNT,
    "TRITON_CACHE_DIR": f"{CACHE_MOUNT}/triton",
    "TORCH_EXTENSIONS_DIR": f"{CACHE_MOUNT}/torch_extensions",
    "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_MOUNT}/inductor",
    "PYTHONUNBUFFERED": "1",
    "TMPDIR": "/tmp",
}


# ----------------------------------------------------------------- decisions


def code_mode(spec: JobSpec) -> str | None:
    """How the entrypoint's code reaches the pods (`k8s.code`, or its default)."""
    ep = spec.entrypoint
    if ep is None:
        return None
    return spec.k8s.code or ("configmap" if ep.script else "image")


@dataclass(frozen=True)
class CodeFile:
    """One file of the user's code that travels in the ConfigMap."""

    key: str  # its ConfigMap key
    path: str  # below CODE_DIR in the pod
    source: str  # where it was read on this machine
    content: str


def _code_sources(spec: JobSpec) -> list[tuple[str, Path]]:
    """(path below CODE_DIR, local file) of the code that travels, script included."""
    ep = spec.entrypoint
    assert ep is not None and ep.script is not None  # code_mode "configmap" says so
    script = Path(ep.script)
    if ep.code_dir is None:
        return [(script.name, script)]
    root = Path(ep.code_dir)
    if not root.is_dir():
        raise SpecError([f"entrypoint.code_dir {str(root)!r} is not a folder"])
    try:
        script.resolve().relative_to(root.resolve())
    except ValueError:
        raise SpecError(
            [f"entrypoint.script {str(script)!r} is not inside entrypoint.code_dir {str(root)!r}"]
        ) from None
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        # Caches and version-control folders never need to travel.
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        if path.is_file():
            files.append((rel.as_posix(), path))
    return files


def shipped_code(spec: JobSpec) -> list[CodeFile]:
    """The files that travel with the ConfigMap (none unless `code_mode` is configmap)."""
    if code_mode(spec) != "configmap":
        return []
    shipped: list[CodeFile] = []
    for i, (rel, path) in enumerate(_code_sources(spec)):
        ep = spec.entrypoint
        field = "entrypoint.code_dir" if ep is not None and ep.code_dir else "entrypoint.script"
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise SpecError(
                [
                    f"{field}: cannot read {str(path)!r} ({exc.strerror}); it travels to the "
                    "pods in the job's ConfigMap"
                ]
            ) from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError(
                [
                    f"{field}: {str(path)!r} is not UTF-8 text, which a ConfigMap cannot "
                    "carry as a file here; put the code in the image (k8s.code: image) or "
                    "on the PVC"
                ]
            ) from None
        shipped.append(CodeFile(f"code-{i:03d}", rel, str(path), text))
    return shipped


def pod_script(spec: JobSpec) -> str | None:
    """Where the entrypoint's script is inside the pods."""
    ep = spec.entrypoint
    if ep is None or ep.script is None:
        return None
    if code_mode(spec) != "configmap":
        return ep.script  # in the image, at the path the spec gives
    if ep.code_dir is None:
        return f"{CODE_DIR}/{Path(ep.script).name}"
    rel = Path(ep.script).resolve().relative_to(Path(ep.code_dir).resolve())
    return f"{CODE_DIR}/{rel.as_posix()}"


def pod_spec(spec: JobSpec) -> JobSpec:
    """The spec as the pods see it: checkpoints (and so the run dir) on the PVC mount.

    A checkpoint dir from the submitting machine means nothing inside a pod; the
    only storage that survives a pod is the volume at RUNS_MOUNT, so the run dir
    becomes RUNS_MOUNT/<name> there. A checkpoint dir in a bucket (`s3://`) is the
    same for every pod and is kept: a one-node job then needs no PVC (the run dir's
    small files, and the saves staged before their upload, in the pod's emptyDir).
    """
    data = spec.to_yaml_dict()
    data["run_dir"] = f"{RUNS_MOUNT}/{spec.name}"
    if not is_object_url(spec.checkpoint_dir):
        data["checkpoint"]["dir"] = f"{RUNS_MOUNT}/{spec.name}/checkpoints"
    if spec.entrypoint is not None and spec.entrypoint.script is not None:
        data["entrypoint"]["script"] = pod_script(spec)
        data["entrypoint"]["code_dir"] = None  # it has travelled: CODE_DIR in the pod
    return parse_spec(data, source="k8s pod spec")


def runtime_env(spec: JobSpec) -> list[EnvLine]:
    """A pod learns its place from the variables the Kubeflow operator injects: the
    training operator's (PyTorchJob) or Trainer v2's torch plugin (TrainJob)."""
    kind = job_kind(spec.k8s.api)
    where, master = kind.env_source, kind.master_env
    return [
        export_from("SHARDCTL_NNODES", "PET_NNODES", where),
        export_from("SHARDCTL_NODE_RANK", "PET_NODE_RANK", where),
        export_from("SHARDCTL_NPROC_PER_NODE", "PET_NPROC_PER_NODE", where),
        export_from("MASTER_ADDR", master[0], where),
        export_from("MASTER_PORT", master[1], where),
        # The operator says nothing about restarts: each pod's node agent counts its
        # starts (the run contract's SHARDCTL_ATTEMPT) and restarts where they survive
        # the pod (`node_agent.counts_place`).
        EnvLine(
            f"export {ENV_POD_COUNTS}={shlex.quote(pod_counts_place(spec))}",
            "where the node agent keeps this node's starts and restarts ('': nowhere)",
        ),
        *exit_code_lines(spec),
        *setup_lines(spec),
    ]


def exit_codes_decide(spec: JobSpec) -> bool:
    """Whether the pods' exit codes carry shardctl's decision: a PyTorchJob under
    `restartPolicy: ExitCode` (the default) and every TrainJob (its runtime's failure
    policy reads them). Under another restart policy the launcher's code is kept."""
    return spec.k8s.api == "trainjob" or spec.k8s.restart_policy == "ExitCode"


def pod_counts_place(spec: JobSpec) -> str:
    """Where a pod's counts survive it: the run dir on the PVC, else beside the
    checkpoints in their bucket, else nowhere ('')."""
    # `pod_spec`'s run dir; a bucket checkpoint dir is kept as it is there.
    run_dir = f"{RUNS_MOUNT}/{spec.name}"
    return counts_place(run_dir, str(spec.checkpoint_dir), on_volume=bool(spec.k8s.pvc))


def pod_restart_bound(spec: JobSpec) -> int:
    """Restarts of a node after a crash or a hang: `k8s.backoff_limit`, counted on the
    PVC or, without one, in the checkpoints' bucket. With neither (an emptyDir goes
    with the pod) nothing would keep the count or a checkpoint to resume from, so a
    crash or a hang stops the job."""
    return spec.k8s.backoff_limit if pod_counts_place(spec) else 0


def exit_code_lines(spec: JobSpec) -> list[EnvLine]:
    """The pod's exit code for the operator (the node agent's, `node_agent.PodAdapter`)."""
    if not exit_codes_decide(spec):
        return []
    return [
        EnvLine(
            f"export {ENV_EXIT_CODES}=kubernetes",
            "the pod's exit code carries the decision: 0 done, 128-255 restart, 1-127 stop",
        ),
        EnvLine(
            f"export {ENV_POD_RESTARTS}={pod_restart_bound(spec)}",
            "restarts of this node after a crash or a hang (k8s.backoff_limit; 0 with "
            "neither k8s.pvc nor an s3:// checkpoint.dir)",
        ),
    ]


def setup_lines(spec: JobSpec) -> list[EnvLine]:
    """`k8s.setup`: the user's shell lines, run in every pod before the launcher."""
    lines = [EnvLine(line) for line in spec.k8s.setup]
    if lines:
        lines[0] = EnvLine(lines[0].text, "k8s.setup: run in every pod before the launcher")
    return lines


def node_view(spec: JobSpec) -> NodeView:
    """The pods read the pod spec from the ConfigMap mount."""
    return NodeView(pod_spec(spec), f"{SPEC_DIR}/{SPEC_FILE}", origin=spec)


def configmap_launcher_files(node: NodeView, common: dict[str, str]) -> dict[str, str]:
    """Files the launch script reads beside itself (accelerate config, hostfile ...).

    They go into the ConfigMap next to launch.sh, so `${SHARDCTL_RENDER_DIR}` (the
    script's folder, /etc/shardctl in the pod) holds them. Which ones is read off
    the launcher's own words; their text is what `shardctl render` writes.
    """
    argv = launch_argv(node.spec, node.spec_path)
    return {
        name: common[name]
        for name in (HOSTFILE, ACCELERATE_CONFIG, DS_CONFIG)
        if f"${{{RENDER_DIR_VAR}}}/{name}" in argv
    }


def pod_resources(spec: JobSpec) -> dict[str, dict[str, str]]:
    """Requests equal limits (Guaranteed QoS): a training pod is never the one to be squeezed."""
    r, k = spec.resources, spec.k8s
    amounts: dict[str, str] = {"cpu": k.cpu or str(r.procs_per_node * r.cpus_per_proc)}
    if r.memory:
        amounts["memory"] = r.memory.k8s()
    if r.device == "cuda":
        amounts[k.gpu_resource] = str(r.procs_per_node)
    return {"limits": dict(amounts), "requests": dict(amounts)}


def extra_volume(vol: ExtraVolume) -> dict[str, Any]:
    """A `k8s.volumes` entry as the pod's volume and the container's mount."""
    source: dict[str, Any]
    match vol.source:
        case "pvc":
            source = {"persistentVolumeClaim": {"claimName": vol.pvc, "readOnly": vol.read_only}}
        case "config_map":
            source = {"configMap": {"name": vol.config_map}}
        case "secret":
            source = {"secret": {"secretName": vol.secret}}
        case "host_path":
            source = {"hostPath": {"path": vol.host_path, "type": "Directory"}}
        case "nfs":
            server, _, path = (vol.nfs or "").partition(":")
            source = {"nfs": {"server": server, "path": path, "readOnly": vol.read_only}}
        case _:
            source = {"emptyDir": {}}
    mount: dict[str, Any] = {
        "name": vol.name,
        "mountPath": vol.mount_path,
        "readOnly": vol.read_only,
    }
    if vol.sub_path:
        mount["subPath"] = vol.sub_path
    return {"volume": {"name": vol.name, **source}, "mount": mount}


def values_from(spec: JobSpec, node: NodeView, common: dict[str, str]) -> dict[str, Any]:
    """Every value of the chart `helm/shardctl-job`, decided from the spec and the
    node files already rendered for the pods (`common`).

    `helm install NAME helm/shardctl-job -f values.yaml` creates exactly the
    objects of `objects_from_values(values)`.
    """
    k = spec.k8s
    run_policy: dict[str, Any] = {
        "backoffLimit": k.backoff_limit,
        "cleanPodPolicy": k.clean_pod_policy,
        "suspend": k.suspend,
    }
    if k.ttl_seconds_after_finished is not None:
        run_policy["ttlSecondsAfterFinished"] = k.ttl_seconds_after_finished
    if k.active_deadline_seconds is not None:
        run_policy["activeDeadlineSeconds"] = k.active_deadline_seconds
    elastic = None
    if k.elastic is not None:
        elastic = {
            "minReplicas": k.elastic.min_nodes,
            "maxReplicas": k.elastic.max_nodes,
            "maxRestarts": k.elastic.max_restarts,
        }
    tolerations = [
        t.model_dump(by_alias=True, exclude_none=True)
        for t in k.tolerations  # key/operator/value/effect/tolerationSeconds: the k8s names
    ]
    return {
        "api": k.api,
        **job_kind(k.api).values(spec),
        "name": spec.name,
        "namespace": k.namespace,
        "image": k.image,
        "imagePullPolicy": k.image_pull_policy,
        "imagePullSecrets": list(k.image_pull_secrets),
        "serviceAccount": {"name": k.service_account, "create": False},
        "nodes": spec.resources.nodes,
        "nprocPerNode": spec.resources.procs_per_node,
        "masterPort": k.master_port,
        "resources": pod_resources(spec),
        "nodeSelector": dict(k.node_selector),
        "tolerations": tolerations,
        "affinity": k.affinity.k8s() if k.affinity is not None else None,
        "schedulerName": k.scheduler_name,
        "priorityClassName": k.priority_class,
        "labels": dict(k.labels),
        "annotations": dict(k.annotations),
        "extraVolumes": [extra_volume(v) for v in k.volumes],
        "restartPolicy": k.restart_policy,
        "runPolicy": run_policy,
        "elastic": elastic,
        "envFrom": {
            "configMaps": list(k.env_from_config_maps),
            "secrets": list(k.env_from_secrets),
        },
        "env": dict(CACHE_ENV),
        "shmSize": k.shm_size.k8s(),
        "securityContext": {
            "runAsUser": k.run_as_user,
            "readOnlyRootFilesystem": k.read_only_root_filesystem,
        },
        "storage": {"claimName": k.pvc, "create": False, "size": "50Gi", "storageClassName": None},
        "terminationGracePeriodSeconds": k.termination_grace_s,
        "jobSpec": common[SPEC_FILE],
        "launchScript": common[LAUNCH_FILE],
        "launcherFiles": configmap_launcher_files(node, common),
        "codeFiles": [
            {"key": f.key, "path": f"code/{f.path}", "content": f.content}
            for f in shipped_code(node.origin or spec)
        ],
    }


# -------------------------------------------------------------------- layout
# `objects_from_values` is mirrored line by line by helm/shardctl-job/templates/.
# Change both together; tests/test_helm_chart.py compares their output.


def objects_from_values(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ConfigMap and the job (a PyTorchJob or a TrainJob) laid out from chart values."""
    kind = job_kind(values["api"])
    name = cut_name(values["name"])
    return {
        "configmap": _configmap(values, name),
        kind.api: kind.job_object(values, name),
    }


def job_key(objects: dict[str, Any]) -> str:
    """ "pytorchjob" or "trainjob": the key of the job among the rendered objects."""
    return next(key for key in objects if key != "configmap")


def _configmap(values: dict[str, Any], name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(name),
            "namespace": values["namespace"],
            **object_metadata(values, name),
        },
        "data": {
            **values["launcherFiles"],
            SPEC_FILE: values["jobSpec"],
            LAUNCH_FILE: values["launchScript"],
            **{f["key"]: f["content"] for f in values["codeFiles"]},
        },
    }


# --------------------------------------------------------------------- public


@dataclass(frozen=True)
class K8sRender:
    """Everything rendered for Kubernetes from one spec, each part computed once."""

    node: NodeView
    common: dict[str, str]  # job.yaml, env.sh, launch.sh, launcher files (pod view)
    values: dict[str, Any]  # the Helm chart's values
    objects: dict[str, dict[str, Any]]  # {"configmap": ..., "pytorchjob"|"trainjob": ...}
    # What a cluster admin installs beside the job, when its kind needs one (a TrainJob's
    # runtime, for when the stock one does not fit).
    admin: AdminRuntime | None = None

    @property
    def runtime(self) -> dict[str, Any] | None:
        return self.admin.object if self.admin is not None else None

    @property
    def job(self) -> dict[str, Any]:
        return self.objects[job_key(self.objects)]

    @property
    def files(self) -> dict[str, str]:
        """The k8s-only files: the objects for kubectl and the values for the chart."""
        files = {
            f"{job_key(self.objects)}.yaml": dump(self.job),
            "configmap.yaml": dump(self.objects["configmap"]),
            "values.yaml": "# Values for the chart helm/shardctl-job (rendered by shardctl)\n"
            + dump(self.values),
        }
        if self.admin is not None:
            files[self.admin.file] = self.admin.header + dump(self.admin.object)
        return files

    @property
    def manifests(self) -> str:
        """ConfigMap and PyTorchJob as one multi-document YAML (`kubectl apply -f -`),
        after a comment naming the code that travels in the ConfigMap, if any."""
        travels = "".join(
            f"# travels with the ConfigMap: {f['path'].removeprefix('code/')} → "
            f"{CODE_DIR}/{f['path'].removeprefix('code/')} ({len(f['content'].encode()):,} B)\n"
            for f in self.values["codeFiles"]
        )
        return travels + "---\n" + dump(self.objects["configmap"]) + "---\n" + dump(self.job)


def run_problems(spec: JobSpec) -> list[str]:
    """What a job needs to run on Kubernetes that the spec alone cannot promise: the
    section's rules, then those of its API (a TrainJob's runtime, ...)."""
    return spec.k8s.run_problems(spec) + job_kind(spec.k8s.api).problems(spec)


def render_from(spec: JobSpec, node: NodeView, common: dict[str, str]) -> K8sRender:
    problems = run_problems(spec)
    if problems:
        raise SpecError(problems)
    values = values_from(spec, node, common)
    admin = job_kind(spec.k8s.api).admin_runtime(spec, values)
    rendered = K8sRender(node, common, values, objects_from_values(values), admin)
    data = rendered.objects["configmap"]["data"]
    size = sum(len(text.encode("utf-8")) for text in data.values())
    if size > CONFIGMAP_LIMIT:
        code = sum(len(f["content"].encode("utf-8")) for f in values["codeFiles"])
        raise SpecError(
            [
                f"the job's ConfigMap would hold {size:,} bytes ({code:,} of them "
                f"entrypoint code), more than Kubernetes' {CONFIGMAP_LIMIT:,}; put the code "
                "in the image (k8s.code: image, entrypoint.script: its path there) or on "
                "the PVC, or ship a smaller entrypoint.code_dir"
            ]
        )
    return rendered


def render(spec: JobSpec) -> K8sRender:
    node = node_view(spec)
    common = common_artifacts(
        node.spec, node.spec_path, "k8s", runtime_env(node.spec), node_agent=NODE_AGENT_MODULE
    )
    return render_from(spec, node, common)


def helm_values(spec: JobSpec) -> dict[str, Any]:
    return render(spec).values


def k8s_objects(spec: JobSpec) -> dict[str, dict[str, Any]]:
    """{"configmap": ..., "pytorchjob": ...} for the spec."""
    return render(spec).objects


def pytorchjob(spec: JobSpec) -> dict[str, Any]:
    """The PyTorchJob object (kubeflow.org/v1) for the spec."""
    return k8s_objects(spec)["pytorchjob"]


def configmap(spec: JobSpec) -> dict[str, Any]:
    """The ConfigMap that carries job.yaml and launch.sh into the pods."""
    return k8s_objects(spec)["configmap"]


def k8s_artifacts(spec: JobSpec) -> dict[str, str]:
    return render(spec).files


def manifests(spec: JobSpec) -> str:
    return render(spec).manifests


class _Dumper(yaml.SafeDumper):
    """Deterministic YAML: sorted keys, multi-line strings as literal blocks, no aliases
    (Master and Worker share one pod template dict; kubectl users expect it spelled out)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=True, default_flow_style=False, width=1000)
