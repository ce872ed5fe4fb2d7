"""The Slurm backend: submitit submits; every node runs its launcher; preemption and
hangs requeue.

Submission. `dryrun(spec)` is pure: it makes the run directory absolute (the
nodes read it from `job.yaml`), renders every file the nodes need (`launch.sh`,
`job.yaml`, launcher configs) and the submission (`submitit.json`,
`sbatch.sh`, see `render_slurm`). `schedule` first asks Slurm whether it would
take that script (`sbatch --test-only`: a bad partition or time limit is
refused before anything is written), then writes the files into the run
directory and submits through submitit: ONE submitit task per node
(`nodes=N, ntasks_per_node=1`), each running `NodeTask`, which runs the node's
`launch.sh` (torchrun / accelerate launch / deepspeed) with node rank and master
address taken from Slurm at run time.

Preemption and time limits. Slurm sends the spec's signal (USR2 by default;
USR1 is NCCL's) `signal_delay_s` before the time limit, on `scancel
--signal=USR2`, and on a preemption (`preempt_send_user_signal`). Without `B:`
it goes to every process of the job step, so every rank on every node gets it
(proctrack/cgroup and linuxproc signal the whole process tree; where the
cluster uses proctrack/pgid only the task's process group would, so `NodeTask`
forwards it as well, see `node_task.py`). The ranks set a flag, agree at the next step
boundary, save one sharded checkpoint together, and exit with
`EXIT_PREEMPTED`; rank 0 writes `PREEMPTED` in the run directory. Then the
task of node 0 requeues the job (`scontrol requeue`), which starts again after
Slurm's requeue hold and resumes from that checkpoint (`checkpoint.resume:
auto`). `slurm.max_requeues` bounds the number of requeues (Slurm counts them in
`SLURM_RESTART_COUNT`).

What runs on each node (`NodeTask`: signals, the classifier's verdict, requeues,
restarts in place, hangs) is `node_task.py`; its rounds of restarts are `rounds.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ClusterError, MissingDependencyError, UsageError
from ...launch import EnvLine, export, export_from
from ...launcher_output import LauncherReport, readable
from ...outcome import Kind, from_marker, last_attempt
from ...rundir import CLOCK_SLACK_S, ENV_ATTEMPT, ENV_WARNING_HOLD, HUNG_FILE, TOKEN_FIELD, RunDir
from ...spec import JobSpec, parse_spec
from ...storage import is_object_url
from ..base import (
    Cluster,
    DryRun,
    FileTail,
    JobRef,
    JobState,
    JobStatus,
    NodeView,
    hung_detail,
    prefix_lines,
    require_script,
)
from ..writer import LEDGER, write_rendered
from .bad_nodes import left_behind_detail
from .node_task import NodeTask
from .queries import (
    PLAIN_JOB_ID,
    SACCT_FIELDS,
    accounting_lines,
    controller_jobs,
    scontrol_job,
)
from .rank_nodes import node_of_rank
from .refusals import refused, run_quietly
from .rounds import requeue_of_token
from .sbatch import (
    MASTER_ADDR_VAR,
    SBATCH_FILE,
    STANDALONE_FILE,
    sbatch_text,
    slurm_artifacts,
    submission,
)
from .section import SlurmSection

# `NodeTask` stays importable from here: submitit pickles the task by reference, and a
# job submitted before it moved to node_task.py unpickles it by this package's path.
if TYPE_CHECKING:
    from ...doctor import Preflight

log = logging.getLogger(__name__)

# Slurm job states (sacct / scontrol) → shardctl's. One table; UNKNOWN otherwise.
STATE_TABLE: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED,
    "FAILED": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "DEADLINE": JobState.FAILED,
    "TIMEOUT": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
    "REVOKED": JobState.CANCELLED,
    "PREEMPTED": JobState.PREEMPTED,
    "REQUEUED": JobState.PREEMPTED,
    "REQUEUE_FED": JobState.PREEMPTED,
    "SUSPENDED": JobState.PREEMPTED,
    "STOPPED": JobState.PREEMPTED,
}


def map_state(native: str) -> JobState:
    """A Slurm state word (`CANCELLED by 0` → CANCELLED) as a JobState."""
    word = native.strip().split(" ", 1)[0].rstrip("+").upper() if native.strip() else ""
    return STATE_TABLE.get(word, JobState.UNKNOWN)


# --------------------------------------------------------------------- the backend


class SlurmCluster(Cluster):
    """`python`: the interpreter that runs submitit's entry point on the nodes (default
    `python3` for a portable render; the dry run of a submission uses the one running
    shardctl, as submitit itself does)."""

    name = "slurm"
    next_step = (
        "submit it: shardctl submit {spec} --cluster slurm  (submitit runs launch.sh on "
        "every node)\n       or by hand: sbatch {out}/" + STANDALONE_FILE
    )

    spec_section = SlurmSection

    def __init__(self, python: str | None = None) -> None:
        self.python = python

    def preflight(self, spec: JobSpec) -> Preflight:
        from .preflight import slurm_preflight

        return slurm_preflight(spec)

    def preemption_budget(self, spec: JobSpec) -> tuple[int, str] | None:
        return spec.slurm.signal_delay_s, "slurm.signal_delay_s"

    def runtime_env(self, spec: JobSpec) -> list[EnvLine]:
        where = "run this script inside a Slurm allocation (srun)"
        if spec.slurm.container is not None:
            # In a pyxis container there is no scontrol: the batch shell found the host.
            master = [
                EnvLine(
                    f'export MASTER_ADDR="${{{MASTER_ADDR_VAR}:?set by the batch script on '
                    'the host (slurm.container: no scontrol in the image)}"',
                    "the first node of the allocation, found by the batch script",
                )
            ]
        else:
            # The first host of the allocation hosts the rendezvous. No pipe into
            # `head`: with pipefail, scontrol's SIGPIPE on a long list would fail.
            master = [
                EnvLine(
                    f'MASTER_ADDR="$(scontrol show hostnames "${{SLURM_JOB_NODELIST:?{where}}}")"',
                    "the first node of the allocation",
                ),
                EnvLine('MASTER_ADDR="${MASTER_ADDR%%[[:space:]]*}"'),
                EnvLine("export MASTER_ADDR"),
            ]
        if spec.slurm.spare_nodes:
            # The allocation holds spares beside the training nodes: the node task says
            # which node rank this node trains as in each round (`spares.py`).
            nodes = [
                export("SHARDCTL_NNODES", str(spec.resources.nodes)),
                export_from(
                    "SHARDCTL_NODE_RANK", "SHARDCTL_NODE_RANK",
                    "run this script under the shardctl node task (slurm.spare_nodes)",
                    "this node's rank in this round, set by the node task (spares stand by)",
                ),
            ]  # fmt: skip
        else:
            nodes = [
                export_from("SHARDCTL_NNODES", "SLURM_JOB_NUM_NODES", where),
                export_from(
                    "SHARDCTL_NODE_RANK", "SLURM_NODEID", where, "this node's index, set by Slurm"
                ),
            ]
        # A warning that reaches a rank before its script has a handler waits for one
        # half of the grace period at most: the other half is left for the save.
        hold = [] if ENV_WARNING_HOLD in spec.env else [
            export(ENV_WARNING_HOLD, str(spec.slurm.signal_delay_s // 2),
                   "a warning waits for the script's handler: half of slurm.signal_delay_s"),
        ]  # fmt: skip
        return [
            *nodes,
            export("SHARDCTL_NPROC_PER_NODE", str(spec.resources.procs_per_node)),
            *master,
            export("MASTER_PORT", str(spec.slurm.master_port)),
            *hold,
            EnvLine(
                f'export {ENV_ATTEMPT}="${{SLURM_RESTART_COUNT:-0}}"',
                "requeues of this job so far",
            ),
        ]

    def own_artifacts(self, node: NodeView, common: dict[str, str]) -> dict[str, str]:
        return slurm_artifacts(node.spec, python=self.python or "python3")

    def dryrun(self, spec: JobSpec) -> DryRun:
        require_script(spec, "every node sees at this path (a shared file system)")
        node_spec = _absolute_run_dir(spec)
        # submitit's entry point runs where the ranks run: in a container that is the
        # image's python3 (this interpreter's path means nothing there).
        here = "python3" if spec.slurm.container is not None else shlex.quote(sys.executable)
        python = self.python or here
        # The submitit parameters, computed once: the request `schedule` hands to
        # submitit, and the source of submitit.json, sbatch.sh and job.sbatch.
        request = submission(node_spec, python=python, run_dir=node_spec.run_dir)
        files = self.artifacts(node_spec, own=slurm_artifacts(node_spec, sub=request))
        text = (
            "# submitit.SlurmExecutor(**executor).update_parameters(**parameters); "
            "one task per node runs `task`\n"
            + json.dumps(request, indent=2, sort_keys=True)
            + f"\n# {SBATCH_FILE}: the script submitit gives to sbatch\n"
            + files[SBATCH_FILE]
        )
        return DryRun(
            cluster=self.name,
            spec=node_spec,
            artifacts=dict(sorted(files.items())),
            request=request,
            text=text,
        )

    def schedule(self, dryrun: DryRun) -> JobRef:
        spec, request = dryrun.spec, dryrun.request
        _require_slurm()
        shown = dryrun.artifacts[SBATCH_FILE]
        # The script shown must be the one the request renders (a dry run changed after
        # it was shown is refused before anything is written or queued); submitit then
        # sends exactly `shown`.
        executor = _executor(request, shown, sbatch_text(spec, request))
        # Slurm judges the script before anything is written or submitted.
        _test_only(spec, shown)
        run_dir = Path(spec.run_dir)
        created = _write_files(run_dir, dryrun.artifacts)
        before = _listing(run_dir / "submitit")
        try:
            job = _submit(executor, request["task"])
        except BaseException:
            _undo(run_dir, created, before)
            raise
        return JobRef(
            cluster=self.name,
            job_id=str(job.job_id),
            name=spec.name,
            run_dir=str(run_dir),
            extra={
                "folder": str(Path(request["executor"]["folder"].replace("%j", str(job.job_id)))),
                # Every node holds a log, the spares' too.
                "nodes": spec.resources.nodes + spec.slurm.spare_nodes,
            },
        )

    def status(self, ref: JobRef) -> JobStatus:
        _require_slurm()
        info = scontrol_job(ref.job_id)
        if info is not None:
            return _held_status(ref, info)
        # Gone from the controller's memory (MinJobAge): ask the accounting database.
        out = _run(["sacct", "-j", ref.job_id, "-X", "-n", "-P", "-o", SACCT_FIELDS])
        return _accounted_status(ref, next((x for x in out.splitlines() if x.strip()), ""))

    # `ls`: one `scontrol` and one `sacct` for all the jobs (queries.py), not one of
    # each per job.
    batch_status = True

    def status_many(self, refs: Sequence[JobRef]) -> list[JobStatus | Exception]:
        """`status` of every job of `refs`, asking the controller once and the accounting
        database once for those the controller no longer holds (`queries.py`); a job
        id that is not a plain number is asked about on its own."""
        _require_slurm()
        plain = [r for r in refs if PLAIN_JOB_ID.fullmatch(r.job_id)]
        held = controller_jobs() if plain else {}
        accounted = accounting_lines(r.job_id for r in plain if r.job_id not in held)
        answers: list[JobStatus | Exception] = []
        for ref in refs:
            try:
                if not PLAIN_JOB_ID.fullmatch(ref.job_id):
                    answers.append(self.status(ref))
                elif ref.job_id in held:
                    answers.append(_held_status(ref, held[ref.job_id]))
                else:
                    answers.append(_accounted_status(ref, accounted.get(ref.job_id, "")))
            except Exception as exc:  # this job's own (its run dir's files): on its row
                answers.append(exc)
        return answers

    def logs(self, ref: JobRef, tail: int | None = None) -> str:
        folder = _log_folder(ref)
        nodes = int(ref.extra.get("nodes", 1))
        parts: list[str] = []
        for node in range(nodes):
            for kind in ("out", "err"):
                path = folder / f"{ref.job_id}_{node}_log.{kind}"
                parts.append(f"==> node {node} std{kind} ({path}) <==\n")
                if not path.is_file():
                    parts.append("(no output yet)\n")
                    continue
                text = readable(path.read_text(errors="replace"), where=str(path))
                if tail is not None:
                    text = "".join(text.splitlines(keepends=True)[-tail:])
                parts.append(text if text.endswith("\n") or not text else text + "\n")
        return "".join(parts)

    def has_ended(self, ref: JobRef, st: JobStatus) -> bool:
        # UNKNOWN: neither the controller nor the accounting database knows the job.
        return st.state.is_terminal or st.state is JobState.UNKNOWN

    def follow_logs(
        self,
        ref: JobRef,
        write: Callable[[str], None],
        *,
        node: int | None = None,
        tail: int | None = None,
        poll_s: float | None = None,
    ) -> None:
        """`logs -f`: every node's stdout and stderr (submitit's per-task files on the
        shared run dir) as they grow, each line prefixed `[node N/out]` or `[node N/err]`,
        until Slurm says the job ended; a requeued job keeps writing to the same files."""
        nodes = int(ref.extra.get("nodes", 1))
        if node is not None and not 0 <= node < nodes:
            raise UsageError(
                f"--node {node}: job {ref.name!r} has {nodes} node(s); accepted: 0..{nodes - 1}"
            )
        pump = self._log_pump(ref, write, node=node, tail=tail)
        wait = self.poll_s if poll_s is None else poll_s
        while not self.has_ended(ref, self.status(ref)):
            pump()
            time.sleep(wait)
        pump(final=True)

    def _log_pump(
        self,
        ref: JobRef,
        write: Callable[[str], None],
        *,
        node: int | None = None,
        tail: int | None = None,
    ) -> Callable[..., None]:
        """A function that writes what every node's (or `node`'s) log files gained since
        its last call, each line prefixed; `final=True` flushes unfinished lines."""
        nodes = int(ref.extra.get("nodes", 1))
        folder = _log_folder(ref)
        tails = [
            (FileTail(path := folder / f"{ref.job_id}_{n}_log.{kind}", tail=tail),
             LauncherReport(str(path)), f"[node {n}/{kind}] ")
            for n in range(nodes) if node is None or n == node
            for kind in ("out", "err")
        ]  # fmt: skip

        def pump(final: bool = False) -> None:
            for file_tail, report, prefix in tails:
                text = report.feed(file_tail.poll(final=final))
                if final:
                    text += report.close()
                if text:
                    write(prefix_lines(prefix, text))

        return pump

    def node_of_rank(self, ref: JobRef, rank: int) -> tuple[int, str] | None:
        """The node (index, host) that ran global `rank` in the job's newest attempt,
        as its node task recorded it: torchrun's rendezvous numbers nodes by arrival."""
        return node_of_rank(ref.run_dir, ref.job_id, rank) if ref.run_dir else None

    # `submit --wait`: every node's output until the job ends, then its exit code.
    can_follow = True
    follow_ticks = True

    def follow(
        self,
        ref: JobRef,
        write: Callable[[str], None] | None = None,
        poll_s: float | None = None,
        tick: Callable[[], None] | None = None,
    ) -> int:
        """`submit --wait`: every node's output as `logs -f` shows it, through queueing
        and requeues, until Slurm says the job ended; return its exit code
        (`exit_code_of`, the one `status --watch` exits with). Ctrl-C cancels the job
        (`cancel`: the ranks stop, it is never requeued) and keeps following until it
        ended; `tick` is called after each read (the progress bar)."""
        out = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        pump = self._log_pump(ref, out)
        wait = self.poll_s if poll_s is None else poll_s
        while not self.has_ended(ref, st := self.status(ref)):
            try:
                pump()
                if tick is not None:
                    tick()
                time.sleep(wait)
            except KeyboardInterrupt:
                out(f"\nshardctl: cancelling Slurm job {ref.job_id} (its ranks stop) ...\n")
                with contextlib.suppress(ClusterError):  # it may have ended meanwhile
                    self.cancel(ref)
        pump(final=True)
        if tick is not None:
            tick()
        return self.exit_code_of(ref, st)

    def cancel(self, ref: JobRef) -> None:
        _require_slurm()
        # scancel of a job that ended, or one Slurm forgot, says nothing and exits 0:
        # ask first, so the user hears what really happened.
        st = self.status(ref)
        if st.state.is_terminal or st.state is JobState.UNKNOWN:
            detail = f" ({st.detail})" if st.detail else ""
            raise ClusterError(
                f"job {ref.name!r} (Slurm job {ref.job_id}) is not running: "
                f"{st.state.value} [{st.native_state or 'unknown'}]{detail}; nothing to cancel"
            )
        # scancel signals every step on every node (SIGTERM, then SIGKILL after KillWait).
        _run(["scancel", ref.job_id], what=f"cancel job {ref.job_id}")


