"""The Kubeflow Trainer v2 side of a job: a `TrainJob` (trainer.kubeflow.org/v1alpha1,
the v2.3 API), the training runtime a cluster admin installs for it, its state table,
its pods, and `TRAINJOB`, the `JobKind` of `k8s.api: trainjob`.

A TrainJob names a runtime (`k8s.runtime`, default the stock `torch-distributed`)
and changes it in two ways only: `spec.trainer` (image, command, env, node and
process counts, resources of the container named `node`) and `runtimePatches`
(strategic-merge patches keyed by a manager; v2.3 lets them set the pods' labels,
annotations, volumes, mounts, security contexts, service account, grace period,
node selector, tolerations, affinity and pull secrets). Both are filled from the
same chart values as the PyTorchJob, so the pods look the same on either API.

What a patch cannot reach (schedulerName, priorityClassName, envFrom,
imagePullPolicy, the restart policy) lives in the runtime: `runtime_object`
renders one from the spec for an admin to install once (`k8s.runtime: <its name>`).

The torch plugin gives every pod PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK
(the Job's completion index), PET_MASTER_ADDR (`<job>-node-0-0.<job>`) and
PET_MASTER_PORT (29500); the launch script reads those, as it reads the PyTorchJob
operator's variables on the other API.

`trainjob_from_values` is mirrored by helm/shardctl-job/templates/trainjob.yaml;
tests/test_helm_chart.py compares their output. This module builds on the shared pod
parts (`pods.py`) and imports nothing of the PyTorchJob's.
"""

from __future__ import annotations

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
    labels,
    object_metadata,
    pod_placement,
    pod_security,
    pod_volumes,
    volume_mounts,
)

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainJob"
RUNTIME_PLURALS = {
    "ClusterTrainingRuntime": "clustertrainingruntimes",
    "TrainingRuntime": "trainingruntimes",
}
# The runtimes Kubeflow Trainer ships, and the framework each one runs.
STOCK_RUNTIMES = {"torch-distributed": "torch", "deepspeed-distributed": "mpi"}
DEFAULT_RUNTIME = "torch-distributed"
# The name `shardctl render` gives the runtime it writes when the spec names a stock one.
OWN_RUNTIME = "shardctl-torch"
# The replicated job and container the torch plugin fills in (stock runtime's names).
TRAINER_JOB = "node"
TRAINER_CONTAINER = "node"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
PATCH_MANAGER = "shardctl.dev/cli"
TORCH_MASTER_PORT = 29500
# The pods' exit codes carry shardctl's decision (`node_agent.PodAdapter`):
# 1-127 stop, as under a PyTorchJob's ExitCode policy. A pod that exits with one fails
# its Job by the pod failure policy (reason `PodFailurePolicy`), and the JobSet rule
# below fails the whole JobSet for it; any other failure restarts it (`maxRestarts`).
PERMANENT_EXIT_CODES = list(range(1, 128))
PERMANENT_RULE = "ShardctlStop"
POD_FAILURE_POLICY_REASON = "PodFailurePolicy"  # the Job condition's reason for FailJob

INSTALL_HINT = (
    "install Kubeflow Trainer v2.3 with its stock runtimes: `helm install kubeflow-trainer "
    "oci://ghcr.io/kubeflow/charts/kubeflow-trainer --namespace kubeflow-system "
    "--create-namespace --version 2.3.0 --set runtimes.defaultEnabled=true` "
    "(docs/guides/kubernetes.md, 1. Install the operator)"
)


def runtime_name(spec: JobSpec) -> str:
    return spec.k8s.runtime or DEFAULT_RUNTIME


def is_stock(spec: JobSpec) -> bool:
    return runtime_name(spec) in STOCK_RUNTIMES


def admin_runtime_name(spec: JobSpec) -> str:
    """The runtime `shardctl render` writes: the spec's own, or shardctl-torch."""
    return OWN_RUNTIME if is_stock(spec) else runtime_name(spec)


