"""The Slurm submission of a job: what submitit is given, and the sbatch script it makes.

    submitit.json   the submitit executor arguments, its parameters (submitit's own
                    names), and the task every node runs: `bash <run_dir>/launch.sh`
    sbatch.sh       the sbatch script submitit submits (shardctl's own text)

Pure and deterministic, like every renderer: no clock, no cluster query, no
submitit import. `shardctl render` and `shardctl submit --dry-run` must not
import submitit (start-up time, and submitit is an optional extra). The sbatch
script is shardctl's own (`sbatch_text`): sorted `#SBATCH` flags with
shlex-quoted values (`batch_flags`, the same in `job.sbatch`), the batch shell's
trap of the preemption signal (`batch_signal.py`), the setup lines, then
`srun ... <python> -u -m submitit.core._submit <folder>`, submitit's entry point,
which runs the node task. When shardctl submits, submitit is handed exactly these
bytes (its executor's hook for the submission text, `_executor` in the backend):
submitit still pickles the task, submits and dispatches it, but its own sbatch
layout is neither copied nor needed.

One submitit task per node (`ntasks_per_node=1`): the task starts that node's
launcher (torchrun, accelerate launch or deepspeed), which starts the node's
ranks. Node rank and master address come from Slurm at run time (see
`launch.py`), never from this file.

Extra `#SBATCH` options (`slurm.sbatch_options`, validated by the spec) go to submitit
as `additional_parameters` and into `job.sbatch` as they are. A pyxis container
(`slurm.container`) becomes `--container-*` words of the one srun line both scripts
run (`srun_args`): the ranks run in the image, the batch shell stays on the host.

Two inputs are not in the spec: the Python that runs submitit's entry point on
the nodes (`python`, default `python3`; the backend passes the interpreter that
runs shardctl, as submitit itself does) and the run directory (default: the
spec's, possibly relative; the backend passes it made absolute, as submitit
makes its folder absolute).
"""

from __future__ import annotations

import json
import shlex
from pathlib import PurePosixPath
from typing import Any

from ...errors import SpecError
from ...rundir import LAUNCH_FILE
from ...spec import JobSpec
from .batch_signal import background_and_wait, hold_words, trap_lines
from .section import mount_plan, slurm_time_minutes

SUBMITIT_FILE = "submitit.json"
SBATCH_FILE = "sbatch.sh"
STANDALONE_FILE = "job.sbatch"  # for `sbatch` by hand, without shardctl or submitit
SUBMITIT_DIR = "submitit"
# The callable that every submitit task runs (pickled by reference).
NODE_TASK = "shardctl.orchestrator.clusters.slurm:NodeTask"

# Parameters of `submitit_parameters` that are not `#SBATCH` flags of their own (the
# additional ones are the spec's `sbatch_options`, written by their own names).
_NOT_FLAGS = frozenset({"setup", "signal_delay_s", "srun_args", "additional_parameters"})


# Stands for job.sbatch's own folder in its srun line, where the shell expands it. A
# control character: no validated spec value holds one, so it cannot be forged.
_HERE = "\x00here\x00"
# The ranks' container has no Slurm client: the batch shell (on the host) finds the
# rendezvous host, and launch.sh reads it from here (see SlurmCluster.runtime_env).
MASTER_ADDR_VAR = "SHARDCTL_MASTER_ADDR"
# The batch shell's function, called after each slurm.setup line, that stops the job
# when the line failed (it reads the line's exit code as its own first `$?`).
SETUP_CHECK = "shardctl_setup_check"


def submitit_folder(run_dir: str) -> str:
    """submitit's folder: one subfolder per job id (pickles, per-node logs)."""
    return str(PurePosixPath(run_dir) / SUBMITIT_DIR / "%j")


