"""`slurm:` the section of `--cluster slurm`: sbatch options, a pyxis container."""

from __future__ import annotations

import difflib
import posixpath
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from ...spec.common import (
    CONTROL_RE,
    ENV_NAME_RE,
    MAX_NODES,
    MAX_SECONDS,
    PATH_MAX,
    ClusterSection,
    Retries,
    Section,
    as_written,
    path_text,
    shell_lines,
    show,
    type_name,
)  # fmt: skip

# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
SLURM_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")

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
    "signal": "slurm.signal and slurm.signal_delay_s (slurm.signal_batch: true for B:)",
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
        return f"{show(value)}: leave the key out to leave --{name} out"
    if takes == "none":
        return f"{show(value)}: --{name} is a switch without a value; accepted: true"
    if isinstance(value, int):
        value = str(value)
    if not isinstance(value, str):
        switch = ", or true for the bare switch" if takes == "optional" else ""
        return (
            f"{show(value)} is {type_name(value)}; accepted: a string or an integer{switch} "
            "(quote other numbers: '1.5')"
        )
    if not value.strip() or CONTROL_RE.search(value):
        return (
            f"{show(value)} is not one line of printable text; accepted: text without "
            "newlines, tabs or other control characters, not empty"
        )
    if len(value) > SBATCH_VALUE_MAX:
        return f"{show(value)} is longer than {SBATCH_VALUE_MAX} characters"
    if name == "nice" and not (
        re.fullmatch(r"[+-]?\d{1,10}", value) and abs(int(value)) <= NICE_MAX
    ):
        return f"{show(value)} is not a nice adjustment; accepted: an integer, ±{NICE_MAX}"
    if name == "mail-type":
        bad = [t for t in value.split(",") if t.strip().upper() not in MAIL_TYPES]
        if bad:
            return (
                f"{show(value)}: {', '.join(map(repr, bad))} is no mail type; accepted: a "
                f"comma-separated list of {', '.join(sorted(MAIL_TYPES))}"
            )
    return None


def _sbatch_option(item: Any) -> Any:
    # The value arrives with its name (see SlurmSection._sbatch_named), so that pydantic
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
            raise ValueError(f"{show(text)} is not a pyxis mount; {accepted}")
        source, target = parts[0], parts[1] if len(parts) > 1 else parts[0]
        flags = parts[2] if len(parts) > 2 else ""
        for path in (source, target):
            if not path.startswith("/") or len(path) > PATH_MAX:
                raise ValueError(f"{show(text)}: {path!r} is not an absolute path; {accepted}")
        bad = [f for f in flags.split("+") if flags and f not in PYXIS_MOUNT_FLAGS]
        if bad or (len(parts) == 3 and not flags):
            raise ValueError(f"{show(text)}: unknown mount flag {bad or ['']}; {accepted}")
        return cls(
            source=posixpath.normpath(source), target=posixpath.normpath(target), flags=flags
        )

    @property
    def read_only(self) -> bool:
        return "ro" in self.flags.split("+")

    def text(self) -> str:
        return ":".join([self.source, self.target, *([self.flags] if self.flags else [])])


class SlurmContainer(Section):
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
                f"{show(v)} is not an image reference; accepted: one word such as "
                "'nvcr.io#nvidia/pytorch:24.05-py3' or '/shared/images/torch.sqsh'"
            )
        first = v.split("@", 1)[-1].split("/", 1)[0]
        if "/" in v and not v.startswith("/") and "#" not in v and re.search(r"[.:]", first):
            # enroot reads `host/name` as a Docker Hub image named `host/name`.
            fixed = v.replace("/", "#", 1)
            raise ValueError(
                f"{show(v)}: enroot separates the registry with '#'; accepted: {fixed!r}"
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
                    f"{show(text)} and {targets[mount.target]!r} mount the same path "
                    f"{mount.target!r}; accepted: one mount per path"
                )
            targets[mount.target] = text
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        if v is not None:
            path_text(v)
            if not v.startswith("/") or re.search(r"\s", v):
                raise ValueError(f"{show(v)} is not an absolute path without spaces")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: list[str]) -> list[str]:
        for name in v:
            if not ENV_NAME_RE.match(name):
                raise ValueError(f"{show(name)} is not an environment variable name")
        return v

    def parsed_mounts(self) -> list[PyxisMount]:
        return [PyxisMount.parse(m) for m in self.mounts]


