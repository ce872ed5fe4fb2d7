"""What runs on every node: the env file, the launcher words and the launch script.

Pure functions of a `JobSpec`, deterministic, no torch import. Values that only
exist on the cluster at run time (node rank, node count, the master's address)
are never filled in here: the scripts refer to them by name and the node's own
shell expands them when it runs the script. Every launch script reads the
`RUNTIME_VARS` from its environment; how a node learns them is the cluster's
business: each cluster class (`shardctl.orchestrator.clusters`) declares its
`runtime_env(spec)`, the env lines that set them from its own variables, and
passes them in here.

Shell safety: a word is a sequence of literal text and variable references;
literals go through `shlex.quote`, references become `"${NAME}"`, so nothing a
user wrote (names, paths, env values) is ever expanded or executed by a shell.

Files the launchers read (hostfile, accelerate config, DeepSpeed JSON) lie
beside the launch script; the script finds its own folder at run time and calls
it `SHARDCTL_RENDER_DIR`, so a rendered folder works wherever it is copied.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from .launch_wrapper import ENTRY_POINTS as WRAPPED_LAUNCHERS
from .precision import summary as precision_summary
from .rundir import (
    ENV_ACCELERATE_CONFIG,
    ENV_CHECKPOINT_DIR,
    ENV_COLLECTIVE_TIMEOUT,
    ENV_DEEPSPEED_CONFIG,
    ENV_HANG_TIMEOUT,
    ENV_HANG_WATCHER,
    ENV_HEARTBEAT_DIR,
    ENV_HF_TRAINER_AUTO,
    ENV_JOB_NAME,
    ENV_RUN_DIR,
    ENV_SPEC,
    ENV_STARTUP_TIMEOUT,
    SPEC_FILE,
)
from .spec import JobSpec
from .templating import render_template

RUNTIME_VARS: tuple[str, ...] = (
    "SHARDCTL_NNODES",
    "SHARDCTL_NODE_RANK",
    "SHARDCTL_NPROC_PER_NODE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
RENDER_DIR_VAR = "SHARDCTL_RENDER_DIR"
TRAIN_MODULE = "shardctl.train"
ENTRY_MODULE = "shardctl.train.entry"  # runs an entrypoint: the user's script
# Runs the launcher as its child and ends the node's ranks when they stop advancing.
WATCHDOG_MODULE = "shardctl.train.watchdog"
# A node agent the launch script execs (`launch_script(node_agent=...)`) applies the
# hang rule itself when given this flag.
WATCH_HANGS_FLAG = "--watch-hangs"
# `launch.sh`'s answer in ENV_HANG_WATCHER when a node agent above it applies the rule.
AGENT_WATCHES = "agent"
PYTHON_VAR = "SHARDCTL_PYTHON"  # the interpreter that runs the watchdog and the launcher
# Runs torchrun or `accelerate launch` in its own process and records which rank ended
# how (the launcher's exception, not its text): `launch_wrapper.ENTRY_POINTS`.
LAUNCH_WRAPPER_MODULE = "shardctl.orchestrator.launch_wrapper"

# File names of the artifacts the launchers read, beside launch.sh.
HOSTFILE = "hostfile"
ACCELERATE_CONFIG = "accelerate_config.yaml"
DS_CONFIG = "ds_config.json"


@dataclass(frozen=True)
class Var:
    """A shell variable, expanded on the node when the script runs."""

    name: str


Word = tuple["str | Var", ...]  # one shell word: literal pieces and variable references


def quote_word(word: Word) -> str:
    """Shell text of one word: literals shlex-quoted, variables as `"${NAME}"`."""
    text = "".join(
        f'"${{{part.name}}}"' if isinstance(part, Var) else shlex.quote(part)
        for part in word
        if part != ""
    )
    return text or "''"


def plain_word(word: Word) -> str:
    """One word as the launcher will see it, variables written `${NAME}`."""
    return "".join(f"${{{p.name}}}" if isinstance(p, Var) else p for p in word)


def _w(*parts: str | Var) -> Word:
    return tuple(parts)


NNODES, NODE_RANK, NPROC = (
    Var("SHARDCTL_NNODES"),
    Var("SHARDCTL_NODE_RANK"),
    Var("SHARDCTL_NPROC_PER_NODE"),
)
MASTER_ADDR, MASTER_PORT = Var("MASTER_ADDR"), Var("MASTER_PORT")


# ------------------------------------------------------------------ env file


@dataclass(frozen=True)
class EnvLine:
    """One statement of the env file; `text` is complete, already-quoted shell."""

    text: str
    comment: str | None = None


def export(name: str, value: str, comment: str | None = None) -> EnvLine:
    """`export NAME=value`, the value a literal."""
    return EnvLine(f"export {name}={shlex.quote(value)}", comment)


def export_from(name: str, source: str, why: str, comment: str | None = None) -> EnvLine:
    """`export NAME="${SOURCE}"`, stopping the script with `why` when SOURCE is unset."""
    # `${X:?why}` stops the script with a message naming the missing variable
    # instead of starting ranks with an empty rank or address. `why` is shardctl's own
    # text, and bash reads it as a word inside double quotes: no quoting characters.
    if re.search(r"""['"`$\\}]""", why):
        raise ValueError(f"export_from: {why!r} holds a character bash would interpret")
    return EnvLine(f'export {name}="${{{source}:?{why}}}"', comment)


def backend_env(spec: JobSpec) -> dict[str, str]:
    """Process settings for the communication backend and libraries, before user env."""
    env = {
        "OMP_NUM_THREADS": str(spec.resources.cpus_per_proc),
        # Rank output reaches log files line by line, not in 8 KiB chunks.
        "PYTHONUNBUFFERED": "1",
    }
    if spec.resources.device == "cuda":
        # A rank whose collective failed or timed out tears the process down, so
        # torchrun (and then Slurm/Kubernetes) sees the failure instead of a hang.
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        env["NCCL_DEBUG"] = "WARN"
    if spec.strategy.backend == "deepspeed" or spec.launcher == "deepspeed":
        # DeepSpeed guesses its accelerator from what it finds; a cpu job on a GPU
        # host (or the reverse) must not be guessed.
        env["DS_ACCELERATOR"] = spec.resources.device
    # No ACCELERATE_USE_CPU under `launcher: accelerate` on cpu: with it accelerate
    # drops DeepSpeed for DDP (a DeepSpeed rank's gloo group comes from
    # `shardctl.train.accelerate_cpu`), and the one flavour that would read it, a
    # script's FSDP, is refused on cpu (spec `_cross_checks`); the built-in loop
    # never builds an Accelerator.
    return env


def precision_words(spec: JobSpec) -> str:
    """The precision `validate` reports, as the ranks will train: the built-in loop
    resolves `auto` on the node under every launcher; a script reads the rendered
    accelerate config or ds_config.json when it is handed one (`contract_lines`)."""
    handed_config = spec.launcher == "accelerate" or spec.strategy.backend == "deepspeed"
    return precision_summary(
        spec.strategy.precision,
        spec.resources.device,
        builtin_loop=spec.train is not None,
        reads_rendered=handed_config,
    )


def contract_lines(spec: JobSpec, spec_path: str) -> list[EnvLine]:
    """The run contract every rank reads (docs/reference/run-contract.md): the
    run and checkpoint directories, the job's name, the rendered spec and launcher
    configs. The attempt number is the cluster's (see each cluster's runtime_env)."""

    def beside(name: str) -> EnvLine:
        # The rendered files lie beside launch.sh; env.sh sourced on its own has no
        # SHARDCTL_RENDER_DIR and takes the current folder.
        return EnvLine(f'"${{{RENDER_DIR_VAR}:-.}}"/{shlex.quote(name)}')

    def export_beside(var: str, name: str, comment: str | None = None) -> EnvLine:
        if PurePosixPath(name).is_absolute():
            return export(var, name, comment)
        return EnvLine(f"export {var}={beside(name).text}", comment)

    lines = [
        export(ENV_JOB_NAME, spec.name, "the run contract (docs/reference/run-contract.md)"),
        export(ENV_RUN_DIR, spec.run_dir or ""),
        export(ENV_CHECKPOINT_DIR, spec.checkpoint_dir),
        export_beside(ENV_SPEC, spec_path),
    ]
    if spec.launcher == "accelerate":
        lines.append(export_beside(ENV_ACCELERATE_CONFIG, ACCELERATE_CONFIG))
    if spec.strategy.backend == "deepspeed":
        lines.append(export_beside(ENV_DEEPSPEED_CONFIG, DS_CONFIG))
    w = spec.watchdog
    hang = "" if w.hang_timeout_s is None else str(w.hang_timeout_s)
    lines.append(export(ENV_HANG_TIMEOUT, hang, "watchdog: empty = derived while the job runs"))
    startup = "" if w.startup_timeout_s is None else str(w.startup_timeout_s)
    lines.append(export(ENV_STARTUP_TIMEOUT, startup))
    lines.append(export(ENV_COLLECTIVE_TIMEOUT, str(w.collective_timeout)))
    if spec.entrypoint is not None and not spec.entrypoint.hf_trainer_auto:
        lines.append(export(ENV_HF_TRAINER_AUTO, "0", "entrypoint.hf_trainer_auto: false"))
    return lines


def env_lines(
    spec: JobSpec, runtime: Sequence[EnvLine], spec_path: str = SPEC_FILE
) -> list[EnvLine]:
    """The statements of one node's environment, in the order they must run.

    Library defaults first, then the user's `env` (so it can override them, e.g.
    NCCL_DEBUG), then the run contract and the runtime variables last so nothing
    can shadow them. User values are literal: `$HOME` in a value stays the five
    characters.
    """
    lines = [export(k, v) for k, v in backend_env(spec).items()]
    lines += [export(k, v, "from the spec's env" if i == 0 else None)
              for i, (k, v) in enumerate(sorted(spec.env.items()))]  # fmt: skip
    lines += contract_lines(spec, spec_path)
    lines += runtime
    return lines


def env_file(
    spec: JobSpec, cluster: str, runtime: Sequence[EnvLine], spec_path: str = SPEC_FILE
) -> str:
    """Bash text that sets one node's environment (`source` it, or inline it)."""
    return render_template(
        "env.sh.j2",
        job_name=spec.name,
        cluster=cluster,
        lines=env_lines(spec, runtime, spec_path),
    )


# ------------------------------------------------------------------- launcher


def _argv_groups(spec: JobSpec, spec_word: Word, files_dir: Word, module: str) -> list[list[Word]]:
    """The launcher command as groups of words (one flag and its value per group)."""

    def file(name: str) -> Word:
        return (*files_dir, "/" + name)

    workload_module, workload = _workload(spec, spec_word, module)
    train = [[_w("-m"), _w(workload_module), *workload[0]], *workload[1:]]
    elastic = spec.k8s.elastic
    if spec.launcher == "torchrun":
        head: list[list[Word]] = [[_w("torchrun")]]
        if spec.resources.nodes == 1 and elastic is None:
            # One node: a private rendezvous on a free port, nothing to agree on.
            flags = [[_w("--standalone")], [_w("--nnodes"), _w("1")]]
            flags.append([_w("--nproc-per-node"), _w(NPROC)])
        else:
            # c10d rendezvous on the first node: nodes may start in any order and
            # get their group rank from the rendezvous (torchrun ignores, with a
            # warning, --node-rank for c10d, so it is not passed).
            flags = [
                [_w("--nnodes"), _w(NNODES)],
                [_w("--nproc-per-node"), _w(NPROC)],
                [_w("--rdzv-backend"), _w("c10d")],
                [_w("--rdzv-endpoint"), _w(MASTER_ADDR, ":", MASTER_PORT)],
                [_w("--rdzv-id"), _w(spec.name)],
            ]
            if elastic is not None:
                flags.append([_w("--max-restarts"), _w(str(elastic.max_restarts))])
        return head + flags + train
    if spec.launcher == "accelerate":
        head = [[_w("accelerate"), _w("launch")]]
        flags = [[_w("--config_file"), file(ACCELERATE_CONFIG)]]
        if spec.strategy.backend == "deepspeed":
            # The config file names ds_config.json relative to itself; accelerate
            # resolves paths against the working directory, so pass the real one.
            flags.append([_w("--deepspeed_config_file"), file(DS_CONFIG)])
        # A config file cannot hold shell variables: the per-node values are flags.
        flags += [
            [_w("--machine_rank"), _w(NODE_RANK)],
            [_w("--main_process_ip"), _w(MASTER_ADDR)],
            [_w("--main_process_port"), _w(MASTER_PORT)],
        ]
        return head + flags + train
    # deepspeed: with --no_ssh every node starts its own ranks (no pdsh); the
    # hostfile only tells it how many nodes and slots there are.
    head = [[_w("deepspeed")]]
    flags = [
        [_w("--hostfile"), file(HOSTFILE)],
        [_w("--no_ssh")],
        [_w("--node_rank"), _w(NODE_RANK)],
        [_w("--master_addr"), _w(MASTER_ADDR)],
        [_w("--master_port"), _w(MASTER_PORT)],
        # Ranks read LOCAL_RANK from the environment; no `--local_rank=N` argument.
        [_w("--no_local_rank")],
        [_w("--module"), _w(workload_module), *workload[0]],
        *workload[1:],
    ]
    return head + flags


def _workload(spec: JobSpec, spec_word: Word, module: str) -> tuple[str, list[list[Word]]]:
    """What every rank runs, after the launcher's own flags: the module given to `-m`
    and its words (first group on the `-m` line, then one argument per line).

    The built-in loop: `-m shardctl.train <job.yaml>`. An entrypoint: the runner
    `-m shardctl.train.entry script PATH ARGS...` (or `module NAME ARGS...`), which
    runs the user's code and records how it ended (see shardctl.train.entry)."""
    ep = spec.entrypoint
    if ep is None:
        return module, [[spec_word]]
    target = [_w("script"), _w(ep.script)] if ep.script else [_w("module"), _w(ep.module or "")]
    return ENTRY_MODULE, [target, *([_w(arg)] for arg in ep.args)]


def entry_words(spec: JobSpec) -> list[str] | None:
    """The words every rank gives `shardctl.train.entry` (`_workload`'s, as plain
    strings), which it records in DONE; None for the built-in loop."""
    ep = spec.entrypoint
    if ep is None:
        return None
    target = ["script", ep.script] if ep.script else ["module", ep.module or ""]
    return [*target, *ep.args]


def launch_argv(spec: JobSpec, spec_path: str, *, module: str = TRAIN_MODULE) -> list[str]:
    """The launcher's words, ending in `-m <module> <spec_path>` (module: the trainer).

    Runtime values appear as `${SHARDCTL_NODE_RANK}`-style references (see
    RUNTIME_VARS); files the launcher reads as `${SHARDCTL_RENDER_DIR}/<name>`.
    """
    groups = _argv_groups(spec, _w(spec_path), _w(Var(RENDER_DIR_VAR)), module)
    return [plain_word(word) for group in groups for word in group]


def _spec_word(spec_path: str) -> Word:
    # A relative spec path means "beside this script", like the other files, so
    # the rendered folder can be copied anywhere and run from any directory.
    if PurePosixPath(spec_path).is_absolute():
        return _w(spec_path)
    return _w(Var(RENDER_DIR_VAR), "/" + spec_path)


def launch_script(
    spec: JobSpec,
    cluster: str,
    runtime: Sequence[EnvLine],
    spec_path: str,
    *,
    module: str = TRAIN_MODULE,
    node_agent: str | None = None,
) -> str:
    """A complete bash script that sets one node's environment and execs the launcher.

    `spec_path` (the rendered `job.yaml`) is used as-is when absolute, else it is
    taken relative to the script's own folder. `module` is what every rank runs
    with `python -m` (the trainer; tests start a probe instead). `node_agent`: the
    module of a cluster whose node agent the script execs in the watchdog's place,
    above the launcher (Kubernetes: the pod's first process; the other clusters start
    their agent above the script, which then runs no watchdog: `hang_watch_lines`).
    """
    groups = _argv_groups(spec, _spec_word(spec_path), _w(Var(RENDER_DIR_VAR)), module)
    command = [" ".join(quote_word(w) for w in group) for group in groups]
    if spec.launcher in WRAPPED_LAUNCHERS:
        # A rank killed by a signal writes nothing; its launcher, run in-process by the
        # wrapper, knows which rank it was and records it for the node's supervisor
        # (`launch_wrapper`, Slurm's `killed_ranks`). Same Python as the watchdog's.
        command.insert(0, f'"${{{PYTHON_VAR}:-python3}}" -m {LAUNCH_WRAPPER_MODULE}')
    if node_agent is not None:
        # The node agent runs the launcher and, unless `watchdog.enabled: false`, applies
        # the hang rule itself (the watchdog's `HangWatch`): no watchdog between them.
        watch = f" {WATCH_HANGS_FLAG}" if spec.watchdog.enabled else ""
        command.insert(0, f'"${{{PYTHON_VAR}:-python3}}" -m {node_agent}{watch} --')
    elif spec.watchdog.enabled:
        # The watchdog's words, or none under a node agent (`hang_watch_lines`).
        command.insert(0, '"$@"')
    return render_template(
        "launch.sh.j2",
        job_name=spec.name,
        cluster=cluster,
        launcher=spec.launcher,
        render_dir_var=RENDER_DIR_VAR,
        env=env_lines(spec, runtime, spec_path),
        hang_watch=node_agent is None and spec.watchdog.enabled,
        hang_watch_lines=hang_watch_lines(),
        command=command,
    )


def hang_watch_lines() -> list[str]:
    """Who applies the hang rule to the launcher of a script without `node_agent`: the
    node agent above it when it offered (it set the heartbeat folder: this machine's
    and Slurm's agents), told so in the launcher's environment; else (a script run by
    hand) the watchdog, which starts the launcher as its child, passes signals on and
    ends the ranks, with their stacks, when none of them advances. The watchdog's
    Python: the one `shardctl submit` ran under (the local and Slurm clusters export
    it), else the node's python3 (a container image)."""
    return [
        f'if [[ -n "${{{ENV_HEARTBEAT_DIR}:-}}" ]]; then',
        f"  export {ENV_HANG_WATCHER}={AGENT_WATCHES}",
        "  set --",
        "else",
        f'  set -- "${{{PYTHON_VAR}:-python3}}" -m {WATCHDOG_MODULE} --',
        "fi",
    ]


def hostfile(spec: JobSpec) -> str:
    """DeepSpeed's MPI-style hostfile: one `host slots=N` line per node.

    Host names are labels: with `--no_ssh` every node starts its own ranks and
    DeepSpeed only counts hosts and slots (real names are known only at run time).
    """
    hosts = [f"node-{i}" for i in range(spec.resources.nodes)]
    return render_template(
        "hostfile.j2", job_name=spec.name, hosts=hosts, slots=spec.resources.procs_per_node
    )
