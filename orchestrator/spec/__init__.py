"""The job spec: one YAML file parsed once into a frozen, validated `JobSpec`.

Every renderer, cluster backend and the training loop take a `JobSpec`; nothing
downstream reads the YAML again. Validation errors name the field (dotted path),
the bad value and what would be accepted, and become exit code 2 in the CLI.

Derived settings are filled in here, once: `strategy.sharding` and
`strategy.zero_stage` are two views of the same choice, so whichever the user
gives determines the other, and a pair that disagrees is rejected.

    common.py    the `Section` base, bounds, shared field types, how values are shown
    sections.py  the core sections (resources, strategy, train, checkpoint, logging,
                 watchdog, restart, entrypoint)
    llama.py     `train.model.llama`: LlamaConfig's keywords, without transformers
    job.py       `JobSpec` and the checks across sections; parse, load, `with_command`
    explain.py   pydantic's errors as one line each, with did-you-mean

No cluster is named here: each cluster's section (`local:`, `slurm:`, `k8s:`, a
plugin's) lives in its own package (orchestrator/clusters/<name>/section.py) and
`spec_model` adds it to `JobSpec` from the cluster registry.
"""

from .common import (
    MAX_BATCH,
    MAX_CLIP,
    MAX_CPUS_PER_PROC,
    MAX_ENV_VALUE,
    MAX_KEEP,
    MAX_LR,
    MAX_NODES,
    MAX_PROCS_PER_NODE,
    MAX_RETRIES,
    MAX_SECONDS,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_STEPS,
    MAX_WEIGHT_DECAY,
    NAME_MAX,
    NAME_RE,
    RESERVED_ENV,
    SHARDING_TO_ZERO,
    ZERO_TO_SHARDING,
    ClusterSection,
    Section,
)
from .job import (
    JobSpec,
    load_spec,
    parse_spec,
    read_job_yaml,
    reads_local_paths,
    spec_model,
    with_command,
)
from .llama import LLAMA_CONFIG_KEYS, LLAMA_EXTRA_KEYS, LLAMA_REFUSED_KEYS, llama_problems
from .sections import (
    Checkpoint,
    DataSource,
    Entrypoint,
    Logging,
    ModelSource,
    Resources,
    Restart,
    Strategy,
    Train,
    Watchdog,
)

__all__ = [
    "LLAMA_CONFIG_KEYS",
    "LLAMA_EXTRA_KEYS",
    "LLAMA_REFUSED_KEYS",
    "MAX_BATCH",
    "MAX_CLIP",
    "MAX_CPUS_PER_PROC",
    "MAX_ENV_VALUE",
    "MAX_KEEP",
    "MAX_LR",
    "MAX_NODES",
    "MAX_PROCS_PER_NODE",
    "MAX_RETRIES",
    "MAX_SECONDS",
    "MAX_SEED",
    "MAX_SEQ_LEN",
    "MAX_STEPS",
    "MAX_WEIGHT_DECAY",
    "NAME_MAX",
    "NAME_RE",
    "RESERVED_ENV",
    "SHARDING_TO_ZERO",
    "ZERO_TO_SHARDING",
    "Checkpoint",
    "ClusterSection",
    "DataSource",
    "Entrypoint",
    "JobSpec",
    "Logging",
    "ModelSource",
    "Resources",
    "Restart",
    "Section",
    "Strategy",
    "Train",
    "Watchdog",
    "llama_problems",
    "load_spec",
    "parse_spec",
    "read_job_yaml",
    "reads_local_paths",
    "spec_model",
    "with_command",
]