class SlurmSection(ClusterSection):
    """Settings for `--cluster slurm` (through submitit)."""

    partition: str | None = None
    """Slurm `--partition`; one word, no spaces."""
    account: str | None = None
    """Slurm `--account`; one word, no spaces."""
    qos: str | None = None
    """Slurm `--qos`; one word, no spaces."""
    time: str = "01:00:00"
    """Slurm's --time: `M`, `H:M:S`, `D-H:M:S` ...; more than zero, at most 366 days, and
    longer than `signal_delay_s`. Taken as written: an unquoted `10:00:00` is ten hours
    (not YAML 1.1's base-60 number 36000), `90` is ninety minutes."""
    signal: Literal["USR2", "USR1", "TERM", "INT"] = "USR2"
    """Sent before the time limit (and by `scancel --signal`); USR1 is NCCL's."""
    signal_delay_s: Annotated[int, Field(ge=10, le=65535)] = 120
    """Seconds before the time limit at which the signal is sent; 10 to 65535."""
    signal_batch: bool = False
    """`true`: Slurm sends `signal` to the batch shell alone (`--signal=B:USR2@N`, as some
    sites ask); the batch shell writes it down and every node task passes it on to the
    ranks, which save, and the job is requeued. `false` (default): Slurm sends it to
    every process of the job's steps, every rank on every node."""
    constraint: str | None = None
    """Slurm `--constraint`; one word, no spaces."""
    gres: str | None = None
    """Generic resources per node, e.g. `gpu:8`; default derived from device/procs."""
    exclusive: bool = False
    """Slurm `--exclusive`: the nodes for this job alone."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines (module load, venv ...), one command each, that the batch shell runs on
    the first node before srun starts every node's launcher (the environment they set
    goes with it). Their output is in node 0's log; a line that exits non-zero stops the
    job there, naming the line and its exit code."""
    srun_args: list[str] = Field(default_factory=list)
    """Extra words for srun, e.g. `--cpu-bind=none`."""
    max_requeues: Retries = 10
    """Requeues after preemption or time-out; 0 to 1000."""
    spare_nodes: Annotated[int, Field(ge=0, le=MAX_NODES - 1, strict=True)] = 0
    """Hot spares: nodes the job holds beside `resources.nodes` (it asks Slurm for
    `resources.nodes + spare_nodes`), idle while the others train. When a fault is
    pinned on a training node other than the first (a hang's stopped rank, a killed
    rank), the next restart in place runs on a spare instead, in the same allocation
    and job id: the spare takes that node's node rank and restores from the newest
    checkpoint, the bad node sits the rest of the allocation out and `status` names
    it. With no spare left, a fault goes on as without spares (restart in place, then a
    requeue that leaves the node behind). 0 (default) to 99999, with
    `resources.nodes + spare_nodes` at most 100000; needs `resources.nodes` ≥ 2 and
    `restart.max_in_allocation` ≥ 1."""
    master_port: Annotated[int, Field(ge=1024, le=65535)] = 29500
    """The rendezvous port on the first node."""
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
                    f"key {show(key)} is {type_name(key)}; accepted: sbatch's long option "
                    "names, e.g. reservation, exclude, comment"
                )
        # `time-min: 10:00` is YAML 1.1's base-60 number 600; sbatch reads the text.
        return {key: (key, as_written(value)) for key, value in v.items()}

    @model_validator(mode="after")
    def _one_container(self) -> SlurmSection:
        pyxis = [w for w in self.srun_args if w.startswith(("--container-", "--no-container-"))]
        if self.container is not None and pyxis:
            raise ValueError(
                f"srun_args {', '.join(map(repr, pyxis))} and container both set pyxis "
                "options; accepted: the container section alone (it renders them)"
            )
        return self

    @model_validator(mode="after")
    def _signal_inside_time(self) -> SlurmSection:
        # The signal sent signal_delay_s before the limit saves and requeues the job: with
        # a limit no longer than the delay it comes at once, every attempt trains a step
        # or none and requeues, forever.
        minutes = slurm_time_minutes(self.time)
        if minutes is not None and minutes * 60 <= self.signal_delay_s:
            raise ValueError(
                f"slurm.time {self.time!r} ({minutes * 60} s, as Slurm grants it in whole "
                f"minutes) is not longer than slurm.signal_delay_s ({self.signal_delay_s}), "
                "so the signal that saves and requeues the job would come as it starts and "
                "every attempt would requeue without training; accepted: a slurm.time "
                f"longer than {self.signal_delay_s} s, or a smaller slurm.signal_delay_s "
                f"(10 to {minutes * 60 - 1})"
            )
        return self

    @field_validator("time", mode="before")
    @classmethod
    def _time_as_written(cls, v: Any) -> Any:
        # `time: 10:00:00` is YAML 1.1's base-60 number 36000: the text is the time
        # meant (taken as 36000 minutes it would be 25 days). A plain integer is `M`.
        v = as_written(v)
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        minutes = slurm_time_minutes(v)
        if minutes is None:
            raise ValueError(
                f"{show(v)} is not a Slurm time; accepted: M, M:S, H:M:S, D-H, D-H:M, "
                "D-H:M:S (e.g. '90', '04:00:00', '2-00:00:00'), more than zero"
            )
        if minutes * 60 > MAX_SECONDS:
            raise ValueError(
                f"{show(v)} is more than 366 days, the longest time limit shardctl accepts"
            )
        return v

    @field_validator("partition", "account", "qos", "constraint", "gres")
    @classmethod
    def _no_space(cls, v: str | None) -> str | None:
        if v is not None and (not v or re.search(r"\s", v) or CONTROL_RE.search(v)):
            raise ValueError(f"{show(v)} must be one non-empty word without spaces")
        return v

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        return shell_lines(v)

    @field_validator("srun_args")
    @classmethod
    def _srun_args(cls, v: list[str]) -> list[str]:
        for word in v:
            if CONTROL_RE.search(word):
                raise ValueError(f"{show(word)}: an srun word holds no control characters")
        return v

    def spec_problems(self, spec: Any) -> list[str]:
        """What `spare_nodes` cannot mean with the rest of the spec, one line each."""
        spares, nodes = self.spare_nodes, spec.resources.nodes
        if not spares:
            return []
        if nodes + spares > MAX_NODES:
            return [
                f"slurm.spare_nodes {spares} with resources.nodes {nodes} asks Slurm for "
                f"{nodes + spares} nodes; accepted: at most {MAX_NODES} in all (spare_nodes "
                f"0 to {MAX_NODES - nodes})"
            ]
        problems = []
        if nodes < 2:
            # The first node decides every round and hosts the rendezvous: a fault
            # pinned on it is never handed to a spare (see `spare_nodes`).
            problems.append(
                f"slurm.spare_nodes {spares} with resources.nodes 1: a spare replaces a "
                "training node other than the first, so it would never be used; accepted: "
                "resources.nodes 2 or more, or slurm.spare_nodes 0"
            )
        if spec.restart.max_in_allocation == 0:
            problems.append(
                f"slurm.spare_nodes {spares} with restart.max_in_allocation 0: a spare "
                "takes a bad node's place in a restart in place, and none would run; "
                "accepted: restart.max_in_allocation 1 or more, or slurm.spare_nodes 0"
            )
        return problems

    def run_problems(self, spec: Any) -> list[str]:
        """What this section cannot mean together with the rest of the spec, one line
        each: checked when the job is rendered for Slurm, with the run and checkpoint
        directories made absolute as the nodes read them."""
        s, r = self, spec.resources
        problems: list[str] = []
        given = s.sbatch_options
        for name in ("mem-per-cpu", "mem-per-gpu"):
            if name in given and r.memory is not None:
                problems.append(
                    f"slurm.sbatch_options.{name} {given[name]!r} and resources.memory "
                    f"{str(r.memory)!r} both size the job's memory, and Slurm takes one of --mem, "
                    "--mem-per-cpu, --mem-per-gpu; accepted: one of the two"
                )
        gpus = given.get("gpus-per-task")
        if gpus is not None and str(gpus) != str(r.procs_per_node):
            problems.append(
                f"slurm.sbatch_options.gpus-per-task {gpus!r}: shardctl runs one task per node, "
                f"whose launcher starts resources.procs_per_node ({r.procs_per_node}) ranks with "
                f"one GPU each; accepted: {r.procs_per_node}, or leave it out"
            )
        if s.container is not None:
            problems += mount_plan(spec).problems
        return problems


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


