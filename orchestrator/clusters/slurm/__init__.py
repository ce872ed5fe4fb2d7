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
forwards it as well, see below). The ranks set a flag, agree at the next step
boundary, save one sharded checkpoint together, and exit with
`EXIT_PREEMPTED`; rank 0 writes `PREEMPTED` in the run directory. Then the
task of node 0 requeues the job (`scontrol requeue`), which starts again after
Slurm's requeue hold and resumes from that checkpoint (`checkpoint.resume:
auto`). `slurm.max_requeues` bounds the number of requeues (Slurm counts them in
`SLURM_RESTART_COUNT`).

Why not submitit's own checkpoint/requeue. submitit installs a handler for USR2
in every task process that, on global rank 0 only, calls the callable's
`checkpoint()` and requeues AT ONCE — the requeue kills the job while the ranks
(separate processes, started by the launcher) are still writing their shards —
and counts signals that come late in a job as time-outs against
`max_num_timeout`. So `NodeTask` replaces submitit's handlers while it runs:

- the launcher is started in its own session with the preemption signal
  ignored (torchrun, accelerate and deepspeed have no handler for USR2, so its
  default action would kill the launcher and orphan the ranks); the ranks
  install their own handler, which overrides the inherited "ignore";
- on the signal, the task forwards it to every descendant that catches it (the
  ranks), again every 2 s to ranks that installed their handler later, so a
  rank still importing torch when the signal came is not missed; a rank that
  also got it from Slurm sees one flag either way. The ranks stop on USR2 (and
  TERM): a `slurm.signal` of USR1 or INT reaches them ignored (inherited from
  the launcher) and is passed on as USR2;
- when the launcher has exited, shardctl's one classifier
  (`shardctl.orchestrator.outcome`) judges the attempt from the launcher's code,
  the markers and the signals this task received; node 0 carries it out:
  preempted (the warning came, or the ranks saved on it) → requeue; finished →
  done; anything else → the job fails (a dead node, a crash), and resubmitting
  resumes from the newest complete checkpoint. SIGTERM alone (`scancel`,
  `shardctl cancel`, or a Slurm preemption that requeues by itself), received by
  the task or recorded as the ranks' signal, is a cancel: never requeued. A
  script's exit 78 (it said do not retry) fails the job, and so does a retry after
  3 attempts in a row without a new complete checkpoint: node 0 records every
  attempt it judged in the run dir's `attempts.jsonl`, which `status` reads for
  the reason a FAILED job stopped.

Restarts inside the allocation. A crash (FAILED) or a hang (HUNG) with restarts left
(`restart.max_in_allocation`, counted per allocation) is not requeued: node 0 judges
the round, claims a new attempt token (`slurm-<job>-<requeue>-r<round>`), writes its
decision to the run dir's `RESTART`, and runs its launcher again; every other node
whose launcher ended waits for that decision and runs its launcher again too, so the
nodes rendezvous anew (same job id, same nodes). Past the bound the classifier's
decision applies as below (a hang requeues, a crash fails the job); three rounds or
attempts without a new complete checkpoint stop the job (a crash loop).

Hangs. `launch.sh` runs the launcher under the node watchdog
(`shardctl.train.watchdog`). When no rank of a node advanced for the hang timeout,
that watchdog writes `HUNG` in the run directory, dumps every rank's stack to
`logs/hang-attempt<A>-node<N>.txt`, kills the ranks and exits `EXIT_HUNG` (124);
the other nodes' ranks lose their peers and their watchdogs exit 124 as well. A
hang is treated as a fault a retry may clear: a launch script that exits 124, or
any failure with a `HUNG` written during this attempt, restarts in place while
restarts are left, then makes node 0 requeue the job exactly as after a
preemption, counted against `slurm.max_requeues` (the other nodes return "hung").
Nothing was saved: the next attempt resumes from the newest complete checkpoint. A
SIGTERM the task received is a cancel, never a hang. `status` names the step the
last attempt hung at, and says when a job that FAILED (out of requeues) hung.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...durable import write_text_atomic
from ...errors import ClusterError, MissingDependencyError, UsageError
from ...fence import claim_attempt, new_token
from ...launch import PYTHON_VAR, EnvLine, export, export_from
from ...launcher_output import LauncherReport, readable
from ...outcome import (
    MAX_ATTEMPTS_WITHOUT_PROGRESS,
    Decision,
    Evidence,
    Kind,
    Outcome,
    Verdict,
    attempt_progress,
    from_marker,
    judge,
    last_attempt,
    record_attempt,
    rule_for,
)
from ...proctree import descendants, forward_to_catchers, signal_all
from ...proctree import proc as process_of
from ...rundir import (
    ENV_ATTEMPT,
    ENV_ATTEMPT_TOKEN,
    ENV_NODE_SUPERVISOR,
    ENV_RESTART,
    EXIT_HUNG,
    FAILED_FILE,
    HUNG_FILE,
    KILLED_FILE,
    PREEMPTED_FILE,
    RESTART_FILE,
    RunDir,
)
from ...spec import JobSpec, parse_spec
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
    run_resources,
)
from ..writer import LEDGER, write_rendered
from .bad_nodes import leave_behind, left_behind_detail, pinned_node
from .killed_ranks import own_log, record_killed
from .queries import (
    PLAIN_JOB_ID,
    SACCT_FIELDS,
    accounting_lines,
    controller_jobs,
    scontrol_fields,
)
from .rank_nodes import RankRecorder, node_of_rank
from .refusals import refused, run_quietly
from .sbatch import MASTER_ADDR_VAR, SBATCH_FILE, STANDALONE_FILE, slurm_artifacts, submission
from .section import SlurmSection

if TYPE_CHECKING:
    from ...doctor import Preflight

log = logging.getLogger(__name__)

# How long a node whose launcher failed waits for rank 0's PREEMPTED marker.
MARKER_WAIT_S = 10.0
# How long node 0 waits for a HUNG that names the rank that stopped first, after one
# that names none (another node's watchdog declares a poll later, up to
# watchdog.MAX_POLL_S, and writes HUNG before it collects the stacks).
CULPRIT_WAIT_S = 15.0
# How long node 0, out of restarts, waits for the KILLED of a rank killed on another
# node after its own ranks lost their peer (that node's task writes it within a poll
# of its launcher's exit): it decides between failing and leaving the node behind.
KILLED_WAIT_S = 5.0

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
        return [
            export_from("SHARDCTL_NNODES", "SLURM_JOB_NUM_NODES", where),
            export_from(
                "SHARDCTL_NODE_RANK", "SLURM_NODEID", where, "this node's index, set by Slurm"
            ),
            export("SHARDCTL_NPROC_PER_NODE", str(spec.resources.procs_per_node)),
            *master,
            export("MASTER_PORT", str(spec.slurm.master_port)),
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
        # submitit makes its script from the request, and it must be the one shown:
        # refused before anything is written or queued; then exactly `shown` is sent.
        executor = _executor(request, shown)
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
                "nodes": spec.resources.nodes,
            },
        )

    def status(self, ref: JobRef) -> JobStatus:
        _require_slurm()
        info = _scontrol_job(ref.job_id)
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
    hung = _hang_of(ref, state, lambda marker: marker.get("attempt") == last)
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
    hung = _hang_of(ref, state, lambda marker: _written_since(marker, began))
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
    return f"last attempt hung at step {_or_q(hung.step)}{see}"


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


def _written_since(marker: dict[str, Any], began: float | None) -> bool:
    written = marker.get("time")
    return began is not None and isinstance(written, int | float) and written >= began - 1.0


def _log_folder(ref: JobRef) -> Path:
    """submitit's folder of the job, which holds `<id>_<node>_log.out|err`."""
    return Path(ref.extra.get("folder") or Path(ref.run_dir) / "submitit" / ref.job_id)


# ------------------------------------------------------------- submit-side helpers


def _absolute_run_dir(spec: JobSpec) -> JobSpec:
    """The spec as the nodes read it: run and checkpoint directories absolute."""
    run_dir, ckpt = os.path.abspath(spec.run_dir), os.path.abspath(spec.checkpoint_dir)
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


def _executor(request: dict[str, Any], shown: str) -> Any:
    """submitit's `SlurmExecutor` for the dry run's `request`, which submits `shown`.

    submitit makes the sbatch script from the parameters (`_make_submission_file_text`,
    what its `submit` writes and hands to sbatch); made here first, it must equal
    `shown`, the script the dry run printed and rendered (`sbatch.sbatch_text`, its
    mirror), or nothing is queued. At submission the same check runs again and the
    shown bytes are what sbatch receives.
    """
    try:
        import submitit
    except ImportError:
        raise MissingDependencyError("submitit", "slurm", "submitting to Slurm") from None

    class ShownScript(submitit.SlurmExecutor):
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            _same_script(shown, super()._make_submission_file_text(command, uid))
            return shown

    ex = request["executor"]
    executor = ShownScript(
        folder=ex["folder"], max_num_timeout=ex["max_num_timeout"], python=ex["python"]
    )
    executor.update_parameters(**request["parameters"])
    executor._make_submission_file_text(executor._submitit_command_str, "check")
    return executor


def _same_script(shown: str, made: str) -> None:
    """Raise, saying what differs, when submitit's script is not the dry run's."""
    if made == shown:
        return
    import difflib

    from submitit import __version__ as submitit_version

    diff = list(
        difflib.unified_diff(
            shown.splitlines(),
            made.splitlines(),
            f"{SBATCH_FILE} (the dry run)",
            f"{SBATCH_FILE} (submitit {submitit_version})",
            lineterm="",
        )
    )
    shown_diff = "\n".join(diff[:40] + (["..."] if len(diff) > 40 else []))
    raise ClusterError(
        "the sbatch script submitit would submit differs from the one the dry run showed; "
        "nothing was queued and no file was written.\n"
        f"{shown_diff}\n"
        "shardctl lays this script out itself (render and --dry-run do not import "
        f"submitit): this submitit ({submitit_version}) writes it otherwise than the one "
        "shardctl mirrors, or the dry run was changed after it was made; report the "
        "difference as a shardctl bug"
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
            )
        )
    except (FailedJobError, subprocess.CalledProcessError) as exc:
        raise ClusterError(f"sbatch refused the job: {_slurm_message(str(exc))}") from None


def _scontrol_job(job_id: str) -> dict[str, str] | None:
    try:
        proc = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"status of job {job_id}: {exc}") from None
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return scontrol_fields(proc.stdout)


# ------------------------------------------------------------ the task on each node


@dataclass(frozen=True)
class NodeTask:
    """What the submitit task on every node runs (pickled by reference).

    Runs the node's launch script and turns its end into the job's next state:
    returns when the node finished, requeues the job (node 0) after a
    preemption save or a hang, raises when the node failed. See the module docstring.
    """

    command: list[str]
    run_dir: str
    signal_name: str = "USR2"
    max_requeues: int = 10
    checkpoint_dir: str | None = None  # None: the run dir's checkpoints/
    max_stalled: int = MAX_ATTEMPTS_WITHOUT_PROGRESS
    # `restart.max_in_allocation`: rounds of every node's launcher after a crash or a
    # hang inside this allocation (0: none; the job fails or requeues at once).
    max_restarts: int = 0

    def __call__(self) -> str:
        env = os.environ
        node = int(env.get("SLURM_NODEID", "0"))
        job_id = env.get("SLURM_JOB_ID", "?")
        restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
        preempt_sig = signal.Signals[f"SIG{self.signal_name}"]
        started = time.time()
        received: list[int] = []
        forwarded: set[tuple[int, int]] = set()

        def on_signal(signum: int, frame: Any) -> None:
            received.append(signum)
            _say(f"node {node}: got {signal.Signals(signum).name}; passing it to the ranks")

        # Replaces submitit's handlers (immediate requeue on rank 0) for this task.
        signal.signal(preempt_sig, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        child_env = dict(env)
        # The launchers of the environment that runs this task (torchrun, accelerate,
        # deepspeed live beside its python), whatever PATH the job inherited.
        child_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        child_env.setdefault(PYTHON_VAR, sys.executable)  # the node watchdog's interpreter
        # submitit's own variables would make a rank's submitit think it is a task.
        for key in ("SUBMITIT_FOLDER", "SUBMITIT_EXECUTOR"):
            child_env.pop(key, None)
        # This task judges every attempt from the markers: the node watchdog need not
        # wait for another node's HUNG to turn a lost peer into its own 124.
        child_env[ENV_NODE_SUPERVISOR] = "slurm"
        # Which ranks this node runs (`logs --rank`): the rendezvous numbers by arrival.
        per_node = run_resources(self.run_dir).get("procs_per_node")
        # Rounds inside this allocation: a crash or a hang with restarts left starts
        # every node's launcher again here (no requeue); node 0 decides each round.
        round_ = 0
        while True:
            # Every node derives this round's token; node 0 makes it the run's current
            # attempt before its ranks start (rank 0, the publisher, runs there): a rank
            # of an earlier start, round or job of this run can no longer publish.
            # (A later round's token is claimed before node 0 tells the others to go.)
            token = _token(job_id, restarts, round_)
            if node == 0 and round_ == 0:
                self._claim(job_id, restarts, round_)
            child_env[ENV_ATTEMPT_TOKEN] = token
            child_env[ENV_RESTART] = str(round_)
            again = f", restart {round_} in this allocation" if round_ else ""
            _say(
                f"node {node} of job {job_id} (requeue {restarts}{again}): running "
                f"{shlex.join(self.command)}"
            )
            log = own_log()  # the launcher reports a killed rank here
            # A node other than 0 whose launcher is still in this round (its ranks
            # waiting in a collective or a rendezvous) once node 0 has decided the
            # round's end stops it: it would hold up the next round until a timeout.
            follows = node != 0 and self.max_restarts > 0
            decided = partial(_round_decision, self.run_dir, job_id, restarts, round_, 0.0)
            ranks = RankRecorder(self.run_dir, job_id, restarts, round_, node, per_node)
            rc, superseded = self._launch(
                child_env, preempt_sig, received, forwarded, decided if follows else None, ranks
            )
            if follows:  # this node's launcher of the round is gone: node 0 may go on
                _ack_round(self.run_dir, job_id, restarts, round_, node)
            if superseded == Decision.RESTART.value:
                _say(f"node {node}: node 0 restarts every node in place; this node's "
                     f"launcher of round {round_} was stopped")  # fmt: skip
                round_ += 1
                started = time.time()
                continue
            if rc not in (0, EXIT_HUNG) and not received and superseded is None:
                self._pin_killed(node, job_id, restarts, round_, log, started)
            result = self._after(node, job_id, restarts, rc, received, preempt_sig, started, round_)
            if result != RESTARTED:
                signal.signal(preempt_sig, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                return result
            round_ += 1
            started = time.time()

    def _claim(self, job_id: str, restarts: int, round_: int) -> None:
        """Make this round's token the run's current attempt (node 0)."""
        claim_attempt(
            self.run_dir, _token(job_id, restarts, round_), cluster="slurm", job_id=job_id,
            attempt=restarts, restart=round_,
        )  # fmt: skip

    def _pin_killed(
        self, node: int, job_id: str, restarts: int, round_: int,
        log: tuple[str, int] | None, started: float,
    ) -> None:  # fmt: skip
        """Record a rank of this node killed by a node's signal (KILLED), unless node 0
        already judged this round without it (a late marker would be read as the next
        round's)."""
        if node != 0 and _round_decision(self.run_dir, job_id, restarts, round_, 0.0):
            return
        said = record_killed(
            self.run_dir, node, log, started, token=_token(job_id, restarts, round_)
        )
        if said:
            _say(f"node {node}: {said}")

    def _launch(
        self,
        child_env: dict[str, str],
        preempt_sig: signal.Signals,
        received: list[int],
        forwarded: set[tuple[int, int]],
        decided: Callable[[], str | None] | None = None,
        ranks: RankRecorder | None = None,
    ) -> tuple[int, str | None]:
        """Run the node's launcher to its end, passing signals on to the ranks; the
        launcher's code. With `decided`: once it returns node 0's decision on this
        round, the launcher and everything below it are killed (the round is over
        for every node), and the decision is returned beside the code. `ranks`
        records the global ranks found below the launcher (`rank_nodes.py`)."""
        child = subprocess.Popen(
            self.command,
            env=child_env,
            start_new_session=True,
            # The launcher must survive the preemption signal; ranks catch it themselves.
            preexec_fn=lambda: signal.signal(preempt_sig, signal.SIG_IGN),
        )
        while True:
            try:
                return child.wait(timeout=2.0), None
            except subprocess.TimeoutExpired:
                pass
            if ranks is not None:
                ranks.poll(child.pid)
            decision = decided() if decided is not None and not received else None
            if decision is not None:
                # KILL, not TERM: the ranks would take TERM for a stop and save.
                tree = [process_of(child.pid), *descendants(child.pid)]
                signal_all(tree, signal.SIGKILL)
                return child.wait(), decision
            for signum in set(received):
                # The ranks stop on USR2 or TERM; whatever `slurm.signal` Slurm sent
                # (USR1, INT), they are told with USR2.
                to_ranks = signal.SIGTERM if signum == signal.SIGTERM else signal.SIGUSR2
                forwarded |= forward_to_catchers(child.pid, to_ranks, forwarded)

    def _after(
        self,
        node: int,
        job_id: str,
        restarts: int,
        rc: int,
        received: list[int],
        preempt_sig: signal.Signals,
        started: float,
        round_: int = 0,
    ) -> str:
        """The one classifier (`shardctl.orchestrator.outcome`) judges this node's end
        from the launcher's code, this attempt's markers and the signals this task
        received; node 0 carries out a restart inside the allocation (within
        `max_restarts`, telling the other nodes through the run dir's RESTART) or a
        retry (requeue) within `max_requeues`. `RESTARTED`: run the launcher again."""
        evidence = Evidence.gather(
            self.run_dir, started, rc,
            # This round's markers: those its ranks and nodes wrote, by token.
            token=_token(job_id, restarts, round_),
            signals=[signal.Signals(s).name for s in received],
            warning=preempt_sig.name,
            # Global rank 0 (which writes the markers) may run on another node, and this
            # node's ranks may have exited a moment before it wrote one.
            wait_s=MARKER_WAIT_S,
            # Node 0 judges for every node: the stopped rank's node names it.
            culprit_wait_s=CULPRIT_WAIT_S if node == 0 and _job_node_count() > 1 else 0.0,
            # Out of restarts, a crash pinned on another node is left behind there.
            killed_wait_s=KILLED_WAIT_S
            if node == 0 and _job_node_count() > 1 and round_ >= self.max_restarts
            else 0.0,
        )  # fmt: skip
        # Node 0 carries the verdict out, so it alone judges progress and records the
        # attempt (the evidence of "no progress" for the attempts after it).
        progress = None
        if node == 0:
            progress = attempt_progress(self.run_dir, self.checkpoint_dir, started, job_id)
        verdict = judge(
            evidence, retries=restarts, max_retries=self.max_requeues,
            progress=progress, max_stalled=self.max_stalled,
            # Node 0 alone decides a restart; the others follow its RESTART.
            restarts=round_, max_restarts=self.max_restarts if node == 0 else None,
        )  # fmt: skip
        if progress is not None:
            record_attempt(self.run_dir, job_id, verdict, progress, started)
        out = verdict.outcome
        if node == 0 and self.max_restarts:
            if verdict.decision is Decision.RESTART:
                self._claim(job_id, restarts, round_ + 1)
            _tell_round(self.run_dir, job_id, restarts, round_, verdict.decision.value)
        if verdict.decision is Decision.RESTART:
            # This round's; its verdict is recorded.
            for name in (HUNG_FILE, KILLED_FILE, FAILED_FILE):
                (Path(self.run_dir) / name).unlink(missing_ok=True)
            _say(f"node 0: {verdict.summary()}; the other nodes start again too")
            missing = _wait_for_acks(self.run_dir, job_id, restarts, round_, _job_node_count())
            if missing:
                _say(f"node 0: nodes {missing} did not end round {round_} within "
                     f"{ROUND_ACK_WAIT_S:.0f} s; starting the next round anyway")  # fmt: skip
            return RESTARTED
        if node != 0 and self.max_restarts and rule_for(out).restart:
            decided = _round_decision(self.run_dir, job_id, restarts, round_)
            if decided == Decision.RESTART.value:
                _say(f"node {node}: {out.summary()}; node 0 restarts every node in place")
                return RESTARTED
        if verdict.no_progress and node == 0:
            raise RuntimeError(
                f"job {job_id}: {verdict.summary()}; not requeued. Fix the cause, then "
                "resubmit to resume from the newest complete checkpoint."
            )
        if out.kind is Kind.DONE:
            _say(f"node {node}: launcher finished")
            return "finished"
        if out.kind is Kind.CANCELLED:
            by = out.signal or "SIGTERM"
            _say(f"node {node}: stopped by {by} (cancel); launcher exit {rc}")
            return "terminated"
        if out.kind is Kind.PREEMPTED:
            saved = PREEMPTED_FILE in evidence.markers
            what = f"saved step {out.step}" if saved else "no new checkpoint"
            return self._retry(
                node, job_id, restarts, f"preempted ({what})", f"was preempted ({what})",
                result="preempted", resume="", out_of_retries=verdict.out_of_retries,
            )  # fmt: skip
        if out.kind is Kind.HUNG:
            # Nothing was saved: the next attempt resumes from the newest complete checkpoint.
            if HUNG_FILE in evidence.markers:
                what = f"hung at step {_or_q(out.step)} (node {_or_q(out.node)}'s watchdog)"
            else:
                what = f"hung (the launcher exited with {rc}; no HUNG marker)"
            why = f"hung at step {_or_q(out.step)}, rank {out.rank} stopped first"
            return self._retry_leaving_behind(node, job_id, restarts, out, verdict, what, why)
        if out.kind is Kind.PERMANENT:
            raise RuntimeError(f"node {node} of job {job_id}: {out.summary()}; not requeued.")
        if out.pinned and verdict.decision is Decision.RETRY:
            what = out.summary().removeprefix("failed: ")
            return self._retry_leaving_behind(node, job_id, restarts, out, verdict, what, what)
        code = f"; a rank exited with code {out.code}" if out.rank is not None else ""
        raise RuntimeError(
            f"node {node} of job {job_id}: the launcher exited with code {rc}{code}; the "
            "job failed. Resubmitting resumes from the newest complete checkpoint."
        )

    def _retry_leaving_behind(
        self, node: int, job_id: str, restarts: int, out: Outcome, verdict: Verdict,
        what: str, why: str,
    ) -> str:  # fmt: skip
        """A hang or a crash past the restarts in place: node 0 requeues (within
        `max_requeues`) and, when the fault is pinned on one node, leaves that node
        behind (`bad_nodes`); nothing was saved, the requeued job resumes from the
        newest complete checkpoint."""
        pinned = pinned_node(out) if node == 0 and not verdict.out_of_retries else None
        # Read before the requeue, which gives the nodes back.
        job = None
        if pinned is not None:
            with contextlib.suppress(ClusterError):
                job = _scontrol_job(job_id)
        result = self._retry(
            node, job_id, restarts, what, what,
            result=out.kind.value, resume=" from the newest complete checkpoint",
            out_of_retries=verdict.out_of_retries,
        )  # fmt: skip
        if pinned is not None and job is not None and result == "requeued":
            _say("node 0: " + leave_behind(
                job_id=job_id, run_dir=self.run_dir, node=pinned, needed=_job_node_count(),
                why=why, job=job, requeue=restarts,
            ))  # fmt: skip
        return result

    def _retry(
        self, node: int, job_id: str, restarts: int, event: str, job_event: str,
        *, result: str, resume: str, out_of_retries: bool,
    ) -> str:  # fmt: skip
        """After a preemption or a hang (the classifier's RETRY): node 0 requeues the
        job, or fails it when the verdict says the retries are spent (`event`: what
        happened, for the log; `job_event`: the same after "job J"); the other nodes
        return `result` and leave it to node 0."""
        if node != 0:
            _say(f"node {node}: {event}; node 0 requeues the job")
            return result
        if out_of_retries:
            raise RuntimeError(
                f"job {job_id} {job_event} after {restarts} requeue(s), which is "
                f"slurm.max_requeues ({self.max_requeues}); not requeued. Resubmit to "
                f"resume{resume}."
            )
        then = f"; it resumes{resume}" if resume else ""
        _say(f"node 0: {event}; requeueing job {job_id} ({restarts + 1} of at most "
             f"{self.max_requeues}){then}")  # fmt: skip
        return _requeue(job_id, job_event)


# `NodeTask._after`: this node runs its launcher again (a restart inside the allocation).
RESTARTED = "restarted"
# How long a node other than 0 waits for node 0's decision on a round: node 0's ranks
# may take a while to notice a lost peer (a collective's error, or node 0's own
# watchdog on a hang, the start-up allowance of 900 s at most).
ROUND_DECISION_WAIT_S = 1200.0


def _token(job_id: str, requeue: int, round_: int) -> str:
    """A round's attempt token, the same on every node: `slurm-<job>-<requeue>`, then
    `-r<round>` for a restart inside the allocation."""
    token = new_token("slurm", job_id, requeue, unique=False)
    return f"{token}-r{round_}" if round_ else token


# How long node 0 waits, after deciding a restart, for every other node's launcher of
# the round to be gone (`_ack_round`) before it starts the next round's: an old
# round's launcher still hosting or joining a rendezvous makes the new one fail.
ROUND_ACK_WAIT_S = 120.0
ROUNDS_DIR = "rounds"


def _ack_name(job_id: str, requeue: int, round_: int) -> str:
    return f"{job_id}-{requeue}-r{round_}.node"


def _ack_round(run_dir: str, job_id: str, requeue: int, round_: int, node: int) -> None:
    """This node's launcher of the round is gone (a file per node in the run dir)."""
    folder = Path(run_dir) / ROUNDS_DIR
    with contextlib.suppress(OSError):
        folder.mkdir(exist_ok=True)
        (folder / f"{_ack_name(job_id, requeue, round_)}{node}").touch()


def _wait_for_acks(
    run_dir: str, job_id: str, requeue: int, round_: int, nodes: int,
    wait_s: float = ROUND_ACK_WAIT_S,
) -> list[int]:  # fmt: skip
    """Node 0: wait until every other node acknowledged the end of the round; the
    nodes that did not within `wait_s` (their acknowledgements are then removed)."""
    folder = Path(run_dir) / ROUNDS_DIR
    prefix = _ack_name(job_id, requeue, round_)
    deadline = time.monotonic() + wait_s
    while True:
        missing = [n for n in range(1, nodes) if not (folder / f"{prefix}{n}").exists()]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    for n in range(1, nodes):
        with contextlib.suppress(OSError):
            (folder / f"{prefix}{n}").unlink()
    return missing


def _tell_round(run_dir: str, job_id: str, requeue: int, round_: int, decision: str) -> None:
    """Node 0's decision on this round, for the other nodes (the run dir is shared)."""
    entry = {"job": job_id, "requeue": requeue, "restart": round_, "decision": decision}
    write_text_atomic(Path(run_dir) / RESTART_FILE, json.dumps(entry) + "\n", durable=False)


def _round_decision(
    run_dir: str, job_id: str, requeue: int, round_: int, wait_s: float = ROUND_DECISION_WAIT_S
) -> str | None:
    """Node 0's decision on this round of this allocation, once it wrote it (None
    after `wait_s`: node 0 is gone; this node then ends as its own verdict says)."""
    want = {"job": job_id, "requeue": requeue, "restart": round_}
    deadline = time.monotonic() + wait_s
    while True:
        try:
            entry = json.loads((Path(run_dir) / RESTART_FILE).read_text())
        except (OSError, ValueError):
            entry = {}
        if isinstance(entry, dict) and all(entry.get(k) == v for k, v in want.items()):
            return str(entry.get("decision"))
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def _job_node_count() -> int:
    """The nodes of the job this task runs in (Slurm's environment)."""
    try:
        return int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES", "1"))
    except ValueError:
        return 1


def _or_q(value: int | None) -> str:
    return "?" if value is None else str(value)


def _requeue(job_id: str, what: str) -> str:
    """Node 0 puts the whole job back in the queue (`scontrol requeue`)."""
    try:
        proc = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60
        )
    except OSError as exc:
        # A pyxis image without the Slurm client: the job cannot requeue itself.
        # Failing says so in its state; resubmitting resumes from the saved step.
        raise RuntimeError(
            f"job {job_id} {what} but cannot requeue itself: {exc} "
            "(slurm.container: this image has no Slurm client). Resubmit to resume."
        ) from None
    if proc.returncode != 0:
        # E.g. a Slurm preemption already requeues it: say so, do not fail the node.
        _say(f"node 0: scontrol requeue {job_id}: {proc.stderr.strip()}")
    return "requeued"


def _say(message: str) -> None:
    # The task's stdout is the node's log file (submitit's %j_%t_log.out).
    print(f"[shardctl] {message}", flush=True)
