"""The job spec: one YAML file parsed once into a frozen, validated `JobSpec`.

Every renderer, cluster backend and the training loop take a `JobSpec`; nothing
downstream reads the YAML again. Validation errors name the field (dotted path),
the bad value and what would be accepted, and become exit code 2 in the CLI.

Derived settings are filled in here, once: `strategy.sharding` and
`strategy.zero_stage` are two views of the same choice, so whichever the user
gives determines the other, and a pair that disagrees is rejected.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .errors import SpecError
from .rundir import default_checkpoint_dir, default_run_dir
from .yamlio import read_yaml_file

# --------------------------------------------------------------------------- names

# A job name becomes a Slurm job name, a Kubernetes object name (DNS-1123 label)
# and the stem of pod names such as `<name>-worker-12`; 63 is the label limit and
# the operator appends up to 11 characters (`-worker-NNN`), hence 50.
NAME_MAX = 50
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
SLURM_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
K8S_QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
SLURM_MEM_RE = re.compile(r"^[0-9]+[KMGT]?$")

# Variables the launchers set for every rank; a user value would silently make
# every process believe it is the same rank.
RESERVED_ENV = frozenset(
    {
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES", "NPROC_PER_NODE",
        # shardctl's own run-time variables (see orchestrator/launch.py)
        "SHARDCTL_NNODES", "SHARDCTL_NODE_RANK", "SHARDCTL_NPROC_PER_NODE",
        "SHARDCTL_RENDER_DIR",
    }
)  # fmt: skip

SHARDING_TO_ZERO: dict[str, int] = {
    "full_shard": 3,
    "shard_grad_op": 2,
    "no_shard": 0,
    # DeepSpeed's twin is ZeRO-3 with hierarchical partitioning (ZeRO++ hpZ):
    # parameters sharded inside a node, replicated across nodes.
    "hybrid_shard": 3,
}
ZERO_TO_SHARDING: dict[int, str | None] = {
    3: "full_shard",
    2: "shard_grad_op",
    1: None,  # optimizer-state sharding only: FSDP has no such mode
    0: "no_shard",
}

Sharding = Literal["full_shard", "shard_grad_op", "hybrid_shard", "no_shard"]
Precision = Literal["auto", "bf16-mixed", "bf16-pure", "fp16-mixed", "fp32"]
# strict: YAML `yes`/`true` must not silently become the count 1.
PositiveInt = Annotated[int, Field(gt=0, strict=True)]
NonNegativeInt = Annotated[int, Field(ge=0, strict=True)]


def _factory_ref(v: str) -> str:
    if not FACTORY_RE.match(v):
        raise ValueError(f"{v!r} is not 'package.module:function'")
    return v


FactoryRef = Annotated[str, AfterValidator(_factory_ref)]


class _Section(BaseModel):
    """Base of every spec section: frozen, unknown keys rejected."""

    # allow_inf_nan=False: YAML `.inf` is not a learning rate or a clip norm.
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False
    )


def _set(model: BaseModel, field: str, value: Any) -> None:
    # Derived fields are filled in by validators of frozen models; this is the one
    # place that bypasses `frozen`, and only during validation.
    object.__setattr__(model, field, value)


# ---------------------------------------------------------------------- resources


class Resources(_Section):
    """What the job runs on."""

    nodes: PositiveInt = 1
    """Number of machines (Slurm nodes, Kubernetes pods)."""
    procs_per_node: PositiveInt = 1
    """Processes (ranks) per node; one per GPU on CUDA."""
    device: Literal["cpu", "cuda"] = "cpu"
    """`cuda` uses NCCL and one GPU per process; `cpu` uses gloo."""
    cpus_per_proc: PositiveInt = 1
    """CPU cores per process: OMP_NUM_THREADS, Slurm cpus-per-task, k8s cpu request."""
    memory: str | None = None
    """Memory per node in Slurm units (`64G`); also the k8s memory request (`64Gi`)."""

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str | None) -> str | None:
        if v is not None and not (SLURM_MEM_RE.match(v) or K8S_QUANTITY_RE.match(v)):
            raise ValueError(f"{v!r} is not a memory size; accepted: e.g. '64G', '512M', '64Gi'")
        return v

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


# ----------------------------------------------------------------------- strategy


class Strategy(_Section):
    """How the model is sharded and in which precision it trains."""

    backend: Literal["fsdp", "deepspeed"] = "fsdp"
    sharding: Sharding | None = None
    """FSDP view of the choice; derived from `zero_stage` when omitted."""
    zero_stage: Literal[0, 1, 2, 3] | None = None
    """DeepSpeed view of the choice; derived from `sharding` when omitted."""
    offload: Literal["none", "optimizer", "params"] = "none"
    """`params` offloads parameters and optimizer state to CPU; `optimizer` only the latter."""
    precision: Precision = "bf16-mixed"
    wrap: Literal["auto"] | list[str] = "auto"
    """Module classes that become one FSDP unit each; `auto` finds the transformer blocks."""
    activation_checkpointing: bool = False
    backward_prefetch: Literal["backward_pre", "backward_post", "none"] = "backward_pre"
    forward_prefetch: bool = False

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage_not_bool(cls, v: Any) -> Any:
        # YAML `true` would otherwise pass as stage 1 (True == 1 in Python).
        if isinstance(v, bool):
            raise ValueError(f"{v!r} is not a ZeRO stage; accepted: 0, 1, 2, 3")
        return v

    @field_validator("wrap")
    @classmethod
    def _wrap(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("an empty list wraps nothing; accepted: 'auto' or class names")
            for name in v:
                if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                    raise ValueError(f"{name!r} is not a Python class name")
        return v

    @model_validator(mode="after")
    def _derive_sharding(self) -> Strategy:
        sharding, stage = self.sharding, self.zero_stage
        if sharding is not None and stage is not None:
            expected = SHARDING_TO_ZERO[sharding]
            if expected != stage:
                raise ValueError(
                    f"strategy.sharding {sharding!r} and strategy.zero_stage {stage} disagree: "
                    f"{sharding} is ZeRO stage {expected}; give one of the two, not both"
                )
        elif sharding is None and stage is None:
            sharding, stage = "full_shard", 3
        elif stage is None:
            assert sharding is not None
            stage = SHARDING_TO_ZERO[sharding]
        else:
            sharding = ZERO_TO_SHARDING[stage]
            if sharding is None and self.backend == "fsdp":
                raise ValueError(
                    "strategy.zero_stage 1 (optimizer-state sharding only) has no FSDP "
                    "equivalent; accepted with backend fsdp: zero_stage 0, 2 or 3, or use "
                    "backend: deepspeed"
                )
        _set(self, "sharding", sharding)
        _set(self, "zero_stage", stage)
        return self


# -------------------------------------------------------------------- model, data


class ModelSource(_Section):
    """Exactly one of `llama`, `pretrained`, `factory`."""

    llama: dict[str, Any] | None = None
    """A `transformers.LlamaConfig` as keyword arguments; nothing is downloaded."""
    pretrained: str | None = None
    """A local directory for `from_pretrained`."""
    factory: FactoryRef | None = None
    """`package.module:function` returning an `nn.Module`."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype the model is built or loaded in (bf16-mixed still trains fp32 masters)."""

    @field_validator("llama")
    @classmethod
    def _llama(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (v or {}).items():
            # tie_word_embeddings is a flag, not a count of embeddings.
            counts = key.endswith(("_size", "_layers", "_heads", "_embeddings"))
            if (
                counts
                and not key.startswith("tie_")
                and (not isinstance(value, int) or isinstance(value, bool) or value <= 0)
            ):
                raise ValueError(f"llama.{key} must be a positive integer, got {value!r}")
        cfg = v or {}
        hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
        if hidden and heads and hidden % heads:
            raise ValueError(
                f"llama.hidden_size ({hidden}) must be divisible by llama.num_attention_heads "
                f"({heads}); each head gets hidden_size / num_attention_heads dimensions"
            )
        kv = cfg.get("num_key_value_heads")
        if heads and kv and heads % kv:
            raise ValueError(
                f"llama.num_attention_heads ({heads}) must be divisible by "
                f"llama.num_key_value_heads ({kv}) (grouped-query attention)"
            )
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        given = [k for k in ("llama", "pretrained", "factory") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of llama, pretrained, factory (got {given or 'none'})"
            )
        return self


BUILTIN_CORPORA = ("python-stdlib",)


class DataSource(_Section):
    """Exactly one of `text`, `tokens`, `builtin`, `factory`."""

    text: str | None = None
    """A text file or a folder of them, read as bytes (byte-level tokens: no tokenizer)."""
    tokens: str | None = None
    """A memory-mapped token file: `.npy`, or raw `.bin` of `token_dtype`."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    builtin: Literal["python-stdlib"] | None = None
    """A corpus every machine has: the Python standard library's own source files."""
    factory: FactoryRef | None = None
    """`package.module:function(spec, rank, world_size)` returning a token iterator."""

    @model_validator(mode="after")
    def _exactly_one(self) -> DataSource:
        given = [k for k in ("text", "tokens", "builtin", "factory") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of text, tokens, builtin, factory (got {given or 'none'})"
            )
        return self


class Train(_Section):
    """The optimisation itself."""

    model: ModelSource
    data: DataSource
    steps: PositiveInt
    """Optimizer steps in total."""
    micro_batch_size: PositiveInt = 1
    """Sequences per rank per micro-step."""
    seq_len: PositiveInt = 128
    grad_accum: PositiveInt = 1
    """Micro-steps per optimizer step."""
    lr: Annotated[float, Field(gt=0)] = 3e-4
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    warmup_steps: NonNegativeInt = 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    clip: Annotated[float, Field(ge=0)] = 1.0
    """Max gradient norm; 0 disables clipping."""
    seed: NonNegativeInt = 0
    log_every: PositiveInt = 1

    @model_validator(mode="after")
    def _warmup(self) -> Train:
        if self.warmup_steps > self.steps:
            raise ValueError(
                f"train.warmup_steps ({self.warmup_steps}) is larger than train.steps "
                f"({self.steps}); accepted: 0..{self.steps}"
            )
        return self


# --------------------------------------------------------------------- checkpoint


class Checkpoint(_Section):
    """Sharded checkpoints: atomic, resumable, consolidated at the end."""

    dir: str | None = None
    """Where `step-NNNNNNNN/` folders go; default `<run_dir>/checkpoints`. May point
    elsewhere (a scratch file system); logs and the model stay in the run dir."""
    every_steps: PositiveInt = 100
    keep: Annotated[int, Field(ge=2, strict=True)] = 3
    """Complete checkpoints kept. At least 2: the newest may still be being written."""
    async_save: bool = Field(default=False, alias="async")
    """Stage state and write it in the background while training goes on."""
    resume: str = "auto"
    """`auto` (newest complete checkpoint), `never`, or the path of one checkpoint."""
    consolidate_on_finish: bool = False
    consolidate_dtype: Literal["fp32", "bf16"] = "fp32"

    @field_validator("resume")
    @classmethod
    def _resume(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("empty; accepted: 'auto', 'never' or a checkpoint path")
        return v


# ------------------------------------------------------------------------ clusters


class LocalCluster(_Section):
    """Settings for `--cluster local` (torchrun on this host)."""

    master_port: Annotated[int, Field(ge=1024, le=65535)] = 29500


class SlurmCluster(_Section):
    """Settings for `--cluster slurm` (through submitit)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"
    """Slurm's --time: `M`, `H:M:S`, `D-H:M:S` ..."""
    signal: Literal["USR2", "USR1", "TERM", "INT"] = "USR2"
    """Sent before the time limit (and by `scancel --signal`); USR1 is NCCL's."""
    signal_delay_s: Annotated[int, Field(ge=10, le=65535)] = 120
    """Seconds before the time limit at which the signal is sent."""
    constraint: str | None = None
    gres: str | None = None
    """Generic resources per node, e.g. `gpu:8`; default derived from device/procs."""
    exclusive: bool = False
    setup: list[str] = Field(default_factory=list)
    """Shell lines run on every node before the launcher (module load, venv ...)."""
    srun_args: list[str] = Field(default_factory=list)
    """Extra words for srun, e.g. `--cpu-bind=none`."""
    max_requeues: NonNegativeInt = 10
    master_port: Annotated[int, Field(ge=1024, le=65535)] = 29500

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        if slurm_time_minutes(v) is None:
            raise ValueError(
                f"{v!r} is not a Slurm time; accepted: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S "
                "(e.g. '90', '04:00:00', '2-00:00:00'), more than zero"
            )
        return v

    @field_validator("partition", "account", "qos", "constraint", "gres")
    @classmethod
    def _no_space(cls, v: str | None) -> str | None:
        if v is not None and (not v or re.search(r"\s", v)):
            raise ValueError(f"{v!r} must be one non-empty word without spaces")
        return v

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        for line in v:
            if "\n" in line:
                raise ValueError(f"{line!r}: one shell line per list item, no newlines")
        return v


def slurm_time_minutes(value: str) -> int | None:
    """Slurm --time string → whole minutes (rounded up), or None when malformed."""
    m = SLURM_TIME_RE.match(value.strip())
    if not m:
        return None
    days, a, b, c = m.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        seconds = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # H:M:S
        seconds = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # M:S
        seconds = int(a) * 60 + int(b)
    else:  # M
        seconds = int(a) * 60
    return -(-seconds // 60) if seconds > 0 else None


class Toleration(_Section):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, alias="tolerationSeconds")


class Elastic(_Section):
    min_nodes: PositiveInt
    max_nodes: PositiveInt
    max_restarts: NonNegativeInt = 3

    @model_validator(mode="after")
    def _order(self) -> Elastic:
        if self.min_nodes > self.max_nodes:
            raise ValueError(
                f"k8s.elastic.min_nodes ({self.min_nodes}) > max_nodes ({self.max_nodes})"
            )
        return self


class K8sCluster(_Section):
    """Settings for `--cluster k8s` (a Kubeflow PyTorchJob)."""

    namespace: str = "default"
    image: str = "python:3.11-slim"
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: list[str] = Field(default_factory=list)
    service_account: str = "shardctl-trainer"
    pvc: str | None = None
    """PersistentVolumeClaim mounted at the run directory, so restarted pods resume."""
    cpu: str | None = None
    """CPU request/limit per pod; default derived from procs_per_node × cpus_per_proc."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    priority_class: str | None = None
    restart_policy: Literal["OnFailure", "ExitCode", "Never", "Always"] = "OnFailure"
    backoff_limit: NonNegativeInt = 6
    clean_pod_policy: Literal["None", "All", "Running"] = "None"
    ttl_seconds_after_finished: NonNegativeInt | None = None
    active_deadline_seconds: PositiveInt | None = None
    suspend: bool = False
    elastic: Elastic | None = None
    env_from_config_maps: list[str] = Field(default_factory=list)
    env_from_secrets: list[str] = Field(default_factory=list)
    shm_size: str = "1Gi"
    run_as_user: PositiveInt = 1000
    read_only_root_filesystem: bool = True
    master_port: Annotated[int, Field(ge=1024, le=65535)] = 23456

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
                    f"{name!r} is not a Kubernetes name; accepted: lower-case letters, "
                    "digits, '-' and '.', starting and ending alphanumeric"
                )
        return v

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        # A namespace is a DNS-1123 *label*: unlike most object names, no dots.
        if len(v) > 63 or not NAME_RE.match(v):
            raise ValueError(
                f"{v!r} is not a Kubernetes namespace; accepted: 1-63 lower-case letters, "
                "digits and '-', starting and ending alphanumeric (no '.')"
            )
        return v

    @field_validator("shm_size", "cpu")
    @classmethod
    def _quantity(cls, v: str | None) -> str | None:
        if v is not None and not K8S_QUANTITY_RE.match(v):
            raise ValueError(f"{v!r} is not a Kubernetes quantity (e.g. '1Gi', '500m', '8')")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not v or re.search(r"\s", v):
            raise ValueError(f"{v!r} is not an image reference")
        return v


# ------------------------------------------------------------------------ the spec


class JobSpec(_Section):
    """One training job: what to train, how to shard it, where to run it."""

    name: str
    run_dir: str | None = None
    """The run's own folder: rendered files, logs, markers, `model/`; default `runs/<name>`."""
    resources: Resources = Field(default_factory=Resources)
    launcher: Literal["torchrun", "accelerate", "deepspeed"] = "torchrun"
    strategy: Strategy = Field(default_factory=Strategy)
    train: Train
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    env: dict[str, str] = Field(default_factory=dict)
    local: LocalCluster = Field(default_factory=LocalCluster)
    slurm: SlurmCluster = Field(default_factory=SlurmCluster)
    k8s: K8sCluster = Field(default_factory=K8sCluster)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if len(v) > NAME_MAX or not NAME_RE.match(v):
            raise ValueError(
                f"{v!r} cannot be a Slurm job and Kubernetes name; accepted: 1-{NAME_MAX} "
                "lower-case letters, digits and '-', starting and ending with a letter or digit"
            )
        return v

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or "\n" in v or "\x00" in v):
            raise ValueError("accepted: a folder path (one line, not empty)")
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out: dict[str, Any] = {}
        for key, value in v.items():
            if not isinstance(key, str) or not ENV_NAME_RE.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
            if key in RESERVED_ENV:
                raise ValueError(
                    f"{key} is set by the launcher for every rank and cannot be set in env"
                )
            if isinstance(value, bool):
                value = "1" if value else "0"
            elif isinstance(value, int | float):
                value = str(value)
            out[key] = value
        return out

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        s, r, t, c = self.strategy, self.resources, self.train, self.checkpoint
        problems: list[str] = []
        if s.backend == "deepspeed" and s.precision == "bf16-pure":
            problems.append(
                "strategy.precision 'bf16-pure' cannot work with backend deepspeed: DeepSpeed "
                "always keeps fp32 master weights and optimizer state; accepted: bf16-mixed "
                "(what DeepSpeed's bf16 mode does), fp16-mixed, fp32"
            )
        if s.sharding == "hybrid_shard" and r.nodes < 2:
            problems.append(
                f"strategy.sharding 'hybrid_shard' shards within a node and replicates across "
                f"nodes, so it needs resources.nodes >= 2 (got {r.nodes}); accepted on one "
                "node: full_shard"
            )
        if s.offload != "none":
            problems.extend(_offload_problems(s, r))
        if r.device == "cpu" and s.precision == "fp16-mixed":
            problems.append(
                "strategy.precision 'fp16-mixed' needs a loss scaler on CUDA; on resources.device "
                "'cpu' accepted: bf16-mixed, bf16-pure (fsdp), fp32"
            )
        if self.launcher == "deepspeed" and s.backend == "fsdp":
            problems.append(
                "launcher 'deepspeed' with strategy.backend 'fsdp': the deepspeed launcher "
                "starts DeepSpeed engines; accepted launchers for fsdp: torchrun, accelerate"
            )
        if self.launcher == "deepspeed" and r.device == "cpu" and r.nodes > 1:
            problems.append(
                "launcher 'deepspeed' on resources.device 'cpu' with more than one node: "
                "DeepSpeed's multi-node launch needs accelerators; use torchrun"
            )
        if c.every_steps > t.steps:
            problems.append(
                f"checkpoint.every_steps ({c.every_steps}) is larger than train.steps "
                f"({t.steps}), so no periodic checkpoint would ever be written; "
                f"accepted: 1..{t.steps}"
            )
        if self.k8s.elastic is not None and not (
            self.k8s.elastic.min_nodes <= r.nodes <= self.k8s.elastic.max_nodes
        ):
            problems.append(
                f"resources.nodes ({r.nodes}) must lie within k8s.elastic "
                f"[{self.k8s.elastic.min_nodes}, {self.k8s.elastic.max_nodes}]"
            )
        if problems:
            raise ValueError("\n".join(problems))
        if self.run_dir is None:
            _set(self, "run_dir", default_run_dir(self.name))
        if c.dir is None:
            _set(c, "dir", default_checkpoint_dir(self.run_dir))
        return self

    # -- derived facts used everywhere -------------------------------------------

    @property
    def world_size(self) -> int:
        return self.resources.world_size

    @property
    def checkpoint_dir(self) -> str:
        assert self.checkpoint.dir is not None  # filled in by validation
        return self.checkpoint.dir

    def to_yaml_dict(self) -> dict[str, Any]:
        """The validated spec (derived fields filled in) as plain data, by alias."""
        return self.model_dump(mode="json", by_alias=True)


def _offload_problems(s: Strategy, r: Resources) -> list[str]:
    problems: list[str] = []
    if r.device == "cpu":
        problems.append(
            f"strategy.offload {s.offload!r} moves state to CPU memory, but resources.device "
            "is 'cpu' already; accepted on cpu: none"
        )
    if s.backend == "fsdp":
        if s.sharding == "no_shard":
            problems.append(
                f"strategy.offload {s.offload!r} with sharding 'no_shard': FSDP offloads "
                "only sharded parameters; accepted: full_shard, shard_grad_op, hybrid_shard"
            )
        if s.offload == "optimizer":
            problems.append(
                "strategy.offload 'optimizer' alone does not exist in FSDP (its CPU offload "
                "moves parameters, gradients and the optimizer step together); accepted with "
                "fsdp: none, params — or backend deepspeed"
            )
    else:
        if s.zero_stage == 0:
            problems.append(
                f"strategy.offload {s.offload!r} needs ZeRO stage >= 1 with DeepSpeed "
                "(got zero_stage 0)"
            )
        if s.offload == "params" and s.zero_stage != 3:
            problems.append(
                f"strategy.offload 'params' needs ZeRO stage 3 (got zero_stage {s.zero_stage}); "
                "accepted at stage 1-2: offload optimizer"
            )
    return problems


# --------------------------------------------------------------------- loading


def parse_spec(data: Any, source: str | None = None) -> JobSpec:
    """Validate plain data (from YAML) into a `JobSpec`, or raise `SpecError`."""
    if not isinstance(data, dict):
        raise SpecError(
            [
                "the top level must be a mapping of sections, got "
                + ("nothing (the file is empty)" if data is None else type(data).__name__)
            ],
            source,
        )
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_explain(exc, data), source) from None


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML job spec file."""
    return parse_spec(read_yaml_file(path), str(path))


def _explain(exc: ValidationError, data: Any) -> list[str]:
    """Turn pydantic's errors into one line each: field, value, what is accepted."""
    problems: list[str] = []
    for err in exc.errors(include_url=False):
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        field = _dotted(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            parent, key = loc[:-1], str(loc[-1])
            allowed = _allowed_keys(parent)
            hint = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            where = _dotted(parent) or "the top level"
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            problems.append(
                f"unknown key {field!r} in {where}{did_you_mean} "
                f"(accepted: {', '.join(sorted(allowed))})"
            )
            continue
        if kind == "missing":
            problems.append(f"{field}: required but missing")
            continue
        msg = err["msg"]
        if msg.startswith(("Value error, ", "Assertion failed, ")):
            msg = msg.split(", ", 1)[1]
            # Cross-field checks already name their fields; one line each.
            if not loc or msg.startswith(
                ("strategy.", "checkpoint.", "launcher", "train.", "k8s.", "resources.")
            ):
                problems.extend(msg.split("\n"))
                continue
        value = err.get("input")
        shown = "" if isinstance(value, dict | list) else f" (got {value!r})"
        problems.append(f"{field or 'spec'}: {msg}{shown}")
    return problems


def _dotted(loc: list[Any] | tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _allowed_keys(loc: list[Any]) -> list[str]:
    """The keys accepted at a location of the spec, by alias."""
    model: Any = JobSpec
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:  # an alias
            field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return []
        model = _model_in(field.annotation)
        if model is None:
            return []
    return [f.alias or name for name, f in model.model_fields.items()]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