def _held_status(ref: JobRef, info: dict[str, str]) -> JobStatus:
    """A job's status from the controller's fields (`scontrol show job -o`) and its run
    dir (a shared file system)."""
    native = info.get("JobState", "")
    detail = []
    if info.get("Reason") not in (None, "None"):
        detail.append(f"reason {info['Reason']}")
    restarts = int(info.get("Restarts", "0") or 0)
    if restarts:
        detail.append(f"requeued {restarts} time(s)")
    if info.get("NodeList") not in (None, "(null)", ""):
        detail.append(f"nodes {info['NodeList']}")
    state = map_state(native)
    # The last attempt's HUNG: the one before this on a job that runs again, this one
    # on a job that failed (out of requeues).
    last = restarts if state is JobState.FAILED else restarts - 1
    hung = _hang_of(ref, state, lambda marker: _of_requeue(marker, ref.job_id, last))
    left = left_behind_detail(ref.run_dir, ref.job_id) if ref.run_dir else ""
    detail += [x for x in (hung, _stopped_why(ref, state), left) if x]
    return JobStatus(state, native, ", ".join(detail))


def _accounted_status(ref: JobRef, line: str) -> JobStatus:
    """A job's status from its line of `sacct -o <SACCT_FIELDS>` ("": the accounting
    database does not know it) and its run dir."""
    if not line:
        return JobStatus(JobState.UNKNOWN, "", f"Slurm knows no job {ref.job_id}")
    native, exit_code, nodes, start = ([*line.split("|"), "", "", ""])[:4]
    state, detail = map_state(native), [f"exit code {exit_code}, nodes {nodes}"]
    began = _slurm_time(start)
    hung = _hang_of(ref, state, lambda marker: _of_job(marker, ref.job_id, began))
    left = left_behind_detail(ref.run_dir, ref.job_id) if ref.run_dir else ""
    detail += [x for x in (hung, _stopped_why(ref, state), left) if x]
    return JobStatus(state, native, ", ".join(detail))