# What only a runtime can carry: field → why a TrainJob cannot. A spec that sets one
# of these on a stock runtime is refused (the setting would silently not apply).
RUNTIME_ONLY = {
    "scheduler_name": "schedulerName",
    "priority_class": "priorityClassName",
    "env_from_config_maps": "envFrom",
    "env_from_secrets": "envFrom",
    "image_pull_policy": "imagePullPolicy",
    "backoff_limit": "the JobSet failure policy (restarts of every pod)",
}


def trainjob_problems(spec: JobSpec) -> list[str]:
    """Why this spec cannot run as a TrainJob on its runtime, if it cannot."""
    k, problems = spec.k8s, []
    name = runtime_name(spec)
    if STOCK_RUNTIMES.get(name) == "mpi":
        problems.append(
            f"k8s.runtime {name!r}: the stock DeepSpeed runtime of Trainer v2.3 runs the command "
            "in one launcher pod under mpirun and keeps its own image on the node pods, where "
            "shardctl is not installed; DeepSpeed jobs run on 'torch-distributed' (the "
            "default): every node starts its own ranks, as on a PyTorchJob"
        )
    if name in STOCK_RUNTIMES:
        for field, what in RUNTIME_ONLY.items():
            if k.is_set(field):
                problems.append(
                    f"k8s.{field}: a TrainJob cannot set {what} on the stock runtime {name!r} "
                    "(Trainer v2.3's runtimePatches do not reach it); set k8s.runtime to a "
                    f"runtime of your own, e.g. {OWN_RUNTIME!r} — `shardctl render SPEC "
                    "--cluster k8s` then writes trainingruntime.yaml with it, for a cluster "
                    "admin to install once"
                )
    if not spec.name[0].isalpha():
        problems.append(
            f"name {spec.name!r}: a TrainJob's name must start with a letter (RFC 1035)"
        )
    # JobSet names each pod <job>-node-0-<index>-<5 random>: at most 63 characters.
    longest = len(f"{spec.name}-{TRAINER_JOB}-0-{spec.resources.nodes - 1}-xxxxx")
    if longest > 63:
        problems.append(
            f"name {spec.name!r} is too long for a TrainJob of {spec.resources.nodes} nodes: "
            f"its pods would be named {longest} characters long, more than Kubernetes' 63; "
            f"accepted: at most {len(spec.name) - (longest - 63)} characters"
        )
    return problems


def trainjob_values(spec: JobSpec) -> dict[str, Any]:
    """The chart values only a TrainJob reads."""
    return {
        "runtimeRef": {
            "apiGroup": GROUP,
            "kind": spec.k8s.runtime_kind,
            "name": runtime_name(spec),
        },
    }


# -------------------------------------------------------------------- layout


def trainjob_from_values(values: dict[str, Any], name: str) -> dict[str, Any]:
    """The TrainJob: the trainer's container through `trainer`, the pods through one
    runtime patch (managed by shardctl)."""
    pod_meta = object_metadata(values, name)
    pod_spec: dict[str, Any] = {
        "serviceAccountName": values["serviceAccount"]["name"],
        "terminationGracePeriodSeconds": values["terminationGracePeriodSeconds"],
        "securityContext": pod_security(values),
        "volumes": pod_volumes(values, name),
        "containers": [
            {
                "name": TRAINER_CONTAINER,
                "volumeMounts": volume_mounts(values),
                "securityContext": container_security(values),
            }
        ],
        **pod_placement(values),
    }
    patch = {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "metadata": object_metadata(values, name),
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": TRAINER_JOB,
                            "template": {
                                "metadata": object_metadata(values, name),
                                "spec": {"template": {"metadata": pod_meta, "spec": pod_spec}},
                            },
                        }
                    ]
                },
            }
        },
    }
    job_spec: dict[str, Any] = {
        "runtimeRef": dict(values["runtimeRef"]),
        "suspend": values["runPolicy"]["suspend"],
        "trainer": {
            "image": values["image"],
            "command": container_command(),
            "env": container_env(values),
            "numNodes": values["nodes"],
            "numProcPerNode": values["nprocPerNode"],
            "resourcesPerNode": {k: dict(v) for k, v in values["resources"].items()},
        },
        "runtimePatches": [patch],
    }
    if values["runPolicy"].get("activeDeadlineSeconds") is not None:
        job_spec["activeDeadlineSeconds"] = values["runPolicy"]["activeDeadlineSeconds"]
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


