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
import math
import posixpath
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

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
from .rundir import (
    CHECKPOINTS_DIR,
    CONTRACT_ENV,
    LOGS_DIR,
    MODEL_DIR,
    RENDERED_DIR,
    default_checkpoint_dir,
    default_run_dir,
)
from .sizes import MemorySize
from .yamlio import read_yaml_file

# Every bad value a message shows goes through this: repr, cut to a readable length.
_show = SpecError.show_value

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
# Kept for the renderers that still read memory as text (orchestrator/clusters/).
# A pod's CPU: cores (`8`, `0.5`) or whole millicores (`1500m`).
K8S_CPU_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?|[0-9]+(?=m$))(m)?$")
# Control characters in a path end up in #SBATCH lines, log names and YAML; none is
# ever meant (a tab or newline there is a paste accident, a NUL cannot reach open()).
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
PATH_MAX = 4096  # Linux's PATH_MAX: open() refuses longer paths anyway

# ------------------------------------------------------------------------- bounds
# Upper bounds of every count: far above anything a real cluster or model means, low
# enough that a typo (an extra zero run, 1e30) is caught here instead of overflowing a
# Kubernetes int32, a Slurm option or a step folder name on the nodes.

MAX_NODES = 100_000  # the largest machines have tens of thousands of nodes
MAX_PROCS_PER_NODE = 1024  # one rank per GPU or per core; nodes have at most hundreds
MAX_CPUS_PER_PROC = 1024  # more cores than any one machine has
MAX_POD_CPUS = 4096  # k8s.cpu per pod, in cores
# Checkpoint folders are step-NNNNNNNN: eight digits, so resume finds at most this step.
MAX_STEPS = 99_999_999
MAX_BATCH = 65_536  # micro_batch_size and grad_accum
MAX_SEQ_LEN = 16_777_216  # 2**24 tokens; also the bound of llama.max_position_embeddings
MAX_SEED = 2**63 - 1  # torch.manual_seed and the rank re-seeding take a 64-bit seed
MAX_KEEP = 1000  # checkpoints kept
MAX_RETRIES = 1000  # requeues, pod restarts, backoff
MAX_SECONDS = 366 * 86400  # a year: time limits, deadlines, TTLs
MAX_UID = 2**31 - 1  # the largest uid Kubernetes' runAsUser and every Linux tool agree on
MAX_LR = 10.0  # AdamW diverges long before; 1e30 is a typo
MAX_WEIGHT_DECAY = 10.0  # decoupled decay of lr × wd > 1 flips weights' signs every step
MAX_CLIP = 1e6  # a larger norm never clips; 0 is how to say "no clipping"
MAX_ENV_VALUE = 131_072  # Linux's MAX_ARG_STRLEN, the longest one env string

# Variables the launchers set for every rank; a user value would silently make
# every process believe it is the same rank.
RESERVED_ENV = frozenset(
    {
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES", "NPROC_PER_NODE",
        # shardctl's own run-time variables (see orchestrator/launch.py)
        "SHARDCTL_NNODES", "SHARDCTL_NODE_RANK", "SHARDCTL_NPROC_PER_NODE",
        "SHARDCTL_RENDER_DIR",
        # the run contract every rank reads (see orchestrator/rundir.py)
        *CONTRACT_ENV,
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


# Bounded counts; each field's docstring states its range.
Nodes = Annotated[int, Field(gt=0, le=MAX_NODES, strict=True)]
Procs = Annotated[int, Field(gt=0, le=MAX_PROCS_PER_NODE, strict=True)]
Cpus = Annotated[int, Field(gt=0, le=MAX_CPUS_PER_PROC, strict=True)]
Steps = Annotated[int, Field(gt=0, le=MAX_STEPS, strict=True)]
StepsOrZero = Annotated[int, Field(ge=0, le=MAX_STEPS, strict=True)]
Batch = Annotated[int, Field(gt=0, le=MAX_BATCH, strict=True)]
SeqLen = Annotated[int, Field(gt=0, le=MAX_SEQ_LEN, strict=True)]
Retries = Annotated[int, Field(ge=0, le=MAX_RETRIES, strict=True)]
Seconds = Annotated[int, Field(ge=0, le=MAX_SECONDS, strict=True)]
PositiveSeconds = Annotated[int, Field(gt=0, le=MAX_SECONDS, strict=True)]


def _shell_lines(v: list[str]) -> list[str]:
    """`slurm.setup` / `k8s.setup`: one shell line per item (tabs allowed, no newline)."""
    for line in v:
        if CONTROL_RE.search(line.replace("\t", " ")):
            raise ValueError(
                f"{_show(line)}: one shell line per list item, no newlines or other "
                "control characters"
            )
    return v


def _path_text(v: str | None) -> str | None:
    if v is None:
        return v
    if not v.strip():
        raise ValueError(f"{_show(v)} is empty; accepted: a folder or file path")
    if CONTROL_RE.search(v):
        raise ValueError(
            f"{_show(v)} holds a control character (tab, newline, NUL ...); accepted: a "
            "path of printable characters"
        )
    if len(v) > PATH_MAX:
        raise ValueError(
            f"{_show(v)} is longer than {PATH_MAX} characters, the longest path Linux opens"
        )
    return v


# A file or folder path given in the spec: one printable line.
PathText = Annotated[str, AfterValidator(_path_text)]


def _factory_ref(v: str) -> str:
    if not FACTORY_RE.match(v):
        raise ValueError(f"{_show(v)} is not 'package.module:function'")
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
            raise ValueError(f"{_show(v)} is not a ZeRO stage; accepted: 0, 1, 2, 3")
        return v

    @field_validator("wrap")
    @classmethod
    def _wrap(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("an empty list wraps nothing; accepted: 'auto' or class names")
            for name in v:
                if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                    raise ValueError(f"{_show(name)} is not a Python class name")
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


# transformers.LlamaConfig's keyword arguments: name → (type, default), copied here so
# that `validate` and `render` need no transformers (nor the torch it imports).
# tests/test_spec_llama.py rebuilds this table from the installed LlamaConfig and fails
# when the two disagree. Without the check, a typo such as `hiden_size` is swallowed by
# LlamaConfig's **kwargs and the ranks silently build the 6.5B-parameter default.
LLAMA_CONFIG_KEYS: dict[str, tuple[str, Any]] = {
    "vocab_size": ("int", 32000),
    "hidden_size": ("int", 4096),
    "intermediate_size": ("int", 11008),
    "num_hidden_layers": ("int", 32),
    "num_attention_heads": ("int", 32),
    "num_key_value_heads": ("int | None", None),
    "hidden_act": ("str", "silu"),
    "max_position_embeddings": ("int", 2048),
    "initializer_range": ("float", 0.02),
    "rms_norm_eps": ("float", 1e-06),
    "use_cache": ("bool", True),
    "pad_token_id": ("int | None", None),
    "bos_token_id": ("int | None", 1),
    "eos_token_id": ("int | list[int] | None", 2),
    "pretraining_tp": ("int | None", 1),
    "tie_word_embeddings": ("bool", False),
    "rope_parameters": ("dict | None", None),
    "attention_bias": ("bool", False),
    "attention_dropout": ("int | float | None", 0.0),
    "mlp_bias": ("bool", False),
    "head_dim": ("int | None", None),
}
# Keys LlamaConfig's base class still understands and that Llama configs on the Hub
# (config.json) commonly carry: the pre-5.0 RoPE spelling, folded into rope_parameters,
# and the attention kernel. The test proves transformers still honours each one. The
# base class's other keys (architectures, id2label, problem_type, return_dict ...)
# describe a saved checkpoint or a task head, not the model built here: refused.
LLAMA_EXTRA_KEYS: dict[str, tuple[str, Any]] = {
    "rope_theta": ("int | float", 10000.0),
    "rope_scaling": ("dict | None", None),
    "attn_implementation": ("str | None", None),
}
# Understood by LlamaConfig but refused, with the reason.
LLAMA_REFUSED_KEYS: dict[str, str] = {
    key: "the dtype is train.model.dtype (the model is built and cast in it, so a dtype "
    "here would be ignored); set it there"
    for key in ("dtype", "torch_dtype")
}
# Counts: more than any released model's width, depth, vocabulary or context.
LLAMA_COUNTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "head_dim",
    "pretraining_tp",
)  # fmt: skip
LLAMA_MAX_COUNT = MAX_SEQ_LEN
# Numbers with a meaningful range: the test, and the range as messages say it.
LLAMA_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "initializer_range": (lambda x: 0 <= x <= 1, "0 to 1"),  # LlamaConfig's own interval
    "rms_norm_eps": (lambda x: 0 < x <= 1, "more than 0, at most 1"),
    "attention_dropout": (lambda x: 0 <= x < 1, "0 to less than 1"),
    "rope_theta": (lambda x: 0 < x <= 1e12, "more than 0, at most 1e12"),
}


def _llama_type_ok(value: Any, type_text: str) -> bool:
    for alternative in type_text.split(" | "):
        ok = {
            "None": value is None,
            "bool": isinstance(value, bool),
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, int | float) and not isinstance(value, bool),
            "str": isinstance(value, str),
            "dict": isinstance(value, dict),
            "list[int]": isinstance(value, list)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in value),
        }[alternative]
        if ok:
            return True
    return False