def _hang_of(ref: JobRef, state: JobState, of_interest: Callable[[dict[str, Any]], bool]) -> str:
    """What `status` adds about a HUNG marker in the run dir (a shared file system):
    on a job requeued (PENDING, RUNNING again), that its last attempt hung; on a job
    that FAILED, that it hung; nothing when `of_interest` says the marker is older."""
    if state not in (JobState.FAILED, JobState.PENDING, JobState.RUNNING, JobState.PREEMPTED):
        return ""
    marker = RunDir.of(ref.run_dir).read_marker(HUNG_FILE) if ref.run_dir else None
    if marker is None or not of_interest(marker):
        return ""
    # Read as the classifier reads it: a typed outcome (display text from its marker).
    hung = from_marker(HUNG_FILE, marker)
    if hung.kind is not Kind.HUNG:
        return ""
    if state is JobState.FAILED:
        return hung_detail(marker, ref.name)
    report = str(marker.get("report") or "")
    with contextlib.suppress(ValueError):
        report = str(Path(report).relative_to(ref.run_dir))
    see = f" (see {report})" if report else ""
    return f"last attempt hung at step {'?' if hung.step is None else hung.step}{see}"


def _stopped_why(ref: JobRef, state: JobState) -> str:
    """Why a job that FAILED stopped instead of requeueing, as the supervisor that
    judged its last attempt recorded it (`attempts.jsonl`): the script said do not
    retry, or no new checkpoint in several attempts."""
    if state is not JobState.FAILED or not ref.run_dir:
        return ""
    entry = last_attempt(ref.run_dir, ref.job_id)
    if entry is None or entry.get("decision") != "stop":
        return ""
    return str(entry.get("summary") or "")