def runtime_object(spec: JobSpec, values: dict[str, Any]) -> dict[str, Any]:
    """The training runtime an admin installs when the stock one does not fit.

    Job-independent (one runtime serves many jobs): the torch policy, the trainer's
    replicated job and container, what runtimePatches cannot set, and the restart rule.
    Restarts: a failed or preempted pod fails its Job at once (backoffLimit 0,
    restartPolicy Never), and the JobSet then recreates every pod, up to
    `k8s.backoff_limit` times; the ranks resume from the newest complete checkpoint on
    the volume. (In-place container restarts would restart one node's ranks while the
    others still wait in a collective.) A pod that exits 1-127 (shardctl's stop: exit
    78, or a crash past its restarts) fails its Job by the pod failure policy, and the
    JobSet's rule for that reason fails the job without a restart.
    """
    k = spec.k8s
    container: dict[str, Any] = {
        "name": TRAINER_CONTAINER,
        "image": values["image"],
        "imagePullPolicy": values["imagePullPolicy"],
        "workingDir": RUNS_MOUNT,
    }
    if values["envFrom"]["configMaps"] or values["envFrom"]["secrets"]:
        container["envFrom"] = env_from(values)
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        # Training ranks never call the Kubernetes API: no token in the pod.
        "automountServiceAccountToken": False,
        "containers": [container],
    }
    if values["schedulerName"]:
        pod["schedulerName"] = values["schedulerName"]
    if values["priorityClassName"]:
        pod["priorityClassName"] = values["priorityClassName"]
    name = admin_runtime_name(spec)
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {
            "trainer.kubeflow.org/framework": "torch",
            **{key: v for key, v in labels(name).items() if key != "app.kubernetes.io/instance"},
        },
    }
    if k.runtime_kind == "TrainingRuntime":
        metadata["namespace"] = k.namespace
    return {
        "apiVersion": API_VERSION,
        "kind": k.runtime_kind,
        "metadata": metadata,
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {
                "spec": {
                    "failurePolicy": {
                        "maxRestarts": k.backoff_limit,
                        "restartStrategy": "Recreate",
                        "rules": [
                            {
                                "name": PERMANENT_RULE,
                                "action": "FailJobSet",
                                "onJobFailureReasons": [POD_FAILURE_POLICY_REASON],
                                "targetReplicatedJobs": [TRAINER_JOB],
                            }
                        ],
                    },
                    "replicatedJobs": [
                        {
                            "name": TRAINER_JOB,
                            "template": {
                                "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                                "spec": {
                                    "backoffLimit": 0,
                                    "podFailurePolicy": pod_failure_policy(),
                                    # What a pod failure policy requires.
                                    "podReplacementPolicy": "Failed",
                                    "template": {"spec": pod},
                                },
                            },
                        }
                    ],
                }
            },
        },
    }


def pod_failure_policy() -> dict[str, Any]:
    """A pod that exits with a permanent code fails its Job (reason `PodFailurePolicy`)."""
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": TRAINER_CONTAINER,
                    "operator": "In",
                    "values": list(PERMANENT_EXIT_CODES),
                },
            }
        ]
    }


