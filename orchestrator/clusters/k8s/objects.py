"""The Kubernetes side of a job: a Kubeflow `PyTorchJob` (kubeflow.org/v1) and its ConfigMap.

Python decides every value; the object is plain data. The decisions are made
once, in `helm_values(spec)`, and `objects_from_values(values)` lays them out as
the ConfigMap and the PyTorchJob. The Helm chart in `helm/shardctl-job` is the
twin of `objects_from_values` written in Go templates, so `helm template` of
the values rendered here yields the very same objects (a test compares them).

Layout inside every pod (the paths are part of the interface, see README `k8s`):

    /etc/shardctl/job.yaml     the validated spec, from the ConfigMap (read-only)
    /etc/shardctl/launch.sh    the launch script (`launch_script(spec, "k8s", ...)`), and
                               beside it the files it reads (accelerate config, hostfile)
    /shardctl/runs/            the PVC (or an emptyDir when no PVC is given); the
                               run dir is /shardctl/runs/<name>, checkpoints in
                               /shardctl/runs/<name>/checkpoints, whatever
                               `checkpoint.dir` said on the submitting machine
    /shardctl/cache/           writable emptyDir: HOME, Triton and torch caches
    /tmp, /dev/shm             writable emptyDirs (/dev/shm in memory, for dataloaders)

The root filesystem is read-only by default, so everything a rank writes goes
to one of those mounts. A pod that is deleted or preempted restarts (restart
policy OnFailure/ExitCode) with the same PVC and resumes from the newest
complete checkpoint there.
"""

from __future__ import annotations

import copy
import re
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
from ...rundir import ENV_ATTEMPT, ENV_RUN_DIR
from ...spec import JobSpec, parse_spec
from ..base import NodeView
from .section import ExtraVolume

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"

SPEC_DIR = "/etc/shardctl"
CODE_DIR = f"{SPEC_DIR}/code"  # an entrypoint's code, when it travels in the ConfigMap
# Kubernetes refuses a ConfigMap whose data exceeds 1 MiB.
CONFIGMAP_LIMIT = 1024 * 1024
SPEC_FILE = "job.yaml"
LAUNCH_FILE = "launch.sh"
RUNS_MOUNT = "/shardctl/runs"
CACHE_MOUNT = "/shardctl/cache"
CONTAINER = "pytorch"  # the operator finds the training container by this name
PORT_NAME = "pytorchjob-port"  # the operator reads MASTER_PORT from the port of this name
# Kubernetes object names and label values are at most 63 characters (DNS-1123 label).
NAME_LIMIT = 63

# The operator injects RANK (the *node* rank) and WORLD_SIZE (the node count)
# into every pod of a PyTorchJob. torchrun sets both per process for its
# children, but nothing before it may take them for the rank's own: the
# container starts the launch script with both removed, and the script reads
# the PET_* variables the operator provides for torchrun.
OPERATOR_MISLEADING_ENV = ("RANK", "WORLD_SIZE")

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

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"


def cut_name(name: str, suffix: str = "") -> str:
    """`name + suffix` cut to 63 characters, one trailing '-' removed.

    Exactly what the chart's `shardctl-job.name` helper does (`trunc 63 | trimSuffix "-"`).
    """
    return (name + suffix)[:NAME_LIMIT].removesuffix("-")


def configmap_name(job_name: str) -> str:
    return cut_name(job_name, "-spec")