def _slurm_time(text: str) -> float | None:
    """A Slurm timestamp (`2024-05-01T12:00:00`, local time) as seconds since the epoch."""
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None


def _of_requeue(marker: dict[str, Any], job_id: str, requeue: int) -> bool:
    """Whether a marker is evidence of requeue `requeue` of job `job_id`: by the round
    token it carries (`rounds.round_token`). A marker without one (an older version's)
    by the attempt number its watchdog wrote."""
    token = marker.get(TOKEN_FIELD)
    if isinstance(token, str) and token:
        return requeue_of_token(token, job_id) == requeue
    return marker.get("attempt") == requeue


def _of_job(marker: dict[str, Any], job_id: str, began: float | None) -> bool:
    """Whether a marker is evidence of some attempt of job `job_id`: by the round token
    it carries, whatever its time says (a node's clock may be skewed, another job of the
    run may have ended in the job's first second). A marker without a token (an older
    version's) by its time: written at or after the job began (sacct's Start)."""
    token = marker.get(TOKEN_FIELD)
    if isinstance(token, str) and token:
        return requeue_of_token(token, job_id) is not None
    return _written_since(marker, began)


def _written_since(marker: dict[str, Any], began: float | None) -> bool:
    """The time rule for a tokenless marker of an older version (`_of_job`)."""
    written = marker.get("time")
    return (
        began is not None and isinstance(written, int | float) and written >= began - CLOCK_SLACK_S
    )


