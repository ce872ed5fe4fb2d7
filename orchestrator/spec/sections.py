"""The core sections of a job spec: resources, strategy, the built-in loop's model,
data and optimisation, checkpoints, logging, the watchdog and an entrypoint."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from ..s3.url import ACCEPTED as S3_ACCEPTED
from ..s3.url import is_s3_url, url_problem
from ..sizes import MemorySize
from .common import (
    CONTROL_RE,
    MAX_CLIP,
    MAX_KEEP,
    MAX_LR,
    MAX_SECONDS,
    MAX_SEED,
    MAX_WEIGHT_DECAY,
    PATH_MAX,
    SHARDING_TO_ZERO,
    ZERO_TO_SHARDING,
    Batch,
    Cpus,
    FactoryRef,
    Nodes,
    PathText,
    Precision,
    Procs,
    Retries,
    Section,
    SeqLen,
    Sharding,
    Steps,
    StepsOrZero,
    path_text,
    set_derived,
    show,
    type_name,
)  # fmt: skip
from .llama import llama_problems

# ---------------------------------------------------------------------- resources


class Resources(Section):
    """What the job runs on."""

    nodes: Nodes = 1
    """Number of machines (Slurm nodes, Kubernetes pods); 1 to 100000."""
    procs_per_node: Procs = 1
    """Processes (ranks) per node; one per GPU on CUDA; 1 to 1024."""
    device: Literal["cpu", "cuda"] = "cpu"
    """`cuda` uses NCCL and one GPU per process; `cpu` uses gloo."""
    cpus_per_proc: Cpus = 1
    """CPU cores per process: OMP_NUM_THREADS, Slurm cpus-per-task, k8s cpu request;
    1 to 1024."""
    memory: MemorySize | None = None
    """Memory per node: Slurm units (`64G`, `512M`, a bare number of megabytes) or a
    Kubernetes quantity (`64Gi`, `1.5Gi`); 1Mi to 1Pi. Rendered by `MemorySize.slurm()`
    for --mem and `MemorySize.k8s()` for the pod's memory request."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


# ----------------------------------------------------------------------- strategy