def labels(job_name: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The user's `k8s.labels`, then shardctl's own (which always win: the CLI finds
    its objects by them)."""
    return {
        **(extra or {}),
        LABEL_NAME: "shardctl",
        LABEL_INSTANCE: cut_name(job_name),
        LABEL_COMPONENT: "training",
        LABEL_PART_OF: "shardctl",
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
    becomes RUNS_MOUNT/<name> there.
    """
    data = spec.to_yaml_dict()
    data["run_dir"] = f"{RUNS_MOUNT}/{spec.name}"
    data["checkpoint"]["dir"] = f"{RUNS_MOUNT}/{spec.name}/checkpoints"
    if spec.entrypoint is not None and spec.entrypoint.script is not None:
        data["entrypoint"]["script"] = pod_script(spec)
        data["entrypoint"]["code_dir"] = None  # it has travelled: CODE_DIR in the pod
    return parse_spec(data, source="k8s pod spec")


def runtime_env(spec: JobSpec) -> list[EnvLine]:
    """A pod learns its place from the variables the Kubeflow operator injects: the
    training operator's (PyTorchJob) or Trainer v2's torch plugin (TrainJob)."""
    if spec.k8s.api == "trainjob":
        where = "set by the torch plugin of Kubeflow Trainer in TrainJob pods"
        master = ("PET_MASTER_ADDR", "PET_MASTER_PORT")
    else:
        where = "set by the Kubeflow training operator in PyTorchJob pods"
        master = ("MASTER_ADDR", "MASTER_PORT")
    return [
        export_from("SHARDCTL_NNODES", "PET_NNODES", where),
        export_from("SHARDCTL_NODE_RANK", "PET_NODE_RANK", where),
        export_from("SHARDCTL_NPROC_PER_NODE", "PET_NPROC_PER_NODE", where),
        export_from("MASTER_ADDR", master[0], where),
        export_from("MASTER_PORT", master[1], where),
        # The operator says nothing about restarts: each pod counts its own starts in
        # the run dir (on the PVC, so they survive the pod).
        EnvLine(
            f'attempts="${{{ENV_RUN_DIR}}}/.attempts/node-${{SHARDCTL_NODE_RANK}}"',
            "starts of this node so far (the run contract's attempt number)",
        ),
        EnvLine(f'mkdir -p "${{{ENV_RUN_DIR}}}/.attempts"'),
        EnvLine('previous="$(cat "${attempts}" 2>/dev/null || echo -1)"'),
        EnvLine(f'{ENV_ATTEMPT}="$((previous + 1))"'),
        EnvLine(f'printf \'%s\\n\' "${{{ENV_ATTEMPT}}}" >"${{attempts}}"'),
        EnvLine(f"export {ENV_ATTEMPT}"),
        *setup_lines(spec),
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
    from .trainjob import trainjob_values  # the TrainJob layout builds on this module

    return {
        "api": k.api,
        **(trainjob_values(spec) if k.api == "trainjob" else {"runtimeRef": None}),
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
    from .trainjob import trainjob_from_values  # it builds on this module's pod parts

    name = cut_name(values["name"])
    if values["api"] == "trainjob":
        return {
            "configmap": _configmap(values, name),
            "trainjob": trainjob_from_values(values, name),
        }
    return {
        "configmap": _configmap(values, name),
        "pytorchjob": _pytorchjob(values, name),
    }


def job_key(objects: dict[str, Any]) -> str:
    """ "pytorchjob" or "trainjob": the key of the job among the rendered objects."""
    return "trainjob" if "trainjob" in objects else "pytorchjob"


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


def object_metadata(values: dict[str, Any], name: str) -> dict[str, Any]:
    """Labels (the user's and shardctl's) and the user's annotations, when any."""
    meta: dict[str, Any] = {"labels": labels(name, values["labels"])}
    if values["annotations"]:
        meta["annotations"] = dict(values["annotations"])
    return meta


def _pytorchjob(values: dict[str, Any], name: str) -> dict[str, Any]:
    nodes = values["nodes"]
    # Each replica gets its own copy of the pod template: one shared dict would
    # make a change to the Master's silently change the Workers'.
    replica_specs: dict[str, Any] = {
        "Master": {
            "replicas": 1,
            "restartPolicy": values["restartPolicy"],
            "template": _pod_template(values, name),
        }
    }
    if nodes > 1:
        replica_specs["Worker"] = {
            "replicas": nodes - 1,
            "restartPolicy": values["restartPolicy"],
            "template": _pod_template(values, name),
        }
    job_spec: dict[str, Any] = {
        "nprocPerNode": str(values["nprocPerNode"]),
        "pytorchReplicaSpecs": replica_specs,
        "runPolicy": dict(values["runPolicy"]),
    }
    if values.get("elastic"):
        # c10d: torchrun's own rendezvous on the master; no etcd to run.
        job_spec["elasticPolicy"] = {**values["elastic"], "rdzvBackend": "c10d"}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": values["namespace"],
            **object_metadata(values, name),
        },
        "spec": job_spec,
    }


def pod_volumes(values: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The pod's volumes: the spec ConfigMap, the run dir, writable scratch, the user's."""
    claim = values["storage"]["claimName"]
    runs_volume: dict[str, Any] = (
        {"name": "runs", "persistentVolumeClaim": {"claimName": claim}}
        if claim
        else {"name": "runs", "emptyDir": {}}
    )
    spec_volume: dict[str, Any] = {"name": configmap_name(name), "defaultMode": 0o444}
    if values["codeFiles"]:
        # ConfigMap keys cannot hold '/': code files are put at their paths by `items`,
        # which then must list every file the pod needs.
        spec_volume["items"] = [
            *({"key": k, "path": k} for k in sorted(values["launcherFiles"])),
            {"key": SPEC_FILE, "path": SPEC_FILE},
            {"key": LAUNCH_FILE, "path": LAUNCH_FILE},
            *({"key": f["key"], "path": f["path"]} for f in values["codeFiles"]),
        ]
    return copy.deepcopy(
        [
            {"name": "spec", "configMap": spec_volume},
            runs_volume,
            {"name": "cache", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": values["shmSize"]}},
            *(extra["volume"] for extra in values["extraVolumes"]),
        ]
    )


def volume_mounts(values: dict[str, Any]) -> list[dict[str, Any]]:
    return copy.deepcopy(
        [
            {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
            {"name": "runs", "mountPath": RUNS_MOUNT},
            {"name": "cache", "mountPath": CACHE_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *(extra["mount"] for extra in values["extraVolumes"]),
        ]
    )


def container_command() -> list[str]:
    """The launch script, started with the operator's node-level RANK/WORLD_SIZE removed."""
    unset: list[str] = []
    for var in OPERATOR_MISLEADING_ENV:
        unset += ["-u", var]
    return ["env", *unset, "bash", f"{SPEC_DIR}/{LAUNCH_FILE}"]


def container_env(values: dict[str, Any]) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in sorted(values["env"].items())]


def env_from(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"configMapRef": {"name": n}} for n in values["envFrom"]["configMaps"]] + [
        {"secretRef": {"name": n}} for n in values["envFrom"]["secrets"]
    ]