def _log_folder(ref: JobRef) -> Path:
    """submitit's folder of the job, which holds `<id>_<node>_log.out|err`."""
    return Path(ref.extra.get("folder") or Path(ref.run_dir) / "submitit" / ref.job_id)


# ------------------------------------------------------------- submit-side helpers


def _absolute_run_dir(spec: JobSpec) -> JobSpec:
    """The spec as the nodes read it: run and checkpoint directories absolute."""
    run_dir, ckpt = os.path.abspath(spec.run_dir), spec.checkpoint_dir
    if not is_object_url(ckpt):  # an s3:// URL is the same everywhere
        ckpt = os.path.abspath(ckpt)
    if (run_dir, ckpt) == (spec.run_dir, spec.checkpoint_dir):
        return spec
    data = spec.to_yaml_dict()
    data["run_dir"], data["checkpoint"]["dir"] = run_dir, ckpt
    return parse_spec(data)


def _require_slurm() -> None:
    if shutil.which("sbatch") is None:
        raise ClusterError(
            "no Slurm client (sbatch) on PATH; run shardctl on a Slurm login node, or start "
            "a single-machine Slurm with `sudo scripts/slurm-dev-cluster up`"
        )


def _run(argv: list[str], what: str | None = None, stdin: str | None = None) -> str:
    try:
        proc = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"{what or argv[0]}: {exc}") from None
    if proc.returncode != 0 and what is not None:
        raise ClusterError(f"{what}: {argv[0]} says: {_slurm_message(proc.stderr)}")
    return proc.stdout


