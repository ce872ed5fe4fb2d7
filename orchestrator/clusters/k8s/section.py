"""`k8s:` the section of `--cluster k8s`: the pods, the job object, its volumes."""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ...s3.url import is_s3_url  # torch- and boto3-free
from ...sizes import MemorySize
from ...spec.common import (
    CONTROL_RE,
    MAX_SECONDS,
    NAME_RE,
    ClusterSection,
    Nodes,
    PositiveSeconds,
    Retries,
    Seconds,
    Section,
    path_text,
    shell_lines,
    show,
)  # fmt: skip

# A pod's CPU: cores (`8`, `0.5`) or whole millicores (`1500m`).
K8S_CPU_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?|[0-9]+(?=m$))(m)?$")
MAX_POD_CPUS = 4096  # k8s.cpu per pod, in cores
MAX_UID = 2**31 - 1  # the largest uid Kubernetes' runAsUser and every Linux tool agree on


class Toleration(Section):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: Seconds | None = Field(default=None, alias="tolerationSeconds")
    """Seconds a NoExecute taint is tolerated; 0 to 31622400 (a year)."""


class Elastic(Section):
    min_nodes: Nodes
    """1 to 100000, at most `max_nodes`."""
    max_nodes: Nodes
    """1 to 100000."""
    max_restarts: Retries = 3
    """0 to 1000."""

    @model_validator(mode="after")
    def _order(self) -> Elastic:
        if self.min_nodes > self.max_nodes:
            raise ValueError(
                f"k8s.elastic.min_nodes ({self.min_nodes}) > max_nodes ({self.max_nodes})"
            )
        return self


# Kubernetes names and keys, as the API server checks them.
DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
QUALIFIED_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
# An extended resource: `domain/name` (nvidia.com/gpu, amd.com/gpu, nvidia.com/mig-1g.10gb).
EXTENDED_RESOURCE_RE = re.compile(
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
# Where shardctl mounts its own volumes in every pod (see clusters/k8s/pods.py).
K8S_OWN_MOUNTS = ("/etc/shardctl", "/shardctl/runs", "/shardctl/cache", "/tmp", "/dev/shm")
K8S_OWN_VOLUMES = ("spec", "runs", "cache", "tmp", "dshm")
MIN_GRACE_S = 30  # Kubernetes' own default; a sharded save needs more, never less


def _qualified_key(key: str, what: str) -> None:
    """A label or annotation key: `[prefix/]name`, prefix a DNS subdomain, name ≤ 63."""
    prefix, slash, name = key.rpartition("/")
    if (
        (slash and (len(prefix) > 253 or not DNS_SUBDOMAIN_RE.match(prefix)))
        or len(name) > 63
        or not QUALIFIED_NAME_RE.match(name)
    ):
        raise ValueError(
            f"{show(key)} is not a Kubernetes {what} key; accepted: an optional DNS prefix "
            "and '/', then 1-63 letters, digits, '-', '_' or '.', starting and ending "
            "alphanumeric (e.g. 'kueue.x-k8s.io/queue-name')"
        )


class LabelSelectorRequirement(Section):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)


class LabelSelector(Section):
    match_labels: dict[str, str] = Field(default_factory=dict, alias="matchLabels")
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, alias="matchExpressions"
    )


class NodeSelectorRequirement(Section):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[str] = Field(default_factory=list)


class NodeSelectorTerm(Section):
    match_expressions: list[NodeSelectorRequirement] = Field(
        default_factory=list, alias="matchExpressions"
    )
    match_fields: list[NodeSelectorRequirement] = Field(default_factory=list, alias="matchFields")


class NodeSelector(Section):
    node_selector_terms: list[NodeSelectorTerm] = Field(alias="nodeSelectorTerms", min_length=1)


Weight = Annotated[int, Field(ge=1, le=100, strict=True)]


class PreferredNodeTerm(Section):
    weight: Weight
    """1 to 100."""
    preference: NodeSelectorTerm