# -------------------------------------------------------------------- status
# TrainJob conditions (v2.3 sets Suspended, Complete, Failed; controllers before v2.2
# also Created and Running) and, while none of them holds, the state of its JobSet's
# jobs, which the controller copies into status.jobsStatus → shardctl's states.
# `trainjob_native_state` decides the native name; this table is the only mapping.
TRAINJOB_STATES: dict[str, JobState] = {
    "Pending": JobState.PENDING,  # no status yet: the controller has not built the JobSet
    "Created": JobState.PENDING,  # the JobSet exists, no job has started a pod
    "Starting": JobState.PENDING,  # pods are being scheduled or pulled
    "Suspended": JobState.PENDING,  # spec.suspend (e.g. Kueue holds it in its queue)
    "Running": JobState.RUNNING,  # every pod of the trainer's job is ready
    # A job of the JobSet failed (a pod preempted, deleted or crashed) and the
    # JobSet's failure policy recreates its pods; they resume from the checkpoint.
    "Restarting": JobState.PREEMPTED,
    "Complete": JobState.SUCCEEDED,
    "Failed": JobState.FAILED,
}
TERMINAL_CONDITIONS = ("Complete", "Failed")


def trainjob_native_state(job: dict[str, Any]) -> tuple[str, str]:
    """(native state, message) of a TrainJob: its conditions first, then its JobSet's jobs."""
    status = job.get("status") or {}
    held = [c for c in status.get("conditions") or [] if str(c.get("status")) == "True"]
    for cond in held:
        if cond.get("type") in TERMINAL_CONDITIONS:
            reason = cond.get("reason") or ""
            message = cond.get("message") or ""
            return str(cond["type"]), f"{reason}: {message}" if reason and message else message
    if any(c.get("type") == "Suspended" for c in held):
        return "Suspended", "spec.suspend is true (resume it, or its queue admits it)"
    legacy = [c for c in held if c.get("type") in ("Created", "Running")]
    if legacy:
        return str(legacy[-1]["type"]), legacy[-1].get("message") or ""
    jobs = status.get("jobsStatus")
    if not jobs:
        return "Pending", ""

    def total(key: str) -> int:
        return sum(int(j.get(key) or 0) for j in jobs)

    if total("failed"):
        return "Restarting", f"{total('failed')} job(s) of the JobSet failed; restarting"
    if total("ready"):
        return "Running", ""
    if total("active"):
        return "Starting", ""
    return "Created", ""


# ---------------------------------------------------------------- the client


def runtime_missing(spec: JobSpec) -> str:
    """The job's runtime does not exist: which, where, and how to get it."""
    kind, name = spec.k8s.runtime_kind, runtime_name(spec)
    where = (
        "in the cluster"
        if kind == "ClusterTrainingRuntime"
        else (f"in namespace {spec.k8s.namespace!r}")
    )
    if name in STOCK_RUNTIMES:
        how = INSTALL_HINT
    else:
        how = (
            "have a cluster admin install it: `shardctl render SPEC --cluster k8s --out DIR` "
            "writes DIR/trainingruntime.yaml, then `kubectl apply --server-side -f "
            "DIR/trainingruntime.yaml`"
        )
    return f"the {kind} {name!r} (k8s.runtime) does not exist {where}; {how}"


def runtime_rejection(spec: JobSpec) -> Callable[[str], str | None]:
    """Trainer's admission webhook refuses a TrainJob whose runtime is missing."""

    def better(reason: str) -> str | None:
        if "must be created before the TrainJob" in reason:
            return f"{runtime_missing(spec)}. Server said: {reason}"
        return None

    return better


# ---------------------------------------------------------------------- kind

RUNTIME_FILE = "trainingruntime.yaml"
RUNTIME_HEADER = (
    "# A Kubeflow Trainer v2.3 training runtime for shardctl's TrainJobs, rendered from the\n"
    "# job spec. Jobs on the stock 'torch-distributed' runtime do not need it. Install it\n"
    "# once (a cluster admin: kubectl apply --server-side -f trainingruntime.yaml) when the\n"
    "# spec sets what only a runtime can carry (scheduler, priority class, envFrom, pull\n"
    "# policy, restarts of every pod), and give the jobs k8s.runtime: <its name>.\n"
)