def submitit_parameters(spec: JobSpec) -> dict[str, Any]:
    """The parameters given to `SlurmExecutor.update_parameters`, in submitit's names."""
    problems = spec.slurm.run_problems(spec)
    if problems:
        raise SpecError(problems)
    s, r = spec.slurm, spec.resources
    minutes = slurm_time_minutes(s.time)
    assert minutes is not None  # validated by the spec
    params: dict[str, Any] = {
        "job_name": spec.name,
        # The training nodes and the hot spares, held idle beside them (node_task).
        "nodes": r.nodes + s.spare_nodes,
        # One task per node: it runs the node's launcher, which starts the ranks.
        "ntasks_per_node": 1,
        "cpus_per_task": r.procs_per_node * r.cpus_per_proc,
        "time": minutes,
        # Sent `signal_delay_s` before the time limit, and the signal a preemption
        # sends (preempt_send_user_signal). Without `B:` Slurm sends it to every
        # process of the job step: every rank on every node.
        "signal_delay_s": s.signal_delay_s,
        # A job submitted with --requeue may be requeued even where the cluster's
        # JobRequeue default is 0; shardctl requeues after a preemption save.
        "additional_parameters": {"requeue": True},
    }
    if s.signal != "USR2":
        # submitit always writes USR2; a spec that asks for another signal overrides it.
        params["additional_parameters"]["signal"] = f"{s.signal}@{s.signal_delay_s}"
    # submitit's own spelling (`mail_type`); it writes `--mail-type` back. The spec
    # refuses every option set above, so none is overridden here.
    for name, value in s.sbatch_options.items():
        params["additional_parameters"][name.replace("-", "_")] = value
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(s, key)
        if value is not None:
            params[key] = value
    if s.gres is not None:
        params["gres"] = s.gres
    elif r.device == "cuda":
        params["gpus_per_node"] = r.procs_per_node
    if r.memory is not None:
        params["mem"] = r.memory.slurm()
    if s.exclusive:
        params["exclusive"] = True
    setup = setup_lines(spec)
    if setup:
        params["setup"] = setup
    words = srun_args(spec)
    if words:
        params["srun_args"] = words
    return params


def setup_lines(spec: JobSpec) -> list[str]:
    """The batch shell's lines before srun: the container's, then every `slurm.setup`
    line, each followed by its check. The batch shell runs on the first node and
    writes to node 0's log, so the lines' output is there; a line that fails stops
    the job before any launcher starts, naming the line and its exit code (a job that
    ran on after a failed `module load` or venv activation would fail later, unclearly)."""
    lines = container_setup(spec)
    if not spec.slurm.setup:
        return lines
    lines += [
        "# shellcheck disable=SC2320  # its $? is the exit code of the line before each call",
        f'{SETUP_CHECK}() {{ local rc=$?; [ "$rc" -eq 0 ] || {{ echo "shardctl: slurm.setup '
        'line $1 ($2) failed with exit code $rc; no launcher was started" >&2; exit "$rc"; }; }',
    ]
    for number, line in enumerate(spec.slurm.setup, 1):
        lines += [line, f"{SETUP_CHECK} {number} {shlex.quote(line)}"]
    return lines


def container_setup(spec: JobSpec) -> list[str]:
    """Lines of the batch shell (on the host) before srun when the ranks run in a
    container: say what is mounted, and find the rendezvous host for them."""
    c = spec.slurm.container
    if c is None:
        return []
    added = mount_plan(spec).added
    mounted = f"; mounted at their own paths by shardctl: {', '.join(added)}" if added else ""
    return [
        f"# pyxis runs every node's launcher in {c.image}{mounted}",
        "# No scontrol in the container: the first node, the rendezvous host, is found here.",
        f'{MASTER_ADDR_VAR}="$(scontrol show hostnames "${{SLURM_JOB_NODELIST:?}}")"',
        f'export {MASTER_ADDR_VAR}="${{{MASTER_ADDR_VAR}%%[[:space:]]*}}"',
    ]


def srun_args(spec: JobSpec, *, standalone: bool = False) -> list[str]:
    """The words after `srun --unbuffered` (and submitit's --output/--error) in both
    scripts: the pyxis container's, then `slurm.srun_args`. `standalone` (job.sbatch)
    also mounts the script's own folder, which holds launch.sh and job.yaml."""
    s = spec.slurm
    words: list[str] = []
    c = s.container
    if c is not None:
        mounts = mount_plan(spec).entries + ([f"{_HERE}:{_HERE}"] if standalone else [])
        words += [f"--container-image={c.image}", f"--container-mounts={','.join(mounts)}"]
        if c.workdir is not None:
            words.append(f"--container-workdir={c.workdir}")
        if c.mount_home is not None:
            words.append("--container-mount-home" if c.mount_home else "--no-container-mount-home")
        if c.writable is not None:
            words.append("--container-writable" if c.writable else "--container-readonly")
        if c.env:
            words.append(f"--container-env={','.join(c.env)}")
    return words + list(s.srun_args)