class Strategy(Section):
    """How the model is sharded and in which precision it trains."""

    backend: Literal["fsdp", "deepspeed"] = "fsdp"
    """`fsdp` (torch FSDP2) or `deepspeed` (ZeRO)."""
    sharding: Sharding | None = None
    """FSDP view of the choice; derived from `zero_stage` when omitted."""
    zero_stage: Literal[0, 1, 2, 3] | None = None
    """DeepSpeed view of the choice; derived from `sharding` when omitted."""
    offload: Literal["none", "optimizer", "params"] = "none"
    """`params` offloads parameters and optimizer state to CPU; `optimizer` only the latter."""
    precision: Precision = "bf16-mixed"
    """`auto` (what the hardware computes natively), `bf16-mixed` (fp32 masters, bf16
    compute), `bf16-pure` (fsdp only: DeepSpeed always keeps fp32 master weights),
    `fp16-mixed` (cuda only), `fp32`."""
    wrap: Literal["auto"] | list[str] = "auto"
    """Module classes that become one FSDP unit each; `auto` finds the transformer blocks."""
    activation_checkpointing: bool = False
    """Recompute activations in backward."""
    backward_prefetch: Literal["backward_pre", "backward_post", "none"] = "backward_pre"
    """An FSDP1 setting: accepted and unused (FSDP2 always prefetches one block in backward)."""
    forward_prefetch: bool = False
    """Prefetch the next block's all-gather explicitly."""

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage_not_bool(cls, v: Any) -> Any:
        # YAML `true` would otherwise pass as stage 1 (True == 1 in Python).
        if isinstance(v, bool):
            raise ValueError(f"{show(v)} is not a ZeRO stage; accepted: 0, 1, 2, 3")
        return v

    @field_validator("wrap", mode="before")
    @classmethod
    def _wrap_shape(cls, v: Any) -> Any:
        # One line for the two shapes the field takes, not one per shape.
        if v == "auto" or (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            return v
        bad = next((x for x in v if not isinstance(x, str)), v) if isinstance(v, list) else v
        raise ValueError(
            f"{show(bad)} is {type_name(bad)}; accepted: 'auto' or a list of module class "
            "names, e.g. [LlamaDecoderLayer]"
        )

    @field_validator("wrap")
    @classmethod
    def _wrap(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("an empty list wraps nothing; accepted: 'auto' or class names")
            for name in v:
                if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                    raise ValueError(f"{show(name)} is not a Python class name")
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
        set_derived(self, "sharding", sharding)
        set_derived(self, "zero_stage", stage)
        return self


class ModelSource(Section):
    """Exactly one of `llama`, `pretrained`, `factory`."""

    llama: dict[str, Any] | None = None
    """A `transformers.LlamaConfig` as keyword arguments; nothing is downloaded."""
    pretrained: PathText | None = None
    """A local directory for `from_pretrained`."""
    factory: FactoryRef | None = None
    """`package.module:function` returning an `nn.Module`."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype the model is built or loaded in (bf16-mixed still trains fp32 masters)."""

    @field_validator("llama")
    @classmethod
    def _llama(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        problems = llama_problems(v) if v is not None else []
        if problems:
            raise ValueError("\n".join(problems))
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


class DataSource(Section):
    """Exactly one of `text`, `tokens`, `builtin`, `factory`."""

    text: PathText | None = None
    """A text file or a folder of them, read as bytes (byte-level tokens: no tokenizer)."""
    tokens: PathText | None = None
    """A memory-mapped token file: `.npy`, or raw `.bin` of `token_dtype`."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """The element type of a `tokens` file."""
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


class Train(Section):
    """The optimisation itself."""

    model: ModelSource
    """Exactly one of `llama`, `pretrained`, `factory` (see `ModelSource`)."""
    data: DataSource
    """Exactly one of `builtin`, `text`, `tokens`, `factory` (see `DataSource`)."""
    steps: Steps
    """Optimizer steps in total; 1 to 99999999 (checkpoint folders have eight digits)."""
    micro_batch_size: Batch = 1
    """Sequences per rank per micro-step; 1 to 65536."""
    seq_len: SeqLen = 128
    """Tokens per sequence; 1 to 16777216 (2**24)."""
    grad_accum: Batch = 1
    """Micro-steps per optimizer step; 1 to 65536."""
    lr: Annotated[float, Field(gt=0, le=MAX_LR)] = 3e-4
    """Peak learning rate (AdamW); more than 0, at most 10."""
    weight_decay: Annotated[float, Field(ge=0, le=MAX_WEIGHT_DECAY)] = 0.1
    """Decoupled (AdamW) weight decay; 0 to 10."""
    warmup_steps: StepsOrZero = 0
    """Linear warm-up steps; 0 to `steps`."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """The learning rate after warmup, down to `lr × min_lr_ratio`."""
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    """The schedule's final lr as a fraction of `lr`; 0 to 1."""
    clip: Annotated[float, Field(ge=0, le=MAX_CLIP)] = 1.0
    """Max gradient norm; 0 disables clipping; at most 1e6."""
    seed: Annotated[int, Field(ge=0, le=MAX_SEED, strict=True)] = 0
    """0 to 2**63 - 1 (torch seeds are 64-bit)."""
    log_every: Steps = 1
    """Steps between metric lines; 1 to 99999999."""
    on_divergence: Literal["stop", "continue"] = "stop"
    """What a diverged loss does (built-in loop). Diverged: the loss (mean over ranks) is
    NaN or infinite, or above 10 × ln(vocab_size) (a model that predicts uniformly scores
    ln(vocab_size); a learning rate far too high scores hundreds). `stop` (default):
    the run ends with exit 78 (not retried) before that step's checkpoint is written,
    naming the step and the loss; the checkpoints before it are kept. `continue`: train
    on, and save whatever the weights have become."""

    @model_validator(mode="after")
    def _warmup(self) -> Train:
        if self.warmup_steps > self.steps:
            raise ValueError(
                f"train.warmup_steps ({self.warmup_steps}) is larger than train.steps "
                f"({self.steps}); accepted: 0..{self.steps}"
            )
        return self


# --------------------------------------------------------------------- checkpoint


class Checkpoint(Section):
    """Sharded checkpoints: atomic, resumable, consolidated at the end."""

    dir: PathText | None = None
    """Where `step-NNNNNNNN/` folders go; default `<run_dir>/checkpoints`. May point
    elsewhere (a scratch file system); logs and the model stay in the run dir. Never
    the run dir itself, nor its logs/, model/ or rendered/ folders. `s3://BUCKET/PREFIX`
    puts them in an S3 bucket (the `s3` extra; endpoint and credentials from the
    standard AWS variables and files), staged in `<run_dir>/s3-cache/` (on more than
    one node, each node in its own `s3-cache/node-N/`: no shared volume needed) and
    uploaded behind training."""
    every_steps: Steps = 100
    """Steps between periodic checkpoints; 1 to `train.steps`."""
    keep: Annotated[int, Field(ge=2, le=MAX_KEEP, strict=True)] = 3
    """Complete checkpoints kept; 2 to 1000. At least 2: the newest may still be being
    written."""
    async_save: bool = Field(default=False, alias="async")
    """Stage state and write it in the background while training goes on."""
    resume: str = "auto"
    """`auto` (newest complete checkpoint), `never`, or the path of one checkpoint
    (`s3://BUCKET/PREFIX/step-NNNNNNNN` for one in a bucket)."""
    consolidate_on_finish: bool = False
    """Write one full state dict to `<run_dir>/model` at the end (replacing the one it
    wrote before; a `model/` holding other files is left alone, and the run says so)."""
    consolidate_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype of floating-point tensors in that consolidated model."""
    memory_every_steps: Steps | None = None
    """The memory tier: every K steps each rank's state (model, optimizer, train state)
    is also saved, with a manifest and sha256 like any checkpoint, into node-local
    memory that outlives the rank's process (`memory_dir`, a tmpfs); only the newest
    copy is kept. On more than one node each node's copy is also sent to its partner
    node's memory (node n's partner is node (n + 1) mod nodes), with its own manifest.
    A restart resumes from the newest step every node can load, verified: its own
    node's copy, else the partner's copy, else the durable tier, so a rank's death (or
    one node's memory lost) costs under K steps instead of up to `every_steps`; a node
    lost with its partner falls back to the durable tier. Off when unset; 1 to
    `every_steps - 1`."""
    memory_dir: PathText | None = None
    """Where the memory tier's copies go; default
    `/dev/shm/shardctl/<name>-<hash of the run dir>` on each node (on more than one
    node, each node's copies in its `node-<n>/` below it, so nodes sharing a host keep
    apart). Use a tmpfs: a disk folder works but is no faster than `dir`."""

    @model_validator(mode="after")
    def _memory_tier(self) -> Checkpoint:
        k = self.memory_every_steps
        if k is not None and k >= self.every_steps:
            raise ValueError(
                f"checkpoint.memory_every_steps ({k}) is not smaller than "
                f"checkpoint.every_steps ({self.every_steps}): a memory copy is only worth "
                "its cost between durable checkpoints; accepted: 1.."
                f"{self.every_steps - 1}, or leave it unset (memory tier off)"
            )
        return self

    @field_validator("resume")
    @classmethod
    def _resume(cls, v: str) -> str:
        if not v.strip():
            raise ValueError(
                f"{show(v)} is empty; accepted: 'auto', 'never' or the path of one "
                "step-NNNNNNNN checkpoint folder"
            )
        if is_s3_url(v):  # one checkpoint in a bucket: s3://BUCKET/PREFIX/step-NNNNNNNN
            problem = url_problem(v)
            if problem:
                raise ValueError(f"{show(v)}: {problem}; {S3_ACCEPTED}")
            return v
        path_text(v)
        return v


# ------------------------------------------------------------------------ logging

TRACKERS = ("tensorboard", "wandb", "mlflow")
Tracker = Literal["tensorboard", "wandb", "mlflow"]
# W&B refuses these in a project name; MLflow takes any experiment name, so one rule
# serves both. 128 characters is W&B's limit for project and run names.
TRACKER_NAME_MAX = 128
TRACKER_NAME_BAD = re.compile(r"[/\\#?%:\x00-\x1f\x7f]")


class Logging(Section):
    """Where rank 0 sends the per-step metrics, beside `<run_dir>/logs/metrics.jsonl`.

    The same scalars (loss, lr, grad_norm, tokens_per_s) every `train.log_every` steps,
    with the step as the global step; `shardctl.train.api.log_metrics` writes a user
    script's scalars the same way. A resumed run continues the same TensorBoard folder,
    MLflow run and W&B run (their ids are kept in `<run_dir>/logs/trackers.json`).
    """

    backends: list[Tracker] | None = None
    """Trackers: `tensorboard` (event files), `wandb`, `mlflow`; each at most once, `[]`
    for none. A listed tracker whose package is missing stops the run at its start with
    the `pip install 'shardctl[...]'` line that adds it. Unset: TensorBoard when its
    package is installed (it comes with `shardctl[train]`), else metrics.jsonl only,
    with a note saying so."""
    project: str | None = None
    """The W&B project and the MLflow experiment; default the job's `name`. At most 128
    characters, none of `/ \\ # ? % :`."""
    run_name: str | None = None
    """The run's name shown in W&B and MLflow; default the job's `name`."""
    wandb_mode: Literal["online", "offline"] = "online"
    """`offline` writes the W&B run under `<run_dir>/wandb` only (`wandb sync` uploads it)."""
    mlflow_tracking_uri: str | None = None
    """MLflow's tracking store; default `sqlite:///<run_dir>/mlflow.db` (a local store
    MLflow ≥ 3 accepts without a server). Also `http(s)://server`, `databricks`."""
    tensorboard_dir: PathText | None = None
    """Where TensorBoard's event files go; default `<run_dir>/tensorboard`."""

    @field_validator("backends")
    @classmethod
    def _backends(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        seen = [name for i, name in enumerate(v) if name in v[:i]]
        if seen:
            raise ValueError(
                f"{show(sorted(set(seen)))} given more than once; accepted: each of "
                f"{', '.join(TRACKERS)} at most once"
            )
        return v

    @field_validator("project", "run_name")
    @classmethod
    def _tracker_name(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.strip() or len(v) > TRACKER_NAME_MAX or TRACKER_NAME_BAD.search(v):
            raise ValueError(
                f"{show(v)} cannot name a W&B project or run; accepted: 1-{TRACKER_NAME_MAX} "
                "printable characters without / \\ # ? % :"
            )
        return v

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _tracking_uri(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or CONTROL_RE.search(v) or len(v) > PATH_MAX):
            raise ValueError(
                f"{show(v)} is not a tracking URI; accepted: e.g. 'sqlite:////abs/mlflow.db', "
                "'http://mlflow.example:5000', 'databricks'"
            )
        return v

    def resolved(self, name: str, run_dir: str) -> Logging:
        """This section with every default filled in for job `name` in `run_dir` (made
        absolute: the ranks and a later `shardctl` call may start in other folders)."""
        root = Path(run_dir).absolute()
        return self.model_copy(
            update={
                "project": self.project or name,
                "run_name": self.run_name or name,
                "mlflow_tracking_uri": self.mlflow_tracking_uri
                or f"sqlite:///{(root / 'mlflow.db').as_posix()}",  # 4 slashes: absolute
                "tensorboard_dir": self.tensorboard_dir or str(root / "tensorboard"),
            }
        )


# ----------------------------------------------------------------------- watchdog

# A heartbeat per step is cheap, but a timeout shorter than this cannot tell a slow
# step from a stuck one on any real cluster; the tests use short ones.
MIN_HANG_TIMEOUT_S = 5
# torch's own default for a process group; what a collective waits without an
# explicit `collective_timeout_s` or `hang_timeout_s`.
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800
# With an explicit hang_timeout_s the collectives wait this much longer, so the
# watchdog (stacks, retry) ends a hang before a collective fails it (a plain failure).
COLLECTIVE_MARGIN_S = 120
# The start-up allowance when `startup_timeout_s` is unset: a rank's imports, model
# build, restore and first step may take this long, however short the hang timeout.
# 15 minutes, the start-up floor the derived rule always had (and the order of
# NVIDIA's resiliency launcher's initial-heartbeat timeout and torchrun's rendezvous
# wait): restarted ranks import torch and transformers from a shared file system,
# every node at once. Mirrors shardctl.train.watchdog.STARTUP_FLOOR_S (the watchdog
# imports no pydantic); tests/test_watchdog.py keeps them equal.
STARTUP_FLOOR_S = 900
HangSeconds = Annotated[int, Field(ge=MIN_HANG_TIMEOUT_S, le=MAX_SECONDS, strict=True)]


class Watchdog(Section):
    """Hang detection: each node's agent (above the node's launcher; in a `launch.sh`
    run by hand, a watchdog process) ends a job whose ranks stopped advancing
    (docs/guides/faults.md, "Hangs").

    Every rank writes a heartbeat per step (the built-in loop, the checkpoint library
    of your own script, the Hugging Face callback). When no rank of a node advanced
    for the hang timeout, the node's agent writes every rank's Python stack to the
    logs, ends every process and ends the attempt with 124; locally and on Slurm every rank restarts
    in place (up to `restart.max_in_allocation`), then Slurm requeues the job (up to
    `slurm.max_requeues`) and locally `status` says HUNG and `submit` resumes;
    Kubernetes restarts the pods."""

    enabled: bool = True
    """`false`: no hang detection (no heartbeats are read; no watchdog in `launch.sh`)."""
    hang_timeout_s: HangSeconds | None = None
    """Seconds without a heartbeat from any rank of a node before the job is declared
    hung; 5 to 31622400. Unset: derived while the job runs — the largest of 300 s, 10×
    the median step time and 3× the longest checkpoint save seen (this attempt's and
    the `save_s` of earlier ones); saves get at least 900 s until one has been
    measured. Start-up has its own allowance (`startup_timeout_s`)."""
    startup_timeout_s: HangSeconds | None = None
    """Seconds a rank may stay in start-up before the job is declared hung; 5 to
    31622400, at least `hang_timeout_s`. Start-up runs from a rank's first heartbeat
    (the process group is up) until it finishes its first training step: the imports
    and model build after `init_process_group`, the restore and the first step (it
    ends early at the rank's first save or evaluation). Unset: the larger of the hang
    timeout and 900 s, kept `collective_timeout_s` − 120 s or lower when that is set
    shorter (a collective waiting for a slow peer's start-up must not fail first)."""
    collective_timeout_s: HangSeconds | None = None
    """The process group's timeout: a collective waiting longer fails its rank; 5 to
    31622400. It must exceed `hang_timeout_s` and `startup_timeout_s`: a collective
    that fails first ends the job as FAILED, without the stacks and the retry of a
    hang, and in start-up (`init_process_group` included) a rank waits in collectives
    for its slowest peer's start-up. Unset: the start-up allowance + 120 when
    `hang_timeout_s` is set; else 1800 (torch's default), or `startup_timeout_s` +
    120 when that is longer."""

    @model_validator(mode="after")
    def _ordered(self) -> Watchdog:
        hang, start, coll = self.hang_timeout_s, self.startup_timeout_s, self.collective_timeout_s
        if hang is not None and start is not None and start < hang:
            raise ValueError(
                f"startup_timeout_s {start} is below hang_timeout_s {hang}: start-up (imports, "
                "restore, the first step) would be held to less time than a step; accepted: "
                f"startup_timeout_s >= hang_timeout_s (e.g. {max(hang, STARTUP_FLOOR_S)}), or "
                "leave startup_timeout_s unset"
            )
        for name, value in (("hang_timeout_s", hang), ("startup_timeout_s", start)):
            if value is not None and coll is not None and coll <= value:
                raise ValueError(
                    f"collective_timeout_s {coll} is not above {name} {value}: a collective "
                    "would fail its rank (FAILED, no stacks, no retry) before the watchdog "
                    f"ends the hang; accepted: collective_timeout_s > {name} (e.g. "
                    f"{value + COLLECTIVE_MARGIN_S}), or leave collective_timeout_s unset"
                )
        return self

    @property
    def collective_timeout(self) -> int:
        """The process group's timeout in seconds (see `collective_timeout_s`)."""
        if self.collective_timeout_s is not None:
            return self.collective_timeout_s
        if self.hang_timeout_s is not None:
            start = self.startup_timeout_s or max(STARTUP_FLOOR_S, self.hang_timeout_s)
            return start + COLLECTIVE_MARGIN_S
        if self.startup_timeout_s is not None:
            return max(DEFAULT_COLLECTIVE_TIMEOUT_S, self.startup_timeout_s + COLLECTIVE_MARGIN_S)
        return DEFAULT_COLLECTIVE_TIMEOUT_S


class Restart(Section):
    """Restarts inside the allocation: after a crash (a rank's non-zero exit that is
    not a preemption, or a rank killed by a signal) or a hang (a node watchdog's 124),
    the supervisor of every node starts its launcher again on the nodes the job
    already holds, and the ranks resume from the newest complete checkpoint
    (docs/guides/faults.md). Locally and on Slurm; on Kubernetes the pods restart in place through
    `k8s.restart_policy` and `k8s.backoff_limit` instead."""

    max_in_allocation: Retries = 3
    """Restarts of every rank per allocation (one Slurm start or requeue, one local
    `submit`); 0 to 1000, 0: none. Past it, Slurm requeues a hang (within
    `slurm.max_requeues`) and a crash stops; locally the run stops. Three restarts in a
    row without a new complete checkpoint stop the run whatever this says (a crash
    loop)."""


# ------------------------------------------------------------------------ the spec


MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
MAX_ARGS = 4096


class Entrypoint(Section):
    """Your own training script instead of the built-in loop: exactly one of `script`
    and `module`, plus `args`.

    Every rank runs it under the spec's launcher (torchrun, accelerate launch,
    deepspeed) with the run contract in its environment
    (docs/reference/run-contract.md)."""

    script: PathText | None = None
    """A Python file; a relative path is taken from the spec file's folder."""
    module: str | None = None
    """A module run as `python -m`, e.g. `mypkg.train` (importable on every node)."""
    args: list[Annotated[str, Field(strict=True, max_length=131072)]] = Field(
        default_factory=list, max_length=MAX_ARGS
    )
    """At most 4096 arguments, passed byte for byte: quotes, `$(...)`, newlines stay
    inert. Quote numbers (`'0.001'`): a YAML float would not keep the bytes you wrote."""
    code_dir: PathText | None = None
    """Kubernetes: a small folder that travels with the job's ConfigMap (the script lies
    in it); without it the script file alone travels. See `k8s.code`."""
    hf_trainer_auto: bool = True
    """A Hugging Face `Trainer` in the script resumes and saves on a preemption without
    shardctl's two-line patch: when `trainer.train()` is given no
    `resume_from_checkpoint`, it gets the newest complete `checkpoint-N` of the
    Trainer's `output_dir`, and shardctl's `PreemptionCallback` is added unless the
    script added it. `false` leaves the Trainer as transformers made it."""

    @field_validator("module")
    @classmethod
    def _module(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 255 or not MODULE_RE.match(v)):
            raise ValueError(
                f"{show(v)} is not a module name; accepted: dotted Python identifiers, "
                "e.g. 'mypkg.train'"
            )
        return v

    @model_validator(mode="after")
    def _one_target(self) -> Entrypoint:
        given = [k for k in ("script", "module") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of script, module (got {' and '.join(given) or 'none'})"
            )
        if self.code_dir is not None and self.script is None:
            raise ValueError("entrypoint.code_dir goes with entrypoint.script, not module")
        return self

    def resolved(self, base: Path) -> Entrypoint:
        """Relative `script` and `code_dir` taken from `base` (the spec file's folder)."""
        update: dict[str, str] = {}
        for key in ("script", "code_dir"):
            value = getattr(self, key)
            if value is not None and not Path(value).is_absolute():
                update[key] = str((base / value).resolve())
        return self.model_copy(update=update) if update else self