def llama_problems(cfg: dict[str, Any]) -> list[str]:
    """Every problem of `train.model.llama`, one line each, each naming its key."""
    accepted = {**LLAMA_CONFIG_KEYS, **LLAMA_EXTRA_KEYS}
    problems: list[str] = []
    for key, value in cfg.items():
        field = f"train.model.llama.{SpecError.show_text(key)}"
        if key in LLAMA_REFUSED_KEYS:
            problems.append(f"{field}: {LLAMA_REFUSED_KEYS[key]}")
            continue
        if key not in accepted:
            hint = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            problems.append(
                f"unknown key {field!r} in train.model.llama (a LlamaConfig){did_you_mean} "
                f"(accepted: {', '.join(sorted(accepted))})"
            )
            continue
        type_text = accepted[key][0]
        if not _llama_type_ok(value, type_text):
            problems.append(
                f"{field}: {_show(value)} is {_type_name(value)}; accepted: {type_text}"
            )
            continue
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{field}: {_show(value)} is not a finite number")
        elif key in LLAMA_COUNTS and value is not None and not 0 < value <= LLAMA_MAX_COUNT:
            problems.append(
                f"{field}: {_show(value)} is not a positive integer of at most "
                f"{LLAMA_MAX_COUNT}; accepted: 1..{LLAMA_MAX_COUNT}"
            )
        elif key in LLAMA_RANGES and value is not None and not LLAMA_RANGES[key][0](value):
            problems.append(
                f"{field}: {_show(value)} is out of range; accepted: {LLAMA_RANGES[key][1]}"
            )
    if problems:
        return problems
    return _llama_shape_problems(cfg)


def _llama_shape_problems(cfg: dict[str, Any]) -> list[str]:
    """Shapes LlamaConfig or the model would reject only on the nodes, with defaults
    filled in: `hidden_size: 100` alone fails against the default 32 heads."""

    def get(key: str) -> Any:
        return cfg[key] if cfg.get(key) is not None else LLAMA_CONFIG_KEYS[key][1]

    def said(key: str) -> str:
        return "" if cfg.get(key) is not None else ", the default"

    problems: list[str] = []
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if hidden % heads:
        problems.append(
            f"train.model.llama.hidden_size ({hidden}{said('hidden_size')}) must be divisible "
            f"by train.model.llama.num_attention_heads ({heads}{said('num_attention_heads')}); "
            "each head gets hidden_size / num_attention_heads dimensions"
        )
    kv = cfg.get("num_key_value_heads")
    if kv is not None and heads % kv:
        problems.append(
            f"train.model.llama.num_attention_heads ({heads}{said('num_attention_heads')}) "
            f"must be divisible by train.model.llama.num_key_value_heads ({kv}) "
            "(grouped-query attention)"
        )
    vocab = get("vocab_size")
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = cfg.get(key)
        for token in value if isinstance(value, list) else [value]:
            if token is not None and not 0 <= token < vocab:
                problems.append(
                    f"train.model.llama.{key}: {token} is not a token id of the vocabulary; "
                    f"accepted: 0..{vocab - 1} (vocab_size {vocab}{said('vocab_size')})"
                )
    return problems


def _type_name(value: Any) -> str:
    """What YAML made of a value, with its article: 'a string', 'an integer'."""
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names.update({list: "a list", dict: "a mapping", type(None): "null"})
    return names.get(type(value), type(value).__name__)


class ModelSource(_Section):
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