def submitit_command(python: str, folder: str) -> str:
    """The command submitit dispatches a task with: its entry point, reading the pickled
    task from `folder` (submitit's executor says the same, `_submitit_command_str`)."""
    return " ".join([python, "-u -m submitit.core._submit", shlex.quote(folder)])


def signal_flag(spec: JobSpec) -> str:
    """`--signal`'s value: the spec's signal `signal_delay_s` before the time limit, to
    the batch shell alone with `slurm.signal_batch` (`B:`)."""
    s = spec.slurm
    return f"{'B:' if s.signal_batch else ''}{s.signal}@{s.signal_delay_s}"


def batch_flags(spec: JobSpec, params: dict[str, Any]) -> dict[str, Any]:
    """The `#SBATCH` flags of both batch scripts by sbatch's long names: the resources
    of `params` (`submitit_parameters`), the signal, `--requeue` (shardctl requeues the
    job itself after a save), and the spec's `sbatch_options` as written."""
    flags = {
        key.replace("_", "-"): value
        for key, value in params.items()
        if key not in _NOT_FLAGS and value is not None
    }
    flags["signal"] = signal_flag(spec)
    flags["requeue"] = True
    flags["open-mode"] = "append"
    flags.update(spec.slurm.sbatch_options)
    return flags


def _sbatch_lines(flags: dict[str, Any]) -> list[str]:
    return [
        f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={shlex.quote(str(value))}"
        for key, value in sorted(flags.items())
    ]


def sbatch_text(spec: JobSpec, sub: dict[str, Any]) -> str:
    """The sbatch script `shardctl submit` hands to submitit for the `submission` `sub`
    (see the module docstring): one srun of submitit's entry point on every node, which
    runs the node task, in the background while the shell waits with its trap."""
    params, folder = sub["parameters"], sub["executor"]["folder"]
    stdout = str(PurePosixPath(folder) / "%j_%t_log.out")
    stderr = str(PurePosixPath(folder) / "%j_%t_log.err")
    flags = batch_flags(spec, params)
    # Node 0's task and the batch shell write to node 0's files (submitit's names).
    flags["output"] = stdout.replace("%t", "0")
    flags["error"] = stderr.replace("%t", "0")
    lines = [
        "#!/bin/bash",
        f"# Job {spec.name}, rendered by shardctl: `shardctl submit --cluster slurm` has",
        "# submitit submit exactly this script; submitit's entry point runs the node task.",
        *_sbatch_lines(flags),
        "",
        *trap_lines(sub["task"]["run_dir"], spec.slurm.signal),
    ]
    if params.get("setup"):
        lines += ["", "# setup", *params["setup"]]
    srun = ["srun", "--unbuffered", "--output", stdout, "--error", stderr]
    srun += [*(params.get("srun_args") or []), *hold_words(spec.slurm.signal)]
    command = submitit_command(sub["executor"]["python"], folder)
    srun_line = " ".join(shlex.quote(w) for w in srun) + " " + command
    lines += [
        "",
        "# command",
        "export SUBMITIT_EXECUTOR=slurm",
        *background_and_wait(srun_line, spec.slurm.signal),
        "",
    ]
    return "\n".join(lines)


def node_task(spec: JobSpec, run_dir: str) -> dict[str, Any]:
    """What the submitit task on every node runs (arguments of `NodeTask`)."""
    task: dict[str, Any] = {
        "callable": NODE_TASK,
        "command": ["bash", str(PurePosixPath(run_dir) / LAUNCH_FILE)],
        "signal": spec.slurm.signal,
        "max_requeues": spec.slurm.max_requeues,
        "max_restarts_in_allocation": spec.restart.max_in_allocation,
        "run_dir": run_dir,
        "checkpoint_dir": spec.checkpoint_dir,
    }
    if spec.slurm.spare_nodes:  # only then: a job without spares renders as before
        task["spare_nodes"] = spec.slurm.spare_nodes
    return task


def submission(spec: JobSpec, *, python: str = "python3", run_dir: str | None = None) -> dict:
    """Everything given to submitit: executor arguments, parameters, the node task."""
    run_dir = run_dir or spec.run_dir
    folder = submitit_folder(run_dir)
    return {
        "executor": {
            "folder": folder,
            # Unused by shardctl's node task (it requeues itself after the ranks
            # saved, see clusters/slurm.py); set to the same bound for clarity.
            "max_num_timeout": spec.slurm.max_requeues,
            "python": python,
        },
        "parameters": submitit_parameters(spec),
        "task": node_task(spec, run_dir),
    }


