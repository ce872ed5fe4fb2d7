"""The pod parts both job kinds share: the layout inside every pod, names, labels,
and the pieces of a pod template laid out from chart values.

Layout inside every pod (the paths are part of the interface, see docs/guides/kubernetes.md):

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
to one of those mounts.

`pytorchjob.py` and `trainjob.py` build their objects from these parts; this module
imports neither. The Helm chart's `_pod.tpl` mirrors them (tests/test_helm_chart.py).
"""

from __future__ import annotations

import copy
import re
from typing import Any

SPEC_DIR = "/etc/shardctl"
CODE_DIR = f"{SPEC_DIR}/code"  # an entrypoint's code, when it travels in the ConfigMap
SPEC_FILE = "job.yaml"
LAUNCH_FILE = "launch.sh"
RUNS_MOUNT = "/shardctl/runs"
CACHE_MOUNT = "/shardctl/cache"
# Kubernetes object names and label values are at most 63 characters (DNS-1123 label).
NAME_LIMIT = 63

# The operator injects RANK (the *node* rank) and WORLD_SIZE (the node count)
# into every pod of a PyTorchJob. torchrun sets both per process for its
# children, but nothing before it may take them for the rank's own: the
# container starts the launch script with both removed, and the script reads
# the PET_* variables the operator provides for torchrun.
OPERATOR_MISLEADING_ENV = ("RANK", "WORLD_SIZE")

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


# A k8s label value / object name: what `cut_name` must always produce.
DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def object_metadata(values: dict[str, Any], name: str) -> dict[str, Any]:
    """Labels (the user's and shardctl's) and the user's annotations, when any."""
    meta: dict[str, Any] = {"labels": labels(name, values["labels"])}
    if values["annotations"]:
        meta["annotations"] = dict(values["annotations"])
    return meta


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