class DataSource(_Section):
    """Exactly one of `text`, `tokens`, `builtin`, `factory`."""

    text: PathText | None = None
    """A text file or a folder of them, read as bytes (byte-level tokens: no tokenizer)."""
    tokens: PathText | None = None
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
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    """The schedule's final lr as a fraction of `lr`; 0 to 1."""
    clip: Annotated[float, Field(ge=0, le=MAX_CLIP)] = 1.0
    """Max gradient norm; 0 disables clipping; at most 1e6."""
    seed: Annotated[int, Field(ge=0, le=MAX_SEED, strict=True)] = 0
    """0 to 2**63 - 1 (torch seeds are 64-bit)."""
    log_every: Steps = 1
    """Steps between metric lines; 1 to 99999999."""

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

    dir: PathText | None = None
    """Where `step-NNNNNNNN/` folders go; default `<run_dir>/checkpoints`. May point
    elsewhere (a scratch file system); logs and the model stay in the run dir. Never
    the run dir itself, nor its logs/, model/ or rendered/ folders."""
    every_steps: Steps = 100
    """Steps between periodic checkpoints; 1 to `train.steps`."""
    keep: Annotated[int, Field(ge=2, le=MAX_KEEP, strict=True)] = 3
    """Complete checkpoints kept; 2 to 1000. At least 2: the newest may still be being
    written."""
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
            raise ValueError(
                f"{_show(v)} is empty; accepted: 'auto', 'never' or the path of one "
                "step-NNNNNNNN checkpoint folder"
            )
        _path_text(v)
        return v


# ------------------------------------------------------------------------ logging

TRACKERS = ("tensorboard", "wandb", "mlflow")
Tracker = Literal["tensorboard", "wandb", "mlflow"]
# W&B refuses these in a project name; MLflow takes any experiment name, so one rule
# serves both. 128 characters is W&B's limit for project and run names.
TRACKER_NAME_MAX = 128
TRACKER_NAME_BAD = re.compile(r"[/\\#?%:\x00-\x1f\x7f]")