class NodeAffinity(Section):
    required: NodeSelector | None = Field(
        default=None, alias="requiredDuringSchedulingIgnoredDuringExecution"
    )
    preferred: list[PreferredNodeTerm] = Field(
        default_factory=list, alias="preferredDuringSchedulingIgnoredDuringExecution"
    )


class PodAffinityTerm(Section):
    topology_key: str = Field(alias="topologyKey", min_length=1)
    label_selector: LabelSelector | None = Field(default=None, alias="labelSelector")
    namespace_selector: LabelSelector | None = Field(default=None, alias="namespaceSelector")
    namespaces: list[str] = Field(default_factory=list)
    match_label_keys: list[str] = Field(default_factory=list, alias="matchLabelKeys")
    mismatch_label_keys: list[str] = Field(default_factory=list, alias="mismatchLabelKeys")


class WeightedPodAffinityTerm(Section):
    weight: Weight
    """1 to 100."""
    pod_affinity_term: PodAffinityTerm = Field(alias="podAffinityTerm")


class PodAffinity(Section):
    required: list[PodAffinityTerm] = Field(
        default_factory=list, alias="requiredDuringSchedulingIgnoredDuringExecution"
    )
    preferred: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, alias="preferredDuringSchedulingIgnoredDuringExecution"
    )


class Affinity(Section):
    """A pod's affinity, in Kubernetes' own words (paste it from a pod spec)."""

    node_affinity: NodeAffinity | None = Field(default=None, alias="nodeAffinity")
    pod_affinity: PodAffinity | None = Field(default=None, alias="podAffinity")
    pod_anti_affinity: PodAffinity | None = Field(default=None, alias="podAntiAffinity")

    def k8s(self) -> dict[str, Any]:
        """The object as the API server takes it: camelCase, nothing empty."""
        return _drop_empty(self.model_dump(mode="json", by_alias=True))


def _drop_empty(value: Any) -> Any:
    if isinstance(value, dict):
        kept = {k: _drop_empty(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, [], {})}
    if isinstance(value, list):
        return [_drop_empty(v) for v in value]
    return value