# Labels JobSet puts on every pod of a TrainJob (the JobSet is named like the TrainJob).
LABEL_JOBSET = "jobset.sigs.k8s.io/jobset-name"
LABEL_RJOB = "jobset.sigs.k8s.io/replicatedjob-name"
LABEL_INDEX = "batch.kubernetes.io/job-completion-index"  # the node rank


def _completion_index(pod: dict[str, Any], default: str | None) -> str | None:
    """A pod's completion index: its label, else its annotation (older Job controllers)."""
    meta = pod["metadata"]
    return (meta.get("labels") or {}).get(LABEL_INDEX) or (meta.get("annotations") or {}).get(
        LABEL_INDEX, default
    )


class TrainJobKind:
    """`k8s.api: trainjob` (the `JobKind` protocol)."""

    api = "trainjob"
    kind = KIND
    group, version, plural = GROUP, VERSION, PLURAL
    container = TRAINER_CONTAINER
    pod_label = LABEL_JOBSET
    install_hint = INSTALL_HINT
    env_source = "set by the torch plugin of Kubeflow Trainer in TrainJob pods"
    master_env = ("PET_MASTER_ADDR", "PET_MASTER_PORT")

    def values(self, spec: JobSpec) -> dict[str, Any]:
        return trainjob_values(spec)

    def job_object(self, values: dict[str, Any], name: str) -> dict[str, Any]:
        return trainjob_from_values(values, name)

    def admin_runtime(self, spec: JobSpec, values: dict[str, Any]) -> AdminRuntime | None:
        return AdminRuntime(RUNTIME_FILE, RUNTIME_HEADER, runtime_object(spec, values))

    def problems(self, spec: JobSpec) -> list[str]:
        return trainjob_problems(spec)

    def next_step(self, spec: JobSpec) -> str:
        runtime = (
            "its runtime is Trainer's stock one"
            if is_stock(spec)
            else "a cluster admin installs its runtime once: kubectl apply --server-side -f "
            f"{{out}}/{RUNTIME_FILE}"
        )
        return (
            "apply it: kubectl apply -f {out}/configmap.yaml -f {out}/trainjob.yaml\n"
            "       or: helm install {name} {chart} -f {out}/values.yaml\n"
            f"       ({runtime})"
        )

    def state_of(self, job: dict[str, Any]) -> JobStatus:
        native, message = trainjob_native_state(job)
        state = TRAINJOB_STATES.get(native, JobState.UNKNOWN)
        return JobStatus(state=state, native_state=native, detail=message)

    def prerequisite(self, spec: JobSpec) -> Prerequisite | None:
        """The runtime the TrainJob names."""
        kind = spec.k8s.runtime_kind
        return Prerequisite(
            what="runtime",
            group=GROUP,
            version=VERSION,
            kind=kind,
            plural=RUNTIME_PLURALS[kind],
            name=runtime_name(spec),
            namespaced=kind != "ClusterTrainingRuntime",
            missing=runtime_missing(spec),
        )

    def rejection(self, spec: JobSpec) -> Callable[[str], str | None] | None:
        return runtime_rejection(spec)

    def pod_order(self, pod: dict[str, Any]) -> tuple[int, int, str]:
        index = _completion_index(pod, "")
        return (0, int(index) if str(index).isdigit() else 0, pod["metadata"]["name"])

    def role(self, pod: dict[str, Any]) -> str:
        pod_labels = pod["metadata"].get("labels") or {}
        return f"{pod_labels.get(LABEL_RJOB, '?')} {_completion_index(pod, '?')}"

    def node(self, pod: dict[str, Any]) -> int | None:
        """The completion index."""
        raw = _completion_index(pod, None)
        return int(raw) if str(raw).isdigit() else None

    def procs_per_node(self, job: dict[str, Any]) -> int | None:
        return positive_int(((job.get("spec") or {}).get("trainer") or {}).get("numProcPerNode"))


TRAINJOB = TrainJobKind()