# ------------------------------------------------- Slurm: the container's mounts


def _own_folders(spec: Any) -> list[tuple[str, str, bool]]:
    """The folders the ranks need inside a container: (path, what, written to)."""
    from ...storage import is_object_url  # at call time: the section loads at start-up

    folders = [(spec.run_dir, "the run directory", True)]
    if not is_object_url(spec.checkpoint_dir):  # a bucket is no folder to mount
        folders.append((spec.checkpoint_dir, "the checkpoint directory (checkpoint.dir)", True))
    entry = spec.entrypoint
    if entry is not None and (entry.code_dir or entry.script):
        code = entry.code_dir or posixpath.dirname(entry.script or "")
        folders.append((code, "your script's folder (entrypoint)", False))
    return folders


@dataclass(frozen=True)
class MountPlan:
    """`entries`: the `--container-mounts` list, the user's mounts first; `added`: the
    folders shardctl added at their own paths; `problems`: a user's mount that hides or
    write-protects a folder the ranks need, one line each."""

    entries: list[str]
    added: list[str]
    problems: list[str]


def mount_plan(spec: Any) -> MountPlan:
    """Every folder the ranks need is mounted at its own path unless a mount covers it."""
    assert spec.slurm.container is not None
    mine = spec.slurm.container.mounts
    mounts = [PyxisMount.parse(m) for m in mine]
    plan = MountPlan(entries=list(mine), added=[], problems=[])
    for path, what, written in _own_folders(spec):
        norm = posixpath.normpath(path)
        cover = next(
            (m for m in mounts if norm == m.target or norm.startswith(m.target.rstrip("/") + "/")),
            None,
        )
        if cover is None:
            mounts.append(PyxisMount(source=norm, target=norm))
            plan.entries.append(norm)
            plan.added.append(norm)
        elif cover.source != cover.target:
            plan.problems.append(
                f"slurm.container.mounts {cover.text()!r} puts {cover.source} at "
                f"{cover.target}, so {what} {norm!r} inside the container is another folder "
                f"than on the host; accepted: mount {cover.source} at its own path, or elsewhere"
            )
        elif written and cover.read_only:
            plan.problems.append(
                f"slurm.container.mounts {cover.text()!r} is read-only, but the ranks write "
                f"{what} {norm!r} beneath it; accepted: the mount without ro"
            )
    return plan
