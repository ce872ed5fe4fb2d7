"""`JobSpec`: the core sections and the checks across them; reading a spec."""

from __future__ import annotations

import functools
import posixpath
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, create_model, field_validator, model_validator

from ..errors import SpecError
from ..rundir import (
    CHECKPOINTS_DIR,
    LOGS_DIR,
    MODEL_DIR,
    RENDERED_DIR,
    default_checkpoint_dir,
    default_run_dir,
)  # fmt: skip
from ..s3.url import ACCEPTED as S3_ACCEPTED
from ..s3.url import is_s3_url, url_problem
from ..yamlio import read_yaml_file
from .common import (
    ENV_NAME_RE,
    MAX_ENV_VALUE,
    NAME_MAX,
    NAME_RE,
    RESERVED_ENV,
    PathText,
    Section,
    as_written,
    set_derived,
    show,
)  # fmt: skip
from .explain import explain, key_text
from .sections import (
    Checkpoint,
    Entrypoint,
    Logging,
    Resources,
    Restart,
    Strategy,
    Train,
    Watchdog,
)  # fmt: skip


class JobSpec(Section):
    """One training job: what to train, how to shard it, where to run it."""

    name: str
    """1-50 lower-case letters, digits and '-': a Slurm job name and a Kubernetes name."""
    run_dir: PathText | None = None
    """The run's own folder: rendered files, logs, markers, `model/`; default `runs/<name>`
    beside the spec file (a relative path, like every path of a spec file, is taken
    from the file's folder). A path of printable characters, at most 4096 of them, not
    the file system root."""
    resources: Resources = Field(default_factory=Resources)
    """Machines, ranks per machine, device, CPUs and memory (see `Resources`)."""
    launcher: Literal["torchrun", "accelerate", "deepspeed"] = "torchrun"
    """What starts the ranks on every node; `deepspeed` only with backend deepspeed, and not
    multi-node on cpu."""
    strategy: Strategy = Field(default_factory=Strategy)
    """Sharding backend, sharding, offload and precision (see `Strategy`)."""
    train: Train | None = None
    """The built-in loop; a spec has `train` or `entrypoint`, never both."""
    entrypoint: Entrypoint | None = None
    """Your own training script (see `Entrypoint`)."""
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    """Where, how often and how many checkpoints; resume (see `Checkpoint`)."""
    logging: Logging = Field(default_factory=Logging)
    """Metrics trackers beside `logs/metrics.jsonl` (see `Logging`)."""
    watchdog: Watchdog = Field(default_factory=Watchdog)
    """Hang detection and the collectives' timeout (see `Watchdog`)."""
    restart: Restart = Field(default_factory=Restart)
    """Restarts of every rank inside the allocation after a crash or a hang (see
    `Restart`)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of every rank; values of at most 131072 characters (Linux's
    MAX_ARG_STRLEN: execve refuses a longer variable), taken literally (`$HOME` is not
    expanded). A `PATH` replaces the nodes' own: it must hold absolute folders, the
    launcher's among them (on `--cluster local` the launcher must be found in it)."""
    # Then one section per cluster, each under the cluster's name (`local`, `slurm`,
    # `k8s`, a plugin's): added by `spec_model` from the cluster registry.

    # The cluster sections this model holds, in the order they are written.
    cluster_sections: ClassVar[tuple[str, ...]] = ()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if len(v) > NAME_MAX or not NAME_RE.match(v):
            raise ValueError(
                f"{show(v)} cannot be a Slurm job and Kubernetes name; accepted: 1-{NAME_MAX} "
                "lower-case letters, digits and '-', starting and ending with a letter or digit"
            )
        return v

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, v: str | None) -> str | None:
        if v is not None and posixpath.normpath(v) in ("/", "//"):
            raise ValueError(
                f"{show(v)} is the file system root; accepted: a folder of the run's own, "
                "e.g. 'runs/<name>' (the default)"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        # Checked once for the whole spec: no argument, environment variable or file
        # name can carry a NUL, and one would surface as a traceback on the nodes.
        problems = [
            f"{path or 'spec'}: {show(value)} holds a NUL character; accepted: text "
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
                raise ValueError(f"{show(key)} is not an environment variable name")
            if key in RESERVED_ENV:
                raise ValueError(
                    f"{key} is set by the launcher for every rank and cannot be set in env"
                )
            value = as_written(value)  # `T: 10:00` is '10:00', not YAML's 600
            if isinstance(value, bool):
                value = "1" if value else "0"
            elif isinstance(value, int | float):
                value = str(value)
            if isinstance(value, str) and len(value) > MAX_ENV_VALUE:
                raise ValueError(
                    f"{key}: {show(value)} is longer than {MAX_ENV_VALUE} characters, the "
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
        if (
            self.launcher == "accelerate"
            and s.backend == "fsdp"
            and r.device == "cpu"
            and self.entrypoint is not None
        ):
            # accelerate 1.x turns FSDP on only for GPU-like devices: on CPU a script's
            # Accelerator() runs DDP (with autocast), not what validate would say.
            # shardctl's own loop shards with FSDP2 itself, so it is not refused.
            problems.append(
                "launcher 'accelerate' with strategy.backend 'fsdp' on resources.device "
                "'cpu': accelerate runs your script's Accelerator() as DDP there, not FSDP; "
                "accepted on cpu: launcher: torchrun (FSDP2 in the script itself), "
                "strategy.backend: deepspeed (runs as DeepSpeed), or resources.device: cuda"
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
        if t is not None and c.every_steps > t.steps:
            problems.append(
                f"checkpoint.every_steps ({c.every_steps}) is larger than train.steps "
                f"({t.steps}), so no periodic checkpoint would ever be written; "
                f"accepted: 1..{t.steps}"
            )
        path_problem = _search_path_problem(self.env.get("PATH"))
        if path_problem is not None:
            problems.append(path_problem)
        for name in self.cluster_sections:
            problems.extend(self.cluster_section(name).spec_problems(self))
        run_dir = self.run_dir if self.run_dir is not None else default_run_dir(self.name)
        if c.dir is not None:
            problems.extend(_checkpoint_dir_problems(c.dir, run_dir))
        if problems:
            raise ValueError("\n".join(problems))
        set_derived(self, "run_dir", run_dir)
        if c.dir is None:
            set_derived(c, "dir", default_checkpoint_dir(run_dir))
        return self

    # -- derived facts used everywhere -------------------------------------------

    @property
    def world_size(self) -> int:
        return self.resources.world_size

    @property
    def checkpoint_dir(self) -> str:
        assert self.checkpoint.dir is not None  # filled in by validation
        return self.checkpoint.dir

    def cluster_section(self, name: str) -> Any:
        """The section of cluster `name` (`spec.slurm` is `spec.cluster_section("slurm")`);
        its defaults when this spec was read without it (a plugin's, not asked for)."""
        if name in self.cluster_sections:
            return getattr(self, name)
        from ..clusters import section_model

        section = section_model(name)
        return section() if section is not None else None

    def to_yaml_dict(self) -> dict[str, Any]:
        """The validated spec (derived fields filled in) as plain data, by alias."""
        data = self.model_dump(mode="json", by_alias=True)
        # Only the workload the spec has: a built-in spec's job.yaml stays as it was.
        for key in ("train", "entrypoint"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


def _search_path_problem(value: Any) -> str | None:
    """Why `env.PATH` cannot find the launcher on any node, or None. It replaces the
    nodes' own PATH, literally (`$PATH` is not expanded), and the launcher (`torchrun`,
    `accelerate`, `deepspeed`) is found through it: without one absolute folder every
    attempt ends "cannot start" and is tried again."""
    if not isinstance(value, str):
        return None
    accepted = (
        "accepted: absolute folders separated by ':', the launcher's among them "
        "(e.g. '/opt/venv/bin:/usr/local/bin:/usr/bin:/bin'), or no env.PATH (the nodes' own)"
    )
    if re.search(r"\$(\{?)[A-Za-z_]", value):
        return (
            f"env.PATH {show(value)} names a variable, but env values are taken literally "
            f"(nothing is expanded); {accepted}"
        )
    if not any(folder.startswith("/") for folder in value.split(":")):
        return (
            f"env.PATH {show(value)} holds no absolute folder, so no node could find the "
            f"launcher or python3; {accepted}"
        )
    return None


def _checkpoint_dir_problems(ckpt_dir: str, run_dir: str) -> list[str]:
    """checkpoint.dir may be anywhere except on top of the run dir's own files: retention
    deletes old step folders there, and the run dir's logs/, model/ and rendered/ must
    not hold step folders that resume would read. An `s3://` URL must be a valid one."""
    if is_s3_url(ckpt_dir):
        problem = url_problem(ckpt_dir)
        return [f"checkpoint.dir {show(ckpt_dir)}: {problem}; {S3_ACCEPTED}"] if problem else []
    ckpt, run = posixpath.normpath(ckpt_dir), posixpath.normpath(run_dir)
    taken = {run: "the run directory itself (run_dir)"}
    for sub in (LOGS_DIR, MODEL_DIR, RENDERED_DIR):
        taken[posixpath.join(run, sub)] = f"the run directory's {sub}/ folder"
    if ckpt in taken:
        default = posixpath.join(run, CHECKPOINTS_DIR)
        return [
            f"checkpoint.dir {show(ckpt_dir)} is {taken[ckpt]}; accepted: a folder of its "
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
            name = key_text(key)
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


def spec_model(clusters: Iterable[str] = ()) -> type[JobSpec]:
    """`JobSpec` with a section for every built-in cluster and for each of `clusters`
    (clusters installed as plugins), built once per set (building costs start-up time)."""
    from ..clusters import CLUSTER_NAMES

    return _spec_model(tuple(sorted(set(clusters) - set(CLUSTER_NAMES))))


@functools.cache
def _spec_model(plugins: tuple[str, ...]) -> type[JobSpec]:
    from ..clusters import CLUSTER_NAMES, section_model

    fields: dict[str, Any] = {}
    for name in (*CLUSTER_NAMES, *plugins):
        section = section_model(name)
        if section is not None:
            fields[name] = (section, Field(default_factory=section))
    model = create_model(
        "JobSpec", __base__=JobSpec, __module__=__name__, __doc__=JobSpec.__doc__, **fields
    )
    type.__setattr__(model, "cluster_sections", tuple(fields))
    return model


def _plugin_keys(data: dict[Any, Any]) -> list[str]:
    """Top-level keys of `data` that are the sections of clusters installed as plugins.
    Entry points are read only when a key is neither core nor a built-in cluster's."""
    from ..clusters import CLUSTER_NAMES, plugin_names

    unknown = [
        k
        for k in data
        if isinstance(k, str) and k not in JobSpec.model_fields and k not in CLUSTER_NAMES
    ]
    if not unknown:
        return []
    installed = plugin_names()
    return [k for k in unknown if k in installed]


def parse_spec(data: Any, source: str | None = None, cluster: str | None = None) -> JobSpec:
    """Validate plain data (from YAML) into a `JobSpec`, or raise `SpecError`.

    The model holds every built-in cluster's section, the section of each installed
    plugin cluster the data names at its top level, and `cluster`'s (the one asked for)."""
    if not isinstance(data, dict):
        raise SpecError(
            [
                "the top level must be a mapping of sections, got "
                + ("nothing (the file is empty)" if data is None else type(data).__name__)
            ],
            source,
        )
    model = spec_model([*_plugin_keys(data), *([cluster] if cluster else [])])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise SpecError(explain(exc, data, model), source) from None


def load_spec(
    path: str | Path, overrides: Sequence[str] = (), cluster: str | None = None
) -> JobSpec:
    """Read and validate a YAML job spec file, after the command line's `--set
    KEY.PATH=VALUE` overrides (see `orchestrator/overrides.py`); `cluster`: the cluster
    it is read for (see `parse_spec`; none: this machine).

    Relative paths in the file (the default run dir too) are taken from the file's
    folder, those given with `--set` from the current directory (`spec/paths.py`)."""
    from ..overrides import apply_overrides, parse_path
    from .paths import resolve_paths

    data = apply_overrides(read_yaml_file(path), overrides)
    data = resolve_paths(
        data,
        Path(path).resolve().parent,
        reads_local_paths=reads_local_paths(cluster),
        overrides=[parse_path(o.partition("=")[0].strip()) for o in overrides],
    )
    source = str(path) + (f" with --set {' '.join(overrides)}" if overrides else "")
    return parse_spec(data, source, cluster)


def read_job_yaml(path: str | Path) -> JobSpec:
    """A rendered job.yaml, as the ranks read it. Its paths are final (made absolute
    when its spec file was loaded, or the pods' own, relative to their working
    directory), so unlike `load_spec` nothing is taken from the file's folder."""
    return parse_spec(read_yaml_file(path), str(path))


def reads_local_paths(cluster: str | None) -> bool:
    """Whether `cluster`'s ranks read the spec's files where this machine does."""
    if cluster is None:
        return True
    from ..clusters import section_model

    section = section_model(cluster)
    return bool(getattr(section, "reads_local_paths", True))


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