def standalone_batch(spec: JobSpec, params: dict[str, Any] | None = None) -> str:
    """A batch script to `sbatch` by hand, without shardctl's CLI or submitit.

    The same resources, time, signal and requeue flags as `sbatch.sh`, the same trap of
    the preemption signal in the batch shell and the same node task: one `srun` runs
    `python -m shardctl.orchestrator.clusters.slurm` (`NodeTask`) on every node, which
    runs the node's launch script (found beside this script), so a job started by hand
    is fenced by attempt, restarts in place within `restart.max_in_allocation`,
    requeues itself within `slurm.max_requeues` and leaves a bad node behind as a
    submitted one does. The nodes' python (`SHARDCTL_PYTHON`, default `python3`) must
    import shardctl. `params`: `submitit_parameters(spec)` when the caller has them.
    """
    if params is None:
        params = submitit_parameters(spec)
    s = spec.slurm
    lines = [
        "#!/bin/bash",
        f"# Batch script of job {spec.name}, rendered by shardctl, for `sbatch` by hand:",
        f"#   sbatch {STANDALONE_FILE}     (launch.sh and job.yaml must lie beside it)",
        "# `shardctl submit --cluster slurm` uses sbatch.sh (submitit) instead; both run",
        "# shardctl's node task on every node.",
        *_sbatch_lines(batch_flags(spec, params)),
        "set -uo pipefail",
        "",
        *trap_lines(spec.run_dir, s.signal),
    ]
    setup = setup_lines(spec)
    if setup:
        lines += ["", "# setup (slurm.setup)", *setup]
    task = [
        "-m", "shardctl.orchestrator.clusters.slurm", "--run-dir", spec.run_dir,
        "--checkpoint-dir", spec.checkpoint_dir, "--signal", s.signal,
        "--max-requeues", str(s.max_requeues),
        "--max-restarts", str(spec.restart.max_in_allocation),
        *(["--spare-nodes", str(s.spare_nodes)] if s.spare_nodes else []), "--", "bash",
    ]  # fmt: skip
    srun = ["srun", "--unbuffered", *srun_args(spec, standalone=True), *hold_words(s.signal)]
    srun_line = (
        " ".join(shlex.quote(w).replace(_HERE, "'\"${here}\"'") for w in srun)
        + ' "${python}" '
        + " ".join(shlex.quote(w) for w in task)
        + f' "${{here}}/{LAUNCH_FILE}"'
    )
    mounts_here = (
        ["# pyxis also mounts this script's folder (launch.sh, job.yaml) at its own path."]
        if s.container is not None
        else []
    )
    lines += [
        "",
        "# Slurm keeps a copy of this script; the original's folder holds launch.sh.",
        'script="$(scontrol show job -o "${SLURM_JOB_ID:?run this with sbatch}" '
        "| sed -n 's/.* Command=\\([^ ]*\\).*/\\1/p' || true)\"",
        'here="$(dirname -- "${script:-${SLURM_SUBMIT_DIR:-.}/x}")"',
        'python="${SHARDCTL_PYTHON:-python3}"',
        *mounts_here,
        "# Every node's task runs its launcher, passes the signal on to the ranks and",
        "# judges the attempt with shardctl's one classifier (docs/guides/faults.md): a",
        "# crash or a hang with restarts left starts every launcher again here; node 0",
        "# requeues the job after a preemption or a hang, or stops it, saying why.",
        *background_and_wait(srun_line, s.signal),
        "",
    ]
    return "\n".join(lines)


def slurm_artifacts(
    spec: JobSpec,
    *,
    python: str = "python3",
    run_dir: str | None = None,
    sub: dict[str, Any] | None = None,
) -> dict[str, str]:
    """`submitit.json`, `sbatch.sh` and `job.sbatch` for `spec` (see the module docstring).
    `sub`: the `submission` when the caller made it already (a dry run holds it as its
    request; `python` and `run_dir` are then its own)."""
    if sub is None:
        sub = submission(spec, python=python, run_dir=run_dir)
    return {
        SUBMITIT_FILE: json.dumps(sub, indent=2, sort_keys=True) + "\n",
        SBATCH_FILE: sbatch_text(spec, sub),
        STANDALONE_FILE: standalone_batch(spec, sub["parameters"]),
    }
