"""The Kubeflow training operator's `PyTorchJob` (kubeflow.org/v1): its object, its
state table, its pods, and `PYTORCHJOB`, the `JobKind` of `k8s.api: pytorchjob`.

A Master replica (node 0) and `nodes - 1` Workers, each pod from the shared pod
parts (`pods.py`); the operator injects PET_NNODES, PET_NODE_RANK,
PET_NPROC_PER_NODE, MASTER_ADDR and MASTER_PORT, which the launch script reads. A
pod that is deleted or preempted restarts with the same PVC and resumes from the
newest complete checkpoint there. Under `restartPolicy: ExitCode` (the default) the
operator restarts a pod that exits 128-255 and fails the job on 1-127: each pod's
node agent exits with shardctl's decision (`node_agent.PodAdapter`), so exit 78
stops. The operator counts no `backoffLimit` under ExitCode; the pods count their
restarts on the PVC, or in the checkpoints' bucket (`objects.pod_restart_bound`).

`pytorchjob_from_values` is mirrored by helm/shardctl-job/templates/pytorchjob.yaml
(and `_pod.tpl`); tests/test_helm_chart.py compares their output.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ...spec import JobSpec
from ..base import JobState, JobStatus
from .jobkind import AdminRuntime, Prerequisite, positive_int
from .pods import (
    RUNS_MOUNT,
    container_command,
    container_env,
    container_security,
    env_from,
    object_metadata,
    pod_placement,
    pod_security,
    pod_volumes,
    volume_mounts,
)

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
CONTAINER = "pytorch"  # the operator finds the training container by this name
PORT_NAME = "pytorchjob-port"  # the operator reads MASTER_PORT from the port of this name

OPERATOR_HINT = (
    "install the Kubeflow training operator, which serves PyTorchJob "
    f"({GROUP}/{VERSION}): see docs/guides/kubernetes.md"
)

NEXT_STEP = (
    "apply it: kubectl apply -f {out}/configmap.yaml -f {out}/pytorchjob.yaml\n"
    "       or: helm install {name} {chart} -f {out}/values.yaml"
)

# Labels the training operator puts on every pod of a job.
LABEL_JOB = "training.kubeflow.org/job-name"
LABEL_REPLICA_TYPE = "training.kubeflow.org/replica-type"
LABEL_REPLICA_INDEX = "training.kubeflow.org/replica-index"


# -------------------------------------------------------------------- layout


def pytorchjob_from_values(values: dict[str, Any], name: str) -> dict[str, Any]:
    """A Master and `nodes - 1` Workers, each with its own copy of the pod template."""
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


# -------------------------------------------------------------------- status
# The PyTorchJob condition that is currently true → our state. Anything else
# (a future operator's new condition) is UNKNOWN rather than a guess.
CONDITION_STATES: dict[str, JobState] = {
    "Pending": JobState.PENDING,  # no condition yet: the operator has not picked it up
    "Created": JobState.PENDING,  # pods created, not all running
    "Suspended": JobState.PENDING,  # runPolicy.suspend: waits to be resumed
    "Running": JobState.RUNNING,
    # A pod failed or was preempted and is restarting; the loop resumes from the
    # newest complete checkpoint on the PVC.
    "Restarting": JobState.PREEMPTED,
    "Succeeded": JobState.SUCCEEDED,
    "Failed": JobState.FAILED,
}
TERMINAL_CONDITIONS = ("Succeeded", "Failed")


def current_condition(job: dict[str, Any]) -> tuple[str, str]:
    """(type, message) of the condition that holds now; ("Pending", "") without any.

    The operator keeps the history of conditions; those with status "True" hold.
    A terminal one wins, otherwise the last true one (the newest transition).
    """
    conditions = (job.get("status") or {}).get("conditions") or []
    held = [c for c in conditions if str(c.get("status")) == "True"]
    for cond in held:
        if cond.get("type") in TERMINAL_CONDITIONS:
            return cond["type"], cond.get("message", "")
    if held:
        return str(held[-1].get("type")), held[-1].get("message", "")
    return "Pending", ""


# ---------------------------------------------------------------------- kind


class PyTorchJobKind:
    """`k8s.api: pytorchjob` (the `JobKind` protocol)."""

    api = "pytorchjob"
    kind = KIND
    group, version, plural = GROUP, VERSION, PLURAL
    container = CONTAINER
    pod_label = LABEL_JOB
    install_hint = OPERATOR_HINT
    env_source = "set by the Kubeflow training operator in PyTorchJob pods"
    master_env = ("MASTER_ADDR", "MASTER_PORT")

    def values(self, spec: JobSpec) -> dict[str, Any]:
        return {"runtimeRef": None}

    def job_object(self, values: dict[str, Any], name: str) -> dict[str, Any]:
        return pytorchjob_from_values(values, name)

    def admin_runtime(self, spec: JobSpec, values: dict[str, Any]) -> AdminRuntime | None:
        return None  # the operator needs nothing beside the job

    def problems(self, spec: JobSpec) -> list[str]:
        return []

    def next_step(self, spec: JobSpec) -> str:
        return NEXT_STEP

    def state_of(self, job: dict[str, Any]) -> JobStatus:
        native, message = current_condition(job)
        state = CONDITION_STATES.get(native, JobState.UNKNOWN)
        return JobStatus(state=state, native_state=native, detail=message or "")

    def prerequisite(self, spec: JobSpec) -> Prerequisite | None:
        return None

    def rejection(self, spec: JobSpec) -> Callable[[str], str | None] | None:
        return None

    def pod_order(self, pod: dict[str, Any]) -> tuple[int, int, str]:
        meta = pod["metadata"]
        pod_labels = meta.get("labels") or {}
        index = pod_labels.get(LABEL_REPLICA_INDEX, "")
        first = 0 if pod_labels.get(LABEL_REPLICA_TYPE, "").lower() == "master" else 1
        return (first, int(index) if str(index).isdigit() else 0, meta["name"])

    def role(self, pod: dict[str, Any]) -> str:
        pod_labels = pod["metadata"].get("labels") or {}
        return (
            f"{pod_labels.get(LABEL_REPLICA_TYPE, '?')} {pod_labels.get(LABEL_REPLICA_INDEX, '?')}"
        )

    def node(self, pod: dict[str, Any]) -> int | None:
        """Master 0, worker i → i + 1."""
        first, index, _ = self.pod_order(pod)
        pod_labels = pod["metadata"].get("labels") or {}
        if not str(pod_labels.get(LABEL_REPLICA_INDEX, "")).isdigit():
            return None
        return index + first

    def procs_per_node(self, job: dict[str, Any]) -> int | None:
        return positive_int((job.get("spec") or {}).get("nprocPerNode"))


PYTORCHJOB = PyTorchJobKind()