class Logging(_Section):
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
                f"{_show(sorted(set(seen)))} given more than once; accepted: each of "
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
                f"{_show(v)} cannot name a W&B project or run; accepted: 1-{TRACKER_NAME_MAX} "
                "printable characters without / \\ # ? % :"
            )
        return v

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _tracking_uri(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or CONTROL_RE.search(v) or len(v) > PATH_MAX):
            raise ValueError(
                f"{_show(v)} is not a tracking URI; accepted: e.g. 'sqlite:////abs/mlflow.db', "
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


class Watchdog(_Section):
    """Hang detection: a watchdog beside each node's launcher ends a job whose ranks
    stopped advancing (README: Hangs).

    Every rank writes a heartbeat per step (the built-in loop, the checkpoint library
    of your own script, the Hugging Face callback). When no rank of a node advanced
    for the hang timeout, the node's watchdog writes every rank's Python stack to the
    logs, ends every process and exits 124; Slurm requeues the job (up to
    `slurm.max_requeues`), Kubernetes restarts the pods, and locally `status` says HUNG
    and `submit` resumes."""

    enabled: bool = True
    """`false`: the launcher runs without a watchdog (no heartbeats are read)."""
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


# ------------------------------------------------------------------------ clusters


class LocalCluster(_Section):
    """Settings for `--cluster local` (torchrun on this host)."""

    master_port: Annotated[int, Field(ge=1024, le=65535)] = 29500


# ------------------------------------------------------------ Slurm: sbatch options

# sbatch's long options (Slurm 22.05 to 24.11: `sbatch --help`, `man sbatch`) and how
# each takes its argument: "none" a bare switch (`true` in the spec), "optional" a
# switch or a value, "required" a value. Any other name is a typo or another tool's
# option, which sbatch would only refuse at submission, after the render was trusted.
SBATCH_OPTION_ARGS: dict[str, Literal["none", "optional", "required"]] = {
    **dict.fromkeys(
        (
            "contiguous", "hold", "ignore-pbs", "no-requeue", "overcommit", "oversubscribe",
            "parsable", "quiet", "reboot", "requeue", "spread-job", "test-only",
            "use-min-nodes", "verbose", "wait",
        ),
        "none",
    ),
    **dict.fromkeys(
        ("exclusive", "export", "get-user-env", "nice", "no-kill", "propagate", "wrap"),
        "optional",
    ),
    **dict.fromkeys(
        (
            "account", "acctg-freq", "array", "batch", "bb", "bbf", "begin", "chdir",
            "cluster-constraint", "clusters", "comment", "constraint", "container",
            "container-id", "core-spec", "cores-per-socket", "cpu-freq", "cpus-per-gpu",
            "cpus-per-task", "deadline", "delay-boot", "dependency", "distribution", "error",
            "exclude", "export-file", "extra", "extra-node-info", "gid", "gpu-bind",
            "gpu-freq", "gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres",
            "gres-flags", "hint", "input", "job-name", "kill-on-invalid-dep", "licenses",
            "mail-type", "mail-user", "mcs-label", "mem", "mem-bind", "mem-per-cpu",
            "mem-per-gpu", "mincpus", "network", "nodefile", "nodelist", "nodes", "ntasks",
            "ntasks-per-core", "ntasks-per-gpu", "ntasks-per-node", "ntasks-per-socket",
            "open-mode", "output", "partition", "power", "prefer", "priority", "profile",
            "qos", "reservation", "signal", "sockets-per-node", "switches", "thread-spec",
            "threads-per-core", "time", "time-min", "tmp", "tres-bind", "tres-per-task",
            "uid", "wait-all-nodes", "wckey",
        ),
        "required",
    ),
}  # fmt: skip
_TASKS = (
    "resources.procs_per_node (shardctl runs one Slurm task per node, and that task's "
    "launcher starts the node's ranks)"
)
_CPUS = "resources.cpus_per_proc (--cpus-per-task is procs_per_node × cpus_per_proc)"
# Options shardctl sets itself, or that would break what it relies on: where to say
# the same thing in the spec instead (or why it cannot be said).
SBATCH_OWNED: dict[str, str] = {
    "nodes": "resources.nodes",
    **dict.fromkeys(
        ("ntasks", "ntasks-per-node", "ntasks-per-core", "ntasks-per-socket", "ntasks-per-gpu"),
        _TASKS,
    ),
    "cpus-per-task": _CPUS,
    "cpus-per-gpu": _CPUS + "; Slurm refuses --cpus-per-gpu beside --cpus-per-task",
    "mem": "resources.memory",
    **dict.fromkeys(
        ("gpus", "gpus-per-node"),
        "resources.procs_per_node with resources.device: cuda (one GPU per rank), or slurm.gres",
    ),
    **{k: f"slurm.{k}" for k in ("partition", "account", "qos", "constraint", "gres", "time")},
    "exclusive": "slurm.exclusive",
    "signal": "slurm.signal and slurm.signal_delay_s",
    **dict.fromkeys(
        ("requeue", "no-requeue"),
        "slurm.max_requeues (shardctl always submits with --requeue and requeues the job "
        "itself after the ranks saved)",
    ),
    "job-name": "name",
    **dict.fromkeys(
        ("output", "error", "open-mode"),
        "nothing: shardctl writes every node's output into the run directory",
    ),
    "array": "one spec per run (a job array would start every task from one run directory)",
    "chdir": "run_dir (shardctl's files and the ranks' paths are laid out from it)",
    "export": "env for the ranks' variables (the nodes need the submitting environment: "
    "PATH, the Python that runs shardctl)",
    "wrap": "nothing: shardctl writes the batch script itself",
    "test-only": "nothing: shardctl submit asks sbatch --test-only itself first, and "
    "shardctl submit --dry-run shows the script",
    **dict.fromkeys(
        ("parsable", "quiet"),
        "nothing: shardctl reads the job id from sbatch's 'Submitted batch job N' line",
    ),
    "wait": "shardctl status / shardctl logs -f (shardctl submit returns once Slurm took the job)",
    "clusters": "nothing: shardctl follows the job on this cluster (scontrol, sacct); run "
    "shardctl on the other cluster's login node",
    **dict.fromkeys(
        ("container", "container-id"),
        "slurm.container (pyxis and enroot); Slurm's own OCI --container is not supported",
    ),
}  # fmt: skip
# pyxis adds these to srun (and to sbatch, where they would apply to the batch shell).
PYXIS_OPTIONS = frozenset(
    {
        "container-image", "container-mounts", "container-workdir", "container-name",
        "container-mount-home", "no-container-mount-home", "container-writable",
        "container-readonly", "container-env", "container-remap-root",
        "no-container-remap-root", "container-save", "container-entrypoint",
        "no-container-entrypoint",
    }
)  # fmt: skip
SBATCH_ACCEPTED = sorted(k for k in SBATCH_OPTION_ARGS if k not in SBATCH_OWNED)
SBATCH_VALUE_MAX = 4096  # far above any host list or comment; a pasted file is a mistake
MAIL_TYPES = frozenset(
    {
        "NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT",
        "TIME_LIMIT", "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS",
    }
)  # fmt: skip
NICE_MAX = 2147483645  # sbatch's bound on --nice, either sign


def sbatch_option_problem(name: str, value: Any) -> str | None:
    """Why `slurm.sbatch_options.<name>: <value>` cannot be sent, or None when it can."""
    if name.startswith("-"):
        return f"write the option name without dashes: {name.lstrip('-')!r}"
    if name in SBATCH_OWNED:
        return f"--{name} is shardctl's to set; use {SBATCH_OWNED[name]}"
    if name in PYXIS_OPTIONS:
        return (
            f"--{name} is a pyxis option for the ranks' srun, not sbatch; use slurm.container "
            "(rendered into the srun line)"
        )
    if name not in SBATCH_OPTION_ARGS:
        spelled = name.replace("_", "-").lower()
        hint = [spelled] if spelled in SBATCH_ACCEPTED else []
        hint = hint or difflib.get_close_matches(name, SBATCH_ACCEPTED, n=1, cutoff=0.6)
        did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
        return (
            f"not an sbatch option{did_you_mean} (accepted: sbatch's long option names "
            f"without '--': {', '.join(SBATCH_ACCEPTED)})"
        )
    takes = SBATCH_OPTION_ARGS[name]
    if value is True:
        if takes == "required":
            return f"true: --{name} needs a value, e.g. {name}: <value>"
        return None
    if value is False or value is None:
        return f"{_show(value)}: leave the key out to leave --{name} out"
    if takes == "none":
        return f"{_show(value)}: --{name} is a switch without a value; accepted: true"
    if isinstance(value, int):
        value = str(value)
    if not isinstance(value, str):
        switch = ", or true for the bare switch" if takes == "optional" else ""
        return (
            f"{_show(value)} is {_type_name(value)}; accepted: a string or an integer{switch} "
            "(quote other numbers: '1.5')"
        )
    if not value.strip() or CONTROL_RE.search(value):
        return (
            f"{_show(value)} is not one line of printable text; accepted: text without "
            "newlines, tabs or other control characters, not empty"
        )
    if len(value) > SBATCH_VALUE_MAX:
        return f"{_show(value)} is longer than {SBATCH_VALUE_MAX} characters"
    if name == "nice" and not (
        re.fullmatch(r"[+-]?\d{1,10}", value) and abs(int(value)) <= NICE_MAX
    ):
        return f"{_show(value)} is not a nice adjustment; accepted: an integer, ±{NICE_MAX}"
    if name == "mail-type":
        bad = [t for t in value.split(",") if t.strip().upper() not in MAIL_TYPES]
        if bad:
            return (
                f"{_show(value)}: {', '.join(map(repr, bad))} is no mail type; accepted: a "
                f"comma-separated list of {', '.join(sorted(MAIL_TYPES))}"
            )
    return None


def _sbatch_option(item: Any) -> Any:
    # The value arrives with its name (see SlurmCluster._sbatch_named), so that pydantic
    # places the error at slurm.sbatch_options.<name>; the value alone is kept.
    name, value = item
    problem = sbatch_option_problem(name, value)
    if problem is not None:
        raise ValueError(problem)
    return value


SbatchOptionValue = Annotated[Any, AfterValidator(_sbatch_option)]


# ------------------------------------------------------------- Slurm: pyxis container

# enroot's mount flags, joined with '+' in pyxis (`ro+rprivate`).
PYXIS_MOUNT_FLAGS = frozenset(
    {
        "ro", "rw", "bind", "rbind", "private", "rprivate", "slave", "rslave", "shared",
        "rshared", "nosuid", "nodev", "noexec", "x-create=dir", "x-create=file",
        "x-create=auto",
    }
)  # fmt: skip


class PyxisMount(BaseModel):
    """One `slurm.container.mounts` entry, parsed: `SRC[:DST[:FLAGS]]`."""

    model_config = ConfigDict(frozen=True)
    source: str
    target: str
    flags: str = ""

    @classmethod
    def parse(cls, text: str) -> PyxisMount:
        """Raise ValueError (naming the entry and what is accepted) when `text` is not one."""
        accepted = (
            "accepted: 'SRC:DST', 'SRC:DST:ro' or 'PATH' (the same path inside), absolute "
            "paths without ',' or ':', flags among " + ", ".join(sorted(PYXIS_MOUNT_FLAGS))
        )
        parts = text.split(":")
        if (
            len(parts) > 3
            or not text
            or "," in text
            or re.search(r"\s", text)
            or CONTROL_RE.search(text)
        ):
            raise ValueError(f"{_show(text)} is not a pyxis mount; {accepted}")
        source, target = parts[0], parts[1] if len(parts) > 1 else parts[0]
        flags = parts[2] if len(parts) > 2 else ""
        for path in (source, target):
            if not path.startswith("/") or len(path) > PATH_MAX:
                raise ValueError(f"{_show(text)}: {path!r} is not an absolute path; {accepted}")
        bad = [f for f in flags.split("+") if flags and f not in PYXIS_MOUNT_FLAGS]
        if bad or (len(parts) == 3 and not flags):
            raise ValueError(f"{_show(text)}: unknown mount flag {bad or ['']}; {accepted}")
        return cls(
            source=posixpath.normpath(source), target=posixpath.normpath(target), flags=flags
        )

    @property
    def read_only(self) -> bool:
        return "ro" in self.flags.split("+")

    def text(self) -> str:
        return ":".join([self.source, self.target, *([self.flags] if self.flags else [])])


class SlurmContainer(_Section):
    """`slurm.container`: every node's launcher runs in this image through pyxis (the
    Slurm plugin that runs enroot containers); rendered into the `srun` line as
    `--container-image` and friends. The batch shell itself stays on the host."""

    image: str
    """`[USER@][REGISTRY#]IMAGE[:TAG]` (enroot's form: `nvcr.io#nvidia/pytorch:24.05-py3`)
    or the path of a squashfs file. It must hold shardctl (with the `slurm` extra for
    `shardctl submit`) and its `python3` on PATH."""
    mounts: list[str] = Field(default_factory=list)
    """`SRC:DST[:FLAGS]` or `PATH` (the same path inside), e.g. `/data:/data:ro`. The run
    directory and the checkpoint directory are added at their own paths unless a mount
    covers them."""
    workdir: str | None = None
    """The working directory inside the container (`--container-workdir`)."""
    mount_home: bool | None = None
    """true/false: `--container-mount-home` / `--no-container-mount-home`; default the
    site's enroot setting."""
    writable: bool | None = None
    """true/false: `--container-writable` / `--container-readonly`; default the site's."""
    env: list[str] = Field(default_factory=list)
    """Variables whose host value wins over the image's (`--container-env`)."""

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not v or re.search(r"\s", v) or CONTROL_RE.search(v) or "," in v:
            raise ValueError(
                f"{_show(v)} is not an image reference; accepted: one word such as "
                "'nvcr.io#nvidia/pytorch:24.05-py3' or '/shared/images/torch.sqsh'"
            )
        first = v.split("@", 1)[-1].split("/", 1)[0]
        if "/" in v and not v.startswith("/") and "#" not in v and re.search(r"[.:]", first):
            # enroot reads `host/name` as a Docker Hub image named `host/name`.
            fixed = v.replace("/", "#", 1)
            raise ValueError(
                f"{_show(v)}: enroot separates the registry with '#'; accepted: {fixed!r}"
            )
        return v

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        targets: dict[str, str] = {}
        for text in v:
            mount = PyxisMount.parse(text)
            if mount.target in targets:
                raise ValueError(
                    f"{_show(text)} and {targets[mount.target]!r} mount the same path "
                    f"{mount.target!r}; accepted: one mount per path"
                )
            targets[mount.target] = text
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        if v is not None:
            _path_text(v)
            if not v.startswith("/") or re.search(r"\s", v):
                raise ValueError(f"{_show(v)} is not an absolute path without spaces")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: list[str]) -> list[str]:
        for name in v:
            if not ENV_NAME_RE.match(name):
                raise ValueError(f"{_show(name)} is not an environment variable name")
        return v

    def parsed_mounts(self) -> list[PyxisMount]:
        return [PyxisMount.parse(m) for m in self.mounts]