class ExtraVolume(Section):
    """One more volume in every pod, mounted at `mount_path`: exactly one source of
    `pvc`, `config_map`, `secret`, `host_path`, `nfs` or `empty_dir`."""

    name: str
    mount_path: str
    read_only: bool = False
    sub_path: str | None = None
    pvc: str | None = None
    """A PersistentVolumeClaim to mount; each volume has exactly one source (`pvc`,
    `config_map`, `secret`, `host_path`, `nfs` or `empty_dir`)."""
    config_map: str | None = None
    secret: str | None = None
    host_path: str | None = None
    nfs: str | None = None
    """`server:/export/path`."""
    empty_dir: bool = False

    SOURCES: ClassVar[tuple[str, ...]] = (
        "pvc", "config_map", "secret", "host_path", "nfs", "empty_dir",
    )  # fmt: skip

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if len(v) > 63 or not NAME_RE.match(v):
            raise ValueError(
                f"{show(v)} is not a volume name; accepted: 1-63 lower-case letters, digits "
                "and '-', starting and ending alphanumeric"
            )
        if v in K8S_OWN_VOLUMES:
            raise ValueError(
                f"{show(v)} is a volume shardctl mounts itself; accepted: any other name "
                f"(taken: {', '.join(K8S_OWN_VOLUMES)})"
            )
        return v

    @field_validator("mount_path", "host_path")
    @classmethod
    def _abs_path(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path_text(v)
        if not v.startswith("/") or ":" in v:
            raise ValueError(f"{show(v)} is not an absolute path without ':'")
        return v

    @field_validator("mount_path")
    @classmethod
    def _not_ours(cls, v: str) -> str:
        norm = posixpath.normpath(v)
        for own in K8S_OWN_MOUNTS:
            if norm == own or norm.startswith(own + "/") or own.startswith(norm + "/"):
                raise ValueError(
                    f"{show(v)} overlaps {own}, where shardctl mounts its own volume; "
                    "accepted: any other absolute path"
                )
        if norm == "/":
            raise ValueError(f"{show(v)} would hide the image's root file system")
        return norm

    @field_validator("pvc", "config_map", "secret")
    @classmethod
    def _object_name(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 253 or not DNS_SUBDOMAIN_RE.match(v)):
            raise ValueError(
                f"{show(v)} is not a Kubernetes name; accepted: lower-case letters, "
                "digits, '-' and '.', starting and ending alphanumeric"
            )
        return v

    @field_validator("nfs")
    @classmethod
    def _nfs(cls, v: str | None) -> str | None:
        if v is not None:
            server, sep, path = v.partition(":")
            if not sep or not server or not path.startswith("/") or re.search(r"\s", v):
                raise ValueError(f"{show(v)} is not an NFS export; accepted: 'server:/export/path'")
        return v

    @field_validator("sub_path")
    @classmethod
    def _sub_path(cls, v: str | None) -> str | None:
        if v is not None:
            path_text(v)
            if v.startswith("/") or ".." in v.split("/"):
                raise ValueError(
                    f"{show(v)} is not a relative path inside the volume (no leading '/', no '..')"
                )
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ExtraVolume:
        given = [s for s in self.SOURCES if getattr(self, s) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"volume {self.name!r} names {len(given)} sources "
                f"({', '.join(given) or 'none'}); accepted: exactly one of "
                f"{', '.join(self.SOURCES)}"
            )
        return self

    @property
    def source(self) -> str:
        return next(s for s in self.SOURCES if getattr(self, s) not in (None, False))


class K8sSection(ClusterSection):
    """Settings for `--cluster k8s`: a Kubeflow PyTorchJob or a Kubeflow Trainer v2 TrainJob."""

    # The pods read the corpus, pretrained model, resume checkpoint and TensorBoard
    # folder inside the pod: a relative one is taken from the pod's working directory
    # (the run volume's mount), not from the spec file's folder on this machine.
    reads_local_paths: ClassVar[bool] = False

    api: Literal["pytorchjob", "trainjob"] = "pytorchjob"
    """`pytorchjob`: the training operator v1 (kubeflow.org/v1). `trainjob`: Kubeflow
    Trainer v2 (trainer.kubeflow.org/v1alpha1, v2.3 API) against `runtime`."""
    runtime: str | None = None
    """TrainJob only: the training runtime it references; default `torch-distributed`
    (`deepspeed-distributed` for the `deepspeed` launcher). A name other than the stock
    ones is a runtime your admin installed, e.g. the one `shardctl render` writes."""
    runtime_kind: Literal["ClusterTrainingRuntime", "TrainingRuntime"] = "ClusterTrainingRuntime"
    """TrainJob only: a cluster-wide runtime or one in the job's namespace."""
    namespace: str = "default"
    """The namespace of the job, its ConfigMap and pods."""
    code: Literal["configmap", "image"] | None = None
    """How an entrypoint's code reaches the pods: `configmap` (the script, or
    `entrypoint.code_dir`, travels with the job's ConfigMap, up to 1 MiB in all) or
    `image` (it is in the image already; give its path there). Default: configmap for
    a script, image for a module."""
    image: str | None = None
    """An image with torch and shardctl (build one with the project's Containerfile),
    or one with torch plus `setup` lines that install shardctl. Required for
    `--cluster k8s`: no default image has both."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines every pod runs before the launcher (e.g. `pip install --user ...`)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """The pods' `imagePullPolicy`."""
    image_pull_secrets: list[str] = Field(default_factory=list)
    """Names of Secrets for pulling `image`."""
    service_account: str = "shardctl-trainer"
    """The pods' service account (`manifests/serviceaccount.yaml` creates the default)."""
    pvc: str | None = None
    """PersistentVolumeClaim mounted at the run directory, so restarted pods resume;
    required for more than one node (ReadWriteMany) unless `checkpoint.dir` is
    `s3://`: then each pod's run dir is its own emptyDir (docs/guides/kubernetes.md)."""
    cpu: str | None = None
    """CPU request/limit per pod: cores (`8`, `0.5`) or millicores (`1500m`), more than 0
    and at most 4096 cores; default procs_per_node × cpus_per_proc."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """As in a pod spec."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """As in a pod spec."""
    priority_class: str | None = None
    """The pods' `priorityClassName`."""
    restart_policy: Literal["OnFailure", "ExitCode", "Never", "Always"] = "ExitCode"
    """The PyTorchJob's replica restart policy. Under `ExitCode` (the default) the
    operator restarts a pod that exits 128-255 and fails the job on 1-127, and each
    pod's node agent exits with shardctl's decision: a preemption and, within
    `backoff_limit`, a crash or a hang restart; exit 78 (do not retry) stops
    (docs/guides/kubernetes.md, "How an attempt ends"). `OnFailure` restarts every
    failed pod, exit 78 included, up to `backoff_limit` times."""
    backoff_limit: Retries = 6
    """Restarts of each node after a crash or a hang before the job fails; 0 to 1000.
    Counted by the pods on `pvc`, or without one beside an `s3://` checkpoint.dir
    (with neither, none: a crash stops). Under
    `restart_policy: OnFailure`, the operator's count of container restarts instead; a
    TrainJob's runtime also restarts its JobSet at most this many times."""
    clean_pod_policy: Literal["None", "All", "Running"] = "None"
    """PyTorchJob run policy: which pods to delete when the job ends."""
    ttl_seconds_after_finished: Seconds | None = None
    """0 to 31622400 (a year)."""
    active_deadline_seconds: PositiveSeconds | None = None
    """1 to 31622400 (a year)."""
    suspend: bool = False
    """Create the job suspended (run policy `suspend`): PENDING until resumed or its queue
    admits it."""
    elastic: Elastic | None = None
    """PyTorchJob only: `min_nodes ≤ nodes ≤ max_nodes`, `max_restarts`."""
    env_from_config_maps: list[str] = Field(default_factory=list)
    """ConfigMaps whose keys become every rank's environment, referenced by name."""
    env_from_secrets: list[str] = Field(default_factory=list)
    """Secrets whose keys become every rank's environment, referenced by name (values
    never appear in a spec or a rendered file): e.g. one holding `AWS_ENDPOINT_URL`,
    `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` for an `s3://` `checkpoint.dir`."""
    shm_size: MemorySize = MemorySize("1Gi")
    """Size of the in-memory /dev/shm for dataloader workers; 1Mi to 1Pi, see `memory`."""
    run_as_user: Annotated[int, Field(gt=0, le=MAX_UID, strict=True)] = 1000
    """1 to 2147483647 (root, uid 0, is refused: pods run as non-root)."""
    read_only_root_filesystem: bool = True
    """Run the pods with a read-only root file system."""
    master_port: Annotated[int, Field(ge=1024, le=65535)] = 23456
    """PyTorchJob only (Trainer v2 uses 29500)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """On the job and its pods, e.g. Kueue's `kueue.x-k8s.io/queue-name: team-a`."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """On the job and its pods."""
    scheduler_name: str | None = None
    """The pods' scheduler (e.g. `volcano`, a Kueue-aware or gang scheduler)."""
    affinity: Affinity | None = None
    """The pods' affinity, in Kubernetes' words (nodeAffinity, podAffinity, podAntiAffinity)."""
    volumes: list[ExtraVolume] = Field(default_factory=list)
    """More volumes mounted in every pod (datasets, a model cache, credentials)."""
    gpu_resource: str = "nvidia.com/gpu"
    """The resource a CUDA pod requests procs_per_node of: `nvidia.com/gpu`,
    `amd.com/gpu`, a MIG name such as `nvidia.com/mig-1g.10gb`."""
    termination_grace_s: Annotated[int, Field(ge=MIN_GRACE_S, le=MAX_SECONDS, strict=True)] = 300
    """Seconds between SIGTERM and SIGKILL when a pod is deleted or preempted: the ranks
    save a checkpoint in that time, so it must exceed a save; 30 to 31622400."""

    @field_validator(
        "namespace", "service_account", "pvc", "priority_class",
        "image_pull_secrets", "env_from_config_maps", "env_from_secrets",
    )  # fmt: skip
    @classmethod
    def _dns_names(cls, v: Any) -> Any:
        for name in v if isinstance(v, list) else [v]:
            if name is not None and (
                len(name) > 253 or not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", name)
            ):
                raise ValueError(
                    f"{show(name)} is not a Kubernetes name; accepted: lower-case letters, "
                    "digits, '-' and '.', starting and ending alphanumeric"
                )
        return v

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        # A namespace is a DNS-1123 *label*: unlike most object names, no dots.
        if len(v) > 63 or not NAME_RE.match(v):
            raise ValueError(
                f"{show(v)} is not a Kubernetes namespace; accepted: 1-63 lower-case letters, "
                "digits and '-', starting and ending alphanumeric (no '.')"
            )
        return v

    @field_validator("cpu")
    @classmethod
    def _cpu(cls, v: str | None) -> str | None:
        if v is None:
            return v
        m = K8S_CPU_RE.match(v)
        if m is None:
            raise ValueError(
                f"{show(v)} is not a Kubernetes CPU quantity; accepted: cores ('8', '0.5') "
                "or millicores ('1500m')"
            )
        cores = float(m.group(1)) / (1000 if m.group(2) else 1)
        if not 0 < cores <= MAX_POD_CPUS:
            raise ValueError(
                f"{show(v)} is {'zero' if cores == 0 else 'more than the most shardctl accepts'}"
                f"; accepted: more than 0, at most {MAX_POD_CPUS} cores"
            )
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and (not v or re.search(r"\s", v) or CONTROL_RE.search(v)):
            raise ValueError(
                f"{show(v)} is not an image reference; accepted: one word such as "
                "'ghcr.io/team/shardctl:1.0' or 'pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime'"
            )
        return v

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        return shell_lines(v)

    @field_validator("runtime", "scheduler_name")
    @classmethod
    def _runtime(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 63 or not NAME_RE.match(v)):
            raise ValueError(
                f"{show(v)} is not a Kubernetes name; accepted: 1-63 lower-case letters, "
                "digits and '-', starting and ending alphanumeric"
            )
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            _qualified_key(key, "label")
            if not isinstance(value, str) or (
                value and (len(value) > 63 or not QUALIFIED_NAME_RE.match(value))
            ):
                raise ValueError(
                    f"label {key}: {show(value)} is not a label value; accepted: a string "
                    "of 0-63 letters, digits, '-', '_' or '.', starting and ending "
                    "alphanumeric (quote numbers: '8')"
                )
        return v

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            _qualified_key(key, "annotation")
        if sum(len(k) + len(x) for k, x in v.items()) > 256 * 1024:
            raise ValueError("annotations hold more than 256 KiB, the most Kubernetes stores")
        return v

    @field_validator("gpu_resource")
    @classmethod
    def _gpu_resource(cls, v: str) -> str:
        if len(v) > 253 or not EXTENDED_RESOURCE_RE.match(v) or v.startswith("kubernetes.io/"):
            raise ValueError(
                f"{show(v)} is not an extended resource name; accepted: 'domain/name', "
                "e.g. 'nvidia.com/gpu', 'amd.com/gpu', 'nvidia.com/mig-1g.10gb'"
            )
        return v

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, v: list[ExtraVolume]) -> list[ExtraVolume]:
        names = [vol.name for vol in v]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"volume names used twice: {', '.join(twice)}; accepted: unique")
        paths = [vol.mount_path for vol in v]
        for i, a in enumerate(paths):
            for b in paths[i + 1 :]:
                if a == b or a.startswith(b + "/") or b.startswith(a + "/"):
                    raise ValueError(f"mount paths {a!r} and {b!r} overlap; accepted: apart")
        return v

    # Fields that mean something to one API only; set for the other, they would be
    # silently ignored, so they are refused with the reason.
    PYTORCHJOB_ONLY: ClassVar[dict[str, str]] = {
        "clean_pod_policy": "a TrainJob's pods are cleaned up with its JobSet",
        "elastic": "Trainer v2.3 has no elastic policy in the TrainJob API",
        "ttl_seconds_after_finished": "a TrainJob has no TTL (set it on the runtime's JobSet)",
        "master_port": "Trainer v2's torch plugin fixes the rendezvous port at 29500",
        "restart_policy": "a TrainJob's pods restart through its runtime's JobSet failure "
        "policy: k8s.backoff_limit restarts of every pod",
    }
    TRAINJOB_ONLY: ClassVar[tuple[str, ...]] = ("runtime", "runtime_kind")

    def is_set(self, field: str) -> bool:
        """The field holds something other than its default (how "the spec sets it" is
        told apart: a spec written back by to_yaml_dict spells every field)."""
        default = type(self).model_fields[field].get_default(call_default_factory=True)
        return bool(getattr(self, field) != default)

    @model_validator(mode="after")
    def _api_fields(self) -> K8sSection:
        given = {k for k in (*self.PYTORCHJOB_ONLY, *self.TRAINJOB_ONLY) if self.is_set(k)}
        if self.api == "trainjob":
            wrong = [f"{k} ({why})" for k, why in self.PYTORCHJOB_ONLY.items() if k in given]
            if wrong:
                raise ValueError(
                    f"k8s.api is trainjob, but {', '.join(wrong)} applies to "
                    "k8s.api: pytorchjob only; remove it"
                )
        else:
            wrong = [k for k in self.TRAINJOB_ONLY if k in given]
            if wrong:
                raise ValueError(
                    f"k8s.{', k8s.'.join(wrong)} applies to k8s.api: trainjob only (this spec "
                    "renders a PyTorchJob); set k8s.api: trainjob or remove it"
                )
        return self

    def spec_problems(self, spec: Any) -> list[str]:
        problems: list[str] = []
        entry = spec.entrypoint
        if self.code == "configmap" and (entry is None or not entry.script):
            problems.append(
                "k8s.code 'configmap' ships entrypoint.script (or entrypoint.code_dir) to the "
                "pods; accepted without a script: image (a module must be in the image)"
            )
        nodes = spec.resources.nodes
        if self.elastic is not None and not (
            self.elastic.min_nodes <= nodes <= self.elastic.max_nodes
        ):
            problems.append(
                f"resources.nodes ({nodes}) must lie within k8s.elastic "
                f"[{self.elastic.min_nodes}, {self.elastic.max_nodes}]"
            )
        return problems

    def run_problems(self, spec: Any) -> list[str]:
        """What a job needs to run on Kubernetes that the spec alone cannot promise."""
        problems: list[str] = []
        if self.image is None:
            problems.append(
                "k8s.image is required for --cluster k8s: the pods need an image with torch and "
                "shardctl. Build one with the project's Containerfile (`scripts/build-image -t "
                "REGISTRY/shardctl:TAG`, push it, set k8s.image to it), or give an image with "
                "torch (e.g. 'pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime') plus k8s.setup "
                'lines that install shardctl at start (e.g. "python -m pip install --user '
                "'shardctl[train]'\")"
            )
        # Checkpoints in a bucket need no shared volume: each pod uploads its own ranks'
        # files from its emptyDir and node 0 commits the manifest once every list is in.
        if spec.resources.nodes > 1 and self.pvc is None and not is_s3_url(spec.checkpoint_dir):
            problems.append(
                f"k8s.pvc is required for a {spec.resources.nodes}-node job with its "
                "checkpoint.dir on a path (not s3://): the ranks on "
                "different pods write one checkpoint together, which needs one volume they all "
                "mount (a ReadWriteMany PersistentVolumeClaim, e.g. on NFS/CephFS/Lustre; "
                "pvc.yaml in the manifests `shardctl --version` lists is one); with an emptyDir "
                "each pod would hold only its own shards and resume would find no complete "
                "checkpoint. Accepted without a PVC: an s3:// checkpoint.dir"
            )
        # The API's own rules (JobKind.problems) join these in objects.run_problems:
        # this module loads at start-up and imports no kind.
        return problems
