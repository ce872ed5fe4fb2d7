"""What every spec section is built from: the `Section` base (frozen, unknown keys
refused), the bounds of every count, the field types shared by the core sections and
the clusters' own, and how a bad value is shown in a message.

A cluster's section (its package's `section.py`, or one outside this repository)
builds on these, so that its fields read and fail like the core's.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from ..errors import SpecError
from ..rundir import CONTRACT_ENV
from ..yamlio import Base60Int

# Every bad value a message shows goes through this: repr, cut to a readable length.
show = SpecError.show_value

# --------------------------------------------------------------------------- names

# A job name becomes a Slurm job name, a Kubernetes object name (DNS-1123 label)
# and the stem of pod names such as `<name>-worker-12`; 63 is the label limit and
# the operator appends up to 11 characters (`-worker-NNN`), hence 50.
NAME_MAX = 50
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
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
# Checkpoint folders are step-NNNNNNNN: eight digits, so resume finds at most this step.
MAX_STEPS = 99_999_999
MAX_BATCH = 65_536  # micro_batch_size and grad_accum
MAX_SEQ_LEN = 16_777_216  # 2**24 tokens; also the bound of llama.max_position_embeddings
MAX_SEED = 2**63 - 1  # torch.manual_seed and the rank re-seeding take a 64-bit seed
MAX_KEEP = 1000  # checkpoints kept
MAX_RETRIES = 1000  # requeues, pod restarts, backoff
MAX_SECONDS = 366 * 86400  # a year: time limits, deadlines, TTLs
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


def shell_lines(v: list[str]) -> list[str]:
    """`slurm.setup` / `k8s.setup`: one shell line per item (tabs allowed, no newline)."""
    for line in v:
        if CONTROL_RE.search(line.replace("\t", " ")):
            raise ValueError(
                f"{show(line)}: one shell line per list item, no newlines or other "
                "control characters"
            )
    return v


def path_text(v: str | None) -> str | None:
    if v is None:
        return v
    if not v.strip():
        raise ValueError(f"{show(v)} is empty; accepted: a folder or file path")
    if CONTROL_RE.search(v):
        raise ValueError(
            f"{show(v)} holds a control character (tab, newline, NUL ...); accepted: a "
            "path of printable characters"
        )
    if len(v) > PATH_MAX:
        raise ValueError(
            f"{show(v)} is longer than {PATH_MAX} characters, the longest path Linux opens"
        )
    return v


# A file or folder path given in the spec: one printable line.
PathText = Annotated[str, AfterValidator(path_text)]


def _factory_ref(v: str) -> str:
    if not FACTORY_RE.match(v):
        raise ValueError(f"{show(v)} is not 'package.module:function'")
    return v


FactoryRef = Annotated[str, AfterValidator(_factory_ref)]


class Section(BaseModel):
    """Base of every spec section: frozen, unknown keys rejected."""

    # allow_inf_nan=False: YAML `.inf` is not a learning rate or a clip norm.
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False
    )


def set_derived(model: BaseModel, field: str, value: Any) -> None:
    # Derived fields are filled in by validators of frozen models; this is the one
    # place that bypasses `frozen`, and only during validation.
    object.__setattr__(model, field, value)


def as_written(value: Any) -> Any:
    """A time YAML 1.1 read as a base-60 number (`10:00:00` → 36000) as the text it was
    written as; any other value as it is. For fields whose values are times."""
    return value.text if isinstance(value, Base60Int) else value


def type_name(value: Any) -> str:
    """What YAML made of a value, with its article: 'a string', 'an integer'."""
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names.update({list: "a list", dict: "a mapping", type(None): "null"})
    kind = int if isinstance(value, int) and not isinstance(value, bool) else type(value)
    return names.get(kind, type(value).__name__)  # a base-60 `Base60Int` is an integer


class ClusterSection(Section):
    """Base of a cluster's own section (`local:`, `slurm:`, `k8s:`, a plugin's): a
    top-level key of the spec named after the cluster, validated with every spec
    whatever cluster it is rendered for.

    Two hooks see the whole spec (`spec` is the `JobSpec`, typed loosely here: the
    core spec is built from the sections):
    - `spec_problems`: what this section cannot mean with the rest of the spec; run
      by every validation, one line per problem, each naming its fields;
    - `run_problems`: what running on this cluster needs that the spec alone does not
      promise (an image, a shared volume ...); run only when the job is rendered or
      submitted for this cluster (`Cluster.check`), with the spec as its nodes read it.
    """

    # Whether the ranks read the spec's files (corpus, pretrained model, resume
    # checkpoint, TensorBoard folder) at the paths this machine sees them, as on a
    # shared file system: then relative ones are taken from the spec file's folder
    # (`spec/paths.py`). False where the ranks read them elsewhere (inside a pod).
    reads_local_paths: ClassVar[bool] = True

    def spec_problems(self, spec: Any) -> list[str]:
        return []

    def run_problems(self, spec: Any) -> list[str]:
        return []