class SlurmCluster(_Section):
    """Settings for `--cluster slurm` (through submitit)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"
    """Slurm's --time: `M`, `H:M:S`, `D-H:M:S` ...; more than zero, at most 366 days."""
    signal: Literal["USR2", "USR1", "TERM", "INT"] = "USR2"
    """Sent before the time limit (and by `scancel --signal`); USR1 is NCCL's."""
    signal_delay_s: Annotated[int, Field(ge=10, le=65535)] = 120
    """Seconds before the time limit at which the signal is sent; 10 to 65535."""
    constraint: str | None = None
    gres: str | None = None
    """Generic resources per node, e.g. `gpu:8`; default derived from device/procs."""
    exclusive: bool = False
    setup: list[str] = Field(default_factory=list)
    """Shell lines run on every node before the launcher (module load, venv ...)."""
    srun_args: list[str] = Field(default_factory=list)
    """Extra words for srun, e.g. `--cpu-bind=none`."""
    max_requeues: Retries = 10
    """Requeues after preemption or time-out; 0 to 1000."""
    master_port: Annotated[int, Field(ge=1024, le=65535)] = 29500
    sbatch_options: dict[str, SbatchOptionValue] = Field(default_factory=dict)
    """More `#SBATCH` options: sbatch's long names without `--` → a value (string or
    integer), or `true` for a switch (`reservation: maint`, `exclude: node[01-03]`,
    `mail-type: END,FAIL`, `hold: true`). Options the spec says elsewhere are refused
    with the field to use. Sent as submitit's `additional_parameters` and written into
    `job.sbatch`."""
    container: SlurmContainer | None = None
    """Run every node's launcher in a container through pyxis (see `SlurmContainer`)."""

    @field_validator("sbatch_options", mode="before")
    @classmethod
    def _sbatch_named(cls, v: Any) -> Any:
        # Each value travels with its name to `_sbatch_option`, so that an error is
        # placed at slurm.sbatch_options.<name> (pydantic places a value by its key).
        if not isinstance(v, dict):
            return v
        for key in v:
            if not isinstance(key, str):
                raise ValueError(
                    f"key {_show(key)} is {_type_name(key)}; accepted: sbatch's long option "
                    "names, e.g. reservation, exclude, comment"
                )
        return {key: (key, value) for key, value in v.items()}

    @model_validator(mode="after")
    def _one_container(self) -> SlurmCluster:
        pyxis = [w for w in self.srun_args if w.startswith(("--container-", "--no-container-"))]
        if self.container is not None and pyxis:
            raise ValueError(
                f"srun_args {', '.join(map(repr, pyxis))} and container both set pyxis "
                "options; accepted: the container section alone (it renders them)"
            )
        return self

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        minutes = slurm_time_minutes(v)
        if minutes is None:
            raise ValueError(
                f"{_show(v)} is not a Slurm time; accepted: M, M:S, H:M:S, D-H, D-H:M, "
                "D-H:M:S (e.g. '90', '04:00:00', '2-00:00:00'), more than zero"
            )
        if minutes * 60 > MAX_SECONDS:
            raise ValueError(
                f"{_show(v)} is more than 366 days, the longest time limit shardctl accepts"
            )
        return v

    @field_validator("partition", "account", "qos", "constraint", "gres")
    @classmethod
    def _no_space(cls, v: str | None) -> str | None:
        if v is not None and (not v or re.search(r"\s", v) or CONTROL_RE.search(v)):
            raise ValueError(f"{_show(v)} must be one non-empty word without spaces")
        return v

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        return _shell_lines(v)

    @field_validator("srun_args")
    @classmethod
    def _srun_args(cls, v: list[str]) -> list[str]:
        for word in v:
            if CONTROL_RE.search(word):
                raise ValueError(f"{_show(word)}: an srun word holds no control characters")
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
    toleration_seconds: Seconds | None = Field(default=None, alias="tolerationSeconds")
    """Seconds a NoExecute taint is tolerated; 0 to 31622400 (a year)."""