def container_security(values: dict[str, Any]) -> dict[str, Any]:
    security = values["securityContext"]
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "privileged": False,
        "readOnlyRootFilesystem": security["readOnlyRootFilesystem"],
        "runAsNonRoot": True,
        "runAsUser": security["runAsUser"],
    }


def pod_security(values: dict[str, Any]) -> dict[str, Any]:
    uid = values["securityContext"]["runAsUser"]
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        # fsGroup makes the PVC writable by the non-root user.
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_placement(values: dict[str, Any]) -> dict[str, Any]:
    """Where the pods may run and what they pull with: only the settings the spec gives."""
    values = copy.deepcopy(values)
    placed: dict[str, Any] = {}
    if values["nodeSelector"]:
        placed["nodeSelector"] = values["nodeSelector"]
    if values["tolerations"]:
        placed["tolerations"] = values["tolerations"]
    if values["affinity"]:
        placed["affinity"] = values["affinity"]
    if values["imagePullSecrets"]:
        placed["imagePullSecrets"] = [{"name": n} for n in values["imagePullSecrets"]]
    return placed


def _pod_template(values: dict[str, Any], name: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": values["image"],
        "imagePullPolicy": values["imagePullPolicy"],
        "command": container_command(),
        "workingDir": RUNS_MOUNT,
        "env": container_env(values),
        "ports": [{"name": PORT_NAME, "containerPort": values["masterPort"]}],
        "resources": copy.deepcopy(values["resources"]),
        "volumeMounts": volume_mounts(values),
        "securityContext": container_security(values),
    }
    if values["envFrom"]["configMaps"] or values["envFrom"]["secrets"]:
        container["envFrom"] = env_from(values)
    pod: dict[str, Any] = {
        # Training ranks never call the Kubernetes API: no token in the pod.
        "automountServiceAccountToken": False,
        "serviceAccountName": values["serviceAccount"]["name"],
        "terminationGracePeriodSeconds": values["terminationGracePeriodSeconds"],
        "securityContext": pod_security(values),
        "containers": [container],
        "volumes": pod_volumes(values, name),
        **pod_placement(values),
    }
    if values["schedulerName"]:
        pod["schedulerName"] = values["schedulerName"]
    if values.get("priorityClassName"):
        pod["priorityClassName"] = values["priorityClassName"]
    return {"metadata": object_metadata(values, name), "spec": pod}


# --------------------------------------------------------------------- public


@dataclass(frozen=True)
class K8sRender:
    """Everything rendered for Kubernetes from one spec, each part computed once."""

    node: NodeView
    common: dict[str, str]  # job.yaml, env.sh, launch.sh, launcher files (pod view)
    values: dict[str, Any]  # the Helm chart's values
    objects: dict[str, dict[str, Any]]  # {"configmap": ..., "pytorchjob"|"trainjob": ...}
    # TrainJob only: the runtime a cluster admin installs when the stock one does not fit.
    runtime: dict[str, Any] | None = None

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
        if self.runtime is not None:
            files["trainingruntime.yaml"] = RUNTIME_HEADER + dump(self.runtime)
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


def render_from(spec: JobSpec, node: NodeView, common: dict[str, str]) -> K8sRender:
    problems = spec.k8s.run_problems(spec)
    if problems:
        raise SpecError(problems)
    values = values_from(spec, node, common)
    runtime = None
    if spec.k8s.api == "trainjob":
        from .trainjob import runtime_object

        runtime = runtime_object(spec, values)
    rendered = K8sRender(node, common, values, objects_from_values(values), runtime)
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
    common = common_artifacts(node.spec, node.spec_path, "k8s", runtime_env(node.spec))
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


RUNTIME_HEADER = (
    "# A Kubeflow Trainer v2.3 training runtime for shardctl's TrainJobs, rendered from the\n"
    "# job spec. Jobs on the stock 'torch-distributed' runtime do not need it. Install it\n"
    "# once (a cluster admin: kubectl apply --server-side -f trainingruntime.yaml) when the\n"
    "# spec sets what only a runtime can carry (scheduler, priority class, envFrom, pull\n"
    "# policy, restarts of every pod), and give the jobs k8s.runtime: <its name>.\n"
)


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


# A k8s label value / object name: what `cut_name` must always produce.
DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