def _slurm_message(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    # sbatch prints "sbatch: error: Batch job submission failed: <reason>" last.
    for ln in reversed(lines):
        m = re.search(r"error:\s*(.*)", ln)
        if m:
            return m.group(1)
    return lines[-1] if lines else "(no message)"


def _test_only(spec: JobSpec, sbatch: str) -> None:
    """Ask slurmctld whether it would accept the script; raise a clear error if not."""
    try:
        proc = subprocess.run(
            ["sbatch", "--test-only"], input=sbatch, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"sbatch --test-only: {exc}") from None
    if proc.returncode == 0:
        return
    raise ClusterError(refused(spec, _slurm_message(proc.stderr), run_quietly))


def _write_files(run_dir: Path, files: dict[str, str]) -> list[Path]:
    """Write the rendered files; return what did not exist before (for undo)."""
    created: list[Path] = []
    missing = run_dir
    while not missing.exists():
        created.append(missing)
        missing = missing.parent
    created += [run_dir / n for n in [*files, LEDGER] if not (run_dir / n).exists()]
    write_rendered(files, run_dir)
    return created


def _listing(folder: Path) -> set[Path]:
    return set(folder.rglob("*")) if folder.is_dir() else set()


def _undo(run_dir: Path, created: list[Path], before: set[Path]) -> None:
    """Remove what a failed submission left: submitit's files, then ours."""
    for path in sorted(_listing(run_dir / "submitit") - before, reverse=True):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    for path in sorted(created, key=lambda p: len(p.parts), reverse=True):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    sub = run_dir / "submitit"
    if sub.is_dir() and not before and not any(sub.iterdir()):
        sub.rmdir()


def _executor(request: dict[str, Any], shown: str, made: str) -> Any:
    """submitit's `SlurmExecutor` for the dry run's `request`, which submits `shown`.

    The script is shardctl's own (`sbatch.sbatch_text`): `made` is it rendered from the
    request again, and a `shown` that differs (a dry run changed after it was shown) is
    refused before anything is queued. submitit's hook for the submission text
    (`_make_submission_file_text`, what its `submit` writes and hands to sbatch) returns
    `shown` itself, once it holds the command submitit dispatches the task with.
    """
    _same_script(shown, made)
    try:
        import submitit
    except ImportError:
        raise MissingDependencyError("submitit", "slurm", "submitting to Slurm") from None

    class ShownScript(submitit.SlurmExecutor):
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            _runs(shown, command)
            return shown

    ex = request["executor"]
    executor = ShownScript(
        folder=ex["folder"], max_num_timeout=ex["max_num_timeout"], python=ex["python"]
    )
    executor.update_parameters(**request["parameters"])
    _runs(shown, executor._submitit_command_str)
    return executor


def _runs(shown: str, command: str) -> None:
    """Raise when the shown script does not run submitit's entry point as this submitit
    dispatches it (its command names the interpreter and the folder of the pickles)."""
    if f" {command} &\n" in shown or shown.rstrip("\n").endswith(f" {command}"):
        return
    from submitit import __version__ as submitit_version

    raise ClusterError(
        f"submitit {submitit_version} dispatches the node task with `{command}`, which "
        f"the rendered {SBATCH_FILE} does not run; nothing was queued and no file was "
        "written. Report this as a shardctl bug, naming the submitit version"
    )


def _same_script(shown: str, made: str) -> None:
    """Raise, saying what differs, when the script shown is not the request's."""
    if made == shown:
        return
    import difflib

    diff = list(
        difflib.unified_diff(
            shown.splitlines(),
            made.splitlines(),
            f"{SBATCH_FILE} (the dry run)",
            f"{SBATCH_FILE} (rendered from its request)",
            lineterm="",
        )
    )
    shown_diff = "\n".join(diff[:40] + (["..."] if len(diff) > 40 else []))
    raise ClusterError(
        "the sbatch script to submit differs from the one the dry run showed; "
        "nothing was queued and no file was written.\n"
        f"{shown_diff}\n"
        "the dry run was changed after it was made; report this as a shardctl bug"
    )


def _submit(executor: Any, task: dict[str, Any]) -> Any:
    from submitit.core.utils import FailedJobError

    try:
        return executor.submit(
            NodeTask(
                command=task["command"],
                run_dir=task["run_dir"],
                signal_name=task["signal"],
                max_requeues=task["max_requeues"],
                checkpoint_dir=task.get("checkpoint_dir"),
                max_restarts=task.get("max_restarts_in_allocation", 0),
                spare_nodes=task.get("spare_nodes", 0),
            )
        )
    except (FailedJobError, subprocess.CalledProcessError) as exc:
        raise ClusterError(f"sbatch refused the job: {_slurm_message(str(exc))}") from None