class Elastic(_Section):
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
# Where shardctl mounts its own volumes in every pod (see clusters/k8s/objects.py).
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
            f"{_show(key)} is not a Kubernetes {what} key; accepted: an optional DNS prefix "
            "and '/', then 1-63 letters, digits, '-', '_' or '.', starting and ending "
            "alphanumeric (e.g. 'kueue.x-k8s.io/queue-name')"
        )


class LabelSelectorRequirement(_Section):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)


class LabelSelector(_Section):
    match_labels: dict[str, str] = Field(default_factory=dict, alias="matchLabels")
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, alias="matchExpressions"
    )


class NodeSelectorRequirement(_Section):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[str] = Field(default_factory=list)


class NodeSelectorTerm(_Section):
    match_expressions: list[NodeSelectorRequirement] = Field(
        default_factory=list, alias="matchExpressions"
    )
    match_fields: list[NodeSelectorRequirement] = Field(default_factory=list, alias="matchFields")


class NodeSelector(_Section):
    node_selector_terms: list[NodeSelectorTerm] = Field(alias="nodeSelectorTerms", min_length=1)


Weight = Annotated[int, Field(ge=1, le=100, strict=True)]


class PreferredNodeTerm(_Section):
    weight: Weight
    """1 to 100."""
    preference: NodeSelectorTerm


class NodeAffinity(_Section):
    required: NodeSelector | None = Field(
        default=None, alias="requiredDuringSchedulingIgnoredDuringExecution"
    )
    preferred: list[PreferredNodeTerm] = Field(
        default_factory=list, alias="preferredDuringSchedulingIgnoredDuringExecution"
    )


class PodAffinityTerm(_Section):
    topology_key: str = Field(alias="topologyKey", min_length=1)
    label_selector: LabelSelector | None = Field(default=None, alias="labelSelector")
    namespace_selector: LabelSelector | None = Field(default=None, alias="namespaceSelector")
    namespaces: list[str] = Field(default_factory=list)
    match_label_keys: list[str] = Field(default_factory=list, alias="matchLabelKeys")
    mismatch_label_keys: list[str] = Field(default_factory=list, alias="mismatchLabelKeys")


class WeightedPodAffinityTerm(_Section):
    weight: Weight
    """1 to 100."""
    pod_affinity_term: PodAffinityTerm = Field(alias="podAffinityTerm")


class PodAffinity(_Section):
    required: list[PodAffinityTerm] = Field(
        default_factory=list, alias="requiredDuringSchedulingIgnoredDuringExecution"
    )
    preferred: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, alias="preferredDuringSchedulingIgnoredDuringExecution"
    )


class Affinity(_Section):
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


