"""A preemption signal that reaches the batch shell, or a node task still starting.

Slurm sends the spec's signal (`slurm.signal`) to every process of the job's steps,
but two paths reach the batch shell alone: `scancel --signal=USR2 --batch JOB` and a
site's `--signal=B:USR2@N` (`slurm.signal_batch`). A batch shell without a handler
dies of it, and Slurm ends the job FAILED while its ranks are still running. So both
batch scripts (`sbatch.sh`, `job.sbatch`) trap the signal before anything else and
write it down in the run dir, one file per allocation
(`warnings/slurm-<job>-<requeue>`, named like the allocation's first attempt token);
every node task reads that file while it runs (`batch_warned`) and takes it as the
signal itself: passed on to the ranks, judged as a preemption, requeued. A file, not
a second signal: the srun step may not have started yet (the trap may fire during
`slurm.setup`), and a node task that starts later still finds it.

A signal sent to the steps while a node task is starting (before its handler
exists) would kill it by the signal's default action. The srun line starts the task
with the signal blocked (`env --block-signal`, GNU coreutils): it stays pending
through the interpreter's start-up until `NodeTask` has its handler and unblocks it.
"""

from __future__ import annotations

import shlex
from pathlib import Path, PurePosixPath

WARNINGS_DIR = "warnings"


def warning_file(run_dir: str, job_id: str, requeue: int) -> Path:
    """The file the batch shell of `job_id`'s allocation `requeue` writes on the signal."""
    return Path(run_dir) / WARNINGS_DIR / f"slurm-{job_id}-{requeue}"


def batch_warned(run_dir: str, job_id: str, requeue: int) -> bool:
    """Whether the batch shell of this allocation got the preemption signal."""
    return warning_file(run_dir, job_id, requeue).exists()


def trap_lines(run_dir: str, signal_name: str) -> list[str]:
    """The batch shell's first lines: the preemption signal written down for the node
    tasks instead of ending the shell. None for TERM: the batch shell ends on a cancel
    (`scancel` sends TERM to it as to every step), as it always did."""
    if signal_name == "TERM":
        return []
    folder = shlex.quote(str(PurePosixPath(run_dir) / WARNINGS_DIR))
    return [
        f"# SIG{signal_name} sent to this shell alone (scancel --batch, --signal=B:...) would end",
        "# it and fail the job: it is written down for every node task, which passes it on",
        "# to the ranks (they save) and requeues the job.",
        f"shardctl_warnings={folder}",
        'shardctl_warning="${shardctl_warnings}/slurm-${SLURM_JOB_ID:-0}-${SLURM_RESTART_COUNT:-0}"',
        f'trap \'mkdir -p -- "${{shardctl_warnings}}" && : > "${{shardctl_warning}}"\' '
        f"{signal_name}",
    ]


def hold_words(signal_name: str) -> list[str]:
    """Words before the node task's command on the srun line: the signal stays pending
    until the task's handler exists (`NodeTask` unblocks it)."""
    return ["env", f"--block-signal={signal_name}"]


def background_and_wait(srun_line: str, signal_name: str) -> list[str]:
    """The srun line run so that the shell's trap fires at once (bash runs a trap only
    between commands: with srun in the foreground it would wait for the job's end), and
    the shell's exit code is srun's. Without a trap (TERM) srun runs in the foreground."""
    if signal_name == "TERM":
        return [srun_line]
    return [
        srun_line + " &",
        "shardctl_srun=$!",
        "# wait returns early when the trap runs; srun still runs then, so wait again.",
        'while kill -0 "${shardctl_srun}" 2>/dev/null; do wait "${shardctl_srun}"; done',
        'wait "${shardctl_srun}"',
    ]