class ExtraVolume(_Section):
    """One more volume in every pod, mounted at `mount_path`: exactly one source of
    `pvc`, `config_map`, `secret`, `host_path`, `nfs` or `empty_dir`."""

    name: str
    mount_path: str
    read_only: bool = False
    sub_path: str | None = None
    pvc: str | None = None
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
                f"{_show(v)} is not a volume name; accepted: 1-63 lower-case letters, digits "
                "and '-', starting and ending alphanumeric"
            )
        if v in K8S_OWN_VOLUMES:
            raise ValueError(
                f"{_show(v)} is a volume shardctl mounts itself; accepted: any other name "
                f"(taken: {', '.join(K8S_OWN_VOLUMES)})"
            )
        return v

    @field_validator("mount_path", "host_path")
    @classmethod
    def _abs_path(cls, v: str | None) -> str | None:
        if v is None:
            return v
        _path_text(v)
        if not v.startswith("/") or ":" in v:
            raise ValueError(f"{_show(v)} is not an absolute path without ':'")
        return v

    @field_validator("mount_path")
    @classmethod
    def _not_ours(cls, v: str) -> str:
        norm = posixpath.normpath(v)
        for own in K8S_OWN_MOUNTS:
            if norm == own or norm.startswith(own + "/") or own.startswith(norm + "/"):
                raise ValueError(
                    f"{_show(v)} overlaps {own}, where shardctl mounts its own volume; "
                    "accepted: any other absolute path"
                )
        if norm == "/":
            raise ValueError(f"{_show(v)} would hide the image's root file system")
        return norm

    @field_validator("pvc", "config_map", "secret")
    @classmethod
    def _object_name(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 253 or not DNS_SUBDOMAIN_RE.match(v)):
            raise ValueError(
                f"{_show(v)} is not a Kubernetes name; accepted: lower-case letters, "
                "digits, '-' and '.', starting and ending alphanumeric"
            )
        return v

    @field_validator("nfs")
    @classmethod
    def _nfs(cls, v: str | None) -> str | None:
        if v is not None:
            server, sep, path = v.partition(":")
            if not sep or not server or not path.startswith("/") or re.search(r"\s", v):
                raise ValueError(
                    f"{_show(v)} is not an NFS export; accepted: 'server:/export/path'"
                )
        return v

    @field_validator("sub_path")
    @classmethod
    def _sub_path(cls, v: str | None) -> str | None:
        if v is not None:
            _path_text(v)
            if v.startswith("/") or ".." in v.split("/"):
                raise ValueError(
                    f"{_show(v)} is not a relative path inside the volume (no leading '/', no '..')"
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


class K8sCluster(_Section):
    """Settings for `--cluster k8s`: a Kubeflow PyTorchJob or a Kubeflow Trainer v2 TrainJob."""

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
    image_pull_secrets: list[str] = Field(default_factory=list)
    service_account: str = "shardctl-trainer"
    pvc: str | None = None
    """PersistentVolumeClaim mounted at the run directory, so restarted pods resume."""
    cpu: str | None = None
    """CPU request/limit per pod: cores (`8`, `0.5`) or millicores (`1500m`), more than 0
    and at most 4096 cores; default procs_per_node × cpus_per_proc."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    priority_class: str | None = None
    restart_policy: Literal["OnFailure", "ExitCode", "Never", "Always"] = "OnFailure"
    """The PyTorchJob's replica restart policy. `OnFailure` restarts a pod after a
    preemption (exit 42 → torchrun's 1) and a hang (the watchdog's 124); under
    `ExitCode` the operator restarts only 128-255 and counts both as permanent."""
    backoff_limit: Retries = 6
    """Pod restarts before the job fails; 0 to 1000."""
    clean_pod_policy: Literal["None", "All", "Running"] = "None"
    ttl_seconds_after_finished: Seconds | None = None
    """0 to 31622400 (a year)."""
    active_deadline_seconds: PositiveSeconds | None = None
    """1 to 31622400 (a year)."""
    suspend: bool = False
    elastic: Elastic | None = None
    env_from_config_maps: list[str] = Field(default_factory=list)
    env_from_secrets: list[str] = Field(default_factory=list)
    shm_size: MemorySize = MemorySize("1Gi")
    """Size of the in-memory /dev/shm for dataloader workers; 1Mi to 1Pi, see `memory`."""
    run_as_user: Annotated[int, Field(gt=0, le=MAX_UID, strict=True)] = 1000
    """1 to 2147483647 (root, uid 0, is refused: pods run as non-root)."""
    read_only_root_filesystem: bool = True
    master_port: Annotated[int, Field(ge=1024, le=65535)] = 23456
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
                    f"{_show(name)} is not a Kubernetes name; accepted: lower-case letters, "
                    "digits, '-' and '.', starting and ending alphanumeric"
                )
        return v

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        # A namespace is a DNS-1123 *label*: unlike most object names, no dots.
        if len(v) > 63 or not NAME_RE.match(v):
            raise ValueError(
                f"{_show(v)} is not a Kubernetes namespace; accepted: 1-63 lower-case letters, "
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
                f"{_show(v)} is not a Kubernetes CPU quantity; accepted: cores ('8', '0.5') "
                "or millicores ('1500m')"
            )
        cores = float(m.group(1)) / (1000 if m.group(2) else 1)
        if not 0 < cores <= MAX_POD_CPUS:
            raise ValueError(
                f"{_show(v)} is {'zero' if cores == 0 else 'more than the most shardctl accepts'}"
                f"; accepted: more than 0, at most {MAX_POD_CPUS} cores"
            )
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and (not v or re.search(r"\s", v) or CONTROL_RE.search(v)):
            raise ValueError(f"{_show(v)} is not an image reference")
        return v

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        return _shell_lines(v)

    @field_validator("runtime", "scheduler_name")
    @classmethod
    def _runtime(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 63 or not NAME_RE.match(v)):
            raise ValueError(
                f"{_show(v)} is not a Kubernetes name; accepted: 1-63 lower-case letters, "
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
                    f"label {key}: {_show(value)} is not a label value; accepted: a string "
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
                f"{_show(v)} is not an extended resource name; accepted: 'domain/name', "
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
    def _api_fields(self) -> K8sCluster:
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


# ------------------------------------------------------------------------ the spec


MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
MAX_ARGS = 4096


class Entrypoint(_Section):
    """Your own training script instead of the built-in loop: exactly one of `script`
    and `module`, plus `args`.

    Every rank runs it under the spec's launcher (torchrun, accelerate launch,
    deepspeed) with the run contract in its environment (README: "Your own training
    script")."""

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

    @field_validator("module")
    @classmethod
    def _module(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 255 or not MODULE_RE.match(v)):
            raise ValueError(
                f"{_show(v)} is not a module name; accepted: dotted Python identifiers, "
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


class JobSpec(_Section):
    """One training job: what to train, how to shard it, where to run it."""

    name: str
    """1-50 lower-case letters, digits and '-': a Slurm job name and a Kubernetes name."""
    run_dir: PathText | None = None
    """The run's own folder: rendered files, logs, markers, `model/`; default `runs/<name>`.
    A path of printable characters, at most 4096 of them, not the file system root."""
    resources: Resources = Field(default_factory=Resources)
    launcher: Literal["torchrun", "accelerate", "deepspeed"] = "torchrun"
    strategy: Strategy = Field(default_factory=Strategy)
    train: Train | None = None
    """The built-in loop; a spec has `train` or `entrypoint`, never both."""
    entrypoint: Entrypoint | None = None
    """Your own training script (see `Entrypoint`)."""
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    logging: Logging = Field(default_factory=Logging)
    """Metrics trackers beside `logs/metrics.jsonl` (see `Logging`)."""
    watchdog: Watchdog = Field(default_factory=Watchdog)
    """Hang detection and the collectives' timeout (see `Watchdog`)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of every rank; values of at most 131072 characters (Linux's
    MAX_ARG_STRLEN: execve refuses a longer variable)."""
    local: LocalCluster = Field(default_factory=LocalCluster)
    slurm: SlurmCluster = Field(default_factory=SlurmCluster)
    k8s: K8sCluster = Field(default_factory=K8sCluster)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if len(v) > NAME_MAX or not NAME_RE.match(v):
            raise ValueError(
                f"{_show(v)} cannot be a Slurm job and Kubernetes name; accepted: 1-{NAME_MAX} "
                "lower-case letters, digits and '-', starting and ending with a letter or digit"
            )
        return v

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, v: str | None) -> str | None:
        if v is not None and posixpath.normpath(v) in ("/", "//"):
            raise ValueError(
                f"{_show(v)} is the file system root; accepted: a folder of the run's own, "
                "e.g. 'runs/<name>' (the default)"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        # Checked once for the whole spec: no argument, environment variable or file
        # name can carry a NUL, and one would surface as a traceback on the nodes.
        problems = [
            f"{path or 'spec'}: {_show(value)} holds a NUL character; accepted: text "
            "without NUL ('\\0')"
            for path, value in _strings(data, "")
            if "\x00" in value
        ]
        if problems:
            raise ValueError("\n".join(problems[: SpecError.MAX_PROBLEMS]))
        return data

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out: dict[str, Any] = {}
        for key, value in v.items():
            if not isinstance(key, str) or not ENV_NAME_RE.match(key):
                raise ValueError(f"{_show(key)} is not an environment variable name")
            if key in RESERVED_ENV:
                raise ValueError(
                    f"{key} is set by the launcher for every rank and cannot be set in env"
                )
            if isinstance(value, bool):
                value = "1" if value else "0"
            elif isinstance(value, int | float):
                value = str(value)
            if isinstance(value, str) and len(value) > MAX_ENV_VALUE:
                raise ValueError(
                    f"{key}: {_show(value)} is longer than {MAX_ENV_VALUE} characters, the "
                    "longest environment variable Linux passes to a process"
                )
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
        if (t is None) == (self.entrypoint is None):
            problems.append(
                "give exactly one of train (the built-in loop) and entrypoint (your own "
                f"script); got {'both' if t is not None else 'neither'}"
            )
        if self.k8s.code == "configmap" and (self.entrypoint is None or not self.entrypoint.script):
            problems.append(
                "k8s.code 'configmap' ships entrypoint.script (or entrypoint.code_dir) to the "
                "pods; accepted without a script: image (a module must be in the image)"
            )
        if t is not None and c.every_steps > t.steps:
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
        run_dir = self.run_dir if self.run_dir is not None else default_run_dir(self.name)
        if c.dir is not None:
            problems.extend(_checkpoint_dir_problems(c.dir, run_dir))
        if problems:
            raise ValueError("\n".join(problems))
        _set(self, "run_dir", run_dir)
        if c.dir is None:
            _set(c, "dir", default_checkpoint_dir(run_dir))
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
        data = self.model_dump(mode="json", by_alias=True)
        # Only the workload the spec has: a built-in spec's job.yaml stays as it was.
        for key in ("train", "entrypoint"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


def _checkpoint_dir_problems(ckpt_dir: str, run_dir: str) -> list[str]:
    """checkpoint.dir may be anywhere except on top of the run dir's own files: retention
    deletes old step folders there, and the run dir's logs/, model/ and rendered/ must
    not hold step folders that resume would read."""
    ckpt, run = posixpath.normpath(ckpt_dir), posixpath.normpath(run_dir)
    taken = {run: "the run directory itself (run_dir)"}
    for sub in (LOGS_DIR, MODEL_DIR, RENDERED_DIR):
        taken[posixpath.join(run, sub)] = f"the run directory's {sub}/ folder"
    if ckpt in taken:
        default = posixpath.join(run, CHECKPOINTS_DIR)
        return [
            f"checkpoint.dir {_show(ckpt_dir)} is {taken[ckpt]}; accepted: a folder of its "
            f"own, e.g. {default!r} (the default) or one on a scratch file system"
        ]
    return []


def _strings(data: Any, path: str) -> list[tuple[str, str]]:
    """Every string in plain YAML data (keys too), with its dotted path."""
    found: list[tuple[str, str]] = []
    if isinstance(data, str):
        found.append((path, data))
    elif isinstance(data, dict):
        for key, value in data.items():
            name = _key_text(key)
            sub = f"{path}.{name}" if path else name
            if isinstance(key, str):
                found.append((sub, key))
            found.extend(_strings(value, sub))
    elif isinstance(data, list):
        for i, item in enumerate(data):
            found.extend(_strings(item, f"{path}[{i}]"))
    return found


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


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> JobSpec:
    """Read and validate a YAML job spec file, after the command line's `--set
    KEY.PATH=VALUE` overrides (see `orchestrator/overrides.py`).

    An entrypoint's relative script path is taken from the spec file's folder, as a
    user reads it, whatever the current directory."""
    from .overrides import apply_overrides

    data = apply_overrides(read_yaml_file(path), overrides)
    source = str(path) + (f" with --set {' '.join(overrides)}" if overrides else "")
    spec = parse_spec(data, source)
    if spec.entrypoint is not None:
        resolved = spec.entrypoint.resolved(Path(path).resolve().parent)
        if resolved is not spec.entrypoint:
            spec = spec.model_copy(update={"entrypoint": resolved})
    return spec


def with_command(spec: JobSpec, words: list[str] | tuple[str, ...]) -> JobSpec:
    """The spec with its workload replaced by a command line, as `shardctl submit SPEC --
    SCRIPT [ARGS...]` (or `-- -m MODULE [ARGS...]`) reads, the way torchrun does.

    The built-in loop's `train` section gives way to the entrypoint; everything else
    (resources, strategy, checkpoint, clusters) stays. A relative script is taken
    from the current directory, as on any command line."""
    words = list(words)
    if not words:
        return spec
    if words[0] == "-m":
        if len(words) < 2:
            raise SpecError(["after --: -m needs a module name, e.g. -- -m mypkg.train"])
        entrypoint: dict[str, Any] = {"module": words[1], "args": words[2:]}
    else:
        entrypoint = {"script": str(Path(words[0]).resolve()), "args": words[1:]}
    data = spec.to_yaml_dict()
    data.pop("train", None)
    old = data.get("entrypoint") or {}
    if old.get("code_dir") and "script" in entrypoint:
        entrypoint["code_dir"] = old["code_dir"]
    data["entrypoint"] = entrypoint
    return parse_spec(data, source="the command after --")


def _explain(exc: ValidationError, data: Any) -> list[str]:
    """Turn pydantic's errors into one line each: field, value (shown once), what is
    accepted."""
    problems: list[str] = []
    for err in exc.errors(include_url=False):
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        field = _dotted(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            parent, key = loc[:-1], loc[-1]
            allowed = _allowed_keys(parent)
            hint = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
            where = _dotted(parent) or "the top level"
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            # A plain path is quoted; one holding a cut or odd key is quoted inside already.
            named = repr(field) if field.isprintable() and "'" not in field else field
            problems.append(
                f"unknown key {named} in {where}{did_you_mean} "
                f"(accepted: {', '.join(sorted(allowed))})"
            )
            continue
        if kind == "invalid_key":
            # YAML made the key a number, null or boolean (`5:`, `~:`, `yes:`).
            parent, key = loc[:-1], err.get("input", loc[-1] if loc else None)
            where = _dotted(parent) or "the top level"
            problems.append(
                f"key {_show(key)} in {where} is {_type_name(key)}; accepted: keys that are "
                "names (quote it if it is one)"
            )
            continue
        if kind == "missing":
            problems.append(f"{field}: required but missing")
            continue
        value = err.get("input")
        shown = _show(value)
        ctx = err.get("ctx") or {}
        if kind in ("less_than_equal", "less_than") and not isinstance(value, bool):
            most = ctx.get("le", ctx.get("lt"))
            limit = "the most" if kind == "less_than_equal" else "more than the most"
            problems.append(f"{field}: {shown} is more than {most}, {limit} shardctl accepts")
            continue
        msg = err["msg"]
        ours = msg.startswith(("Value error, ", "Assertion failed, "))
        if ours:
            msg = msg.split(", ", 1)[1]
            # Cross-field checks already name their fields; one line each.
            if not loc or msg.startswith(
                ("strategy.", "checkpoint.", "launcher", "train.", "k8s.", "resources.",
                 "unknown key ")
            ):  # fmt: skip
                problems.extend(msg.split("\n"))
                continue
        # The value once: our own validators show it (or the bad item of a list) in
        # their sentence; pydantic's messages never do; a whole section is not printed.
        got = "" if ours or isinstance(value, dict) else f" (got {shown})"
        problems.append(f"{field or 'spec'}: {msg}{got}")
    return problems


def _dotted(loc: list[Any] | tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = _key_text(part)
            out += f".{text}" if out else text
    return out


def _key_text(key: Any) -> str:
    """A mapping key as part of a dotted path: as written when it is a short printable
    word, else its repr, cut to a readable length."""
    text = str(key)
    if isinstance(key, str) and text.isprintable() and len(text) <= SpecError.MAX_VALUE_CHARS:
        return text
    return _show(key)


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
