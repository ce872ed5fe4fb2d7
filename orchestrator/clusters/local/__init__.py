"""The embedded default cluster: the rendered launch script, run on this host.

`dryrun` renders the artifacts (`shardctl.orchestrator.render.render_artifacts`) and
the exact command; `schedule` writes them into the run directory and starts the
launch script detached — in its own session, under the node agent
(`python -m shardctl.orchestrator.agent`, `orchestrator/agent/local.py`) that records
the script's exit code — so the job outlives the `shardctl` process. A spec
with `resources.nodes > 1` runs every node here (one launch script per node rank,
meeting at 127.0.0.1): a way to try multi-node layouts such as hybrid_shard.

Files in the run directory (beside `job.yaml`, `checkpoints/`, `logs/`):

    launch.sh, env.sh, ...   the rendered artifacts (what runs)
    local.pid                "<pid> <start-ticks>" of the agent (its process group)
    local.exit               the launch script's exit code, once it ended
    local.outcome            the agent's verdict then (`shardctl.orchestrator.outcome`)
    CANCELLED                written by `cancel`
    logs/launcher.out|.err   everything the launcher and its ranks print
    DONE / PREEMPTED         written by the trainer (see `shardctl.train.loop`)

A crash or a hang restarts every node's launcher in place while
`restart.max_in_allocation` allows (the node agent; each round is a line of
`attempts.jsonl` and gets a new attempt token); the ranks resume from the newest
complete checkpoint.

Status comes from those files: RUNNING while the supervisor lives; then what the one
classifier (`shardctl.orchestrator.outcome`) makes of the exit code and this start's
markers: SUCCEEDED, PREEMPTED (the ranks saved a checkpoint on the cluster's warning;
submit again to resume — torchrun reports that as exit 1, so the marker decides),
HUNG (the node agent ended ranks that stopped advancing; submit again to resume
from the newest complete checkpoint), CANCELLED (`cancel`, or the ranks saved on a
TERM alone), or FAILED. Submitting a spec again resumes from its newest complete
checkpoint, or does nothing when the run is already complete (`DONE`).

`cancel` sends SIGTERM to the supervisor's process group and to every process
descended from it outside that group (torchrun starts ranks in sessions of their own),
once each: ranks take it as a preemption signal and checkpoint; after a grace period
what is left gets SIGKILL.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ...agent.local import EXIT_FILE, OUTCOME_FILE
from ...attempts import newest_step
from ...durable import write_text_atomic
from ...errors import ClusterError, UsageError
from ...fence import claim_attempt, current_attempt, new_token
from ...launch import PYTHON_VAR, EnvLine, export
from ...launcher_output import LauncherReport, readable
from ...outcome import Evidence, Kind, Verdict, cancelled_marker, judge
from ...proctree import Proc, alive, descendants, signal_all, start_ticks
from ...rundir import (
    CANCELLED_FILE,
    DONE_FILE,
    ENV_ATTEMPT,
    ENV_ATTEMPT_TOKEN,
    FAILED_FILE,
    HUNG_FILE,
    LAUNCH_FILE,
    LOGS_DIR,
    MODEL_DIR,
    PREEMPTED_FILE,
    TOKEN_FIELD,
    RunDir,
)
from ...spec import JobSpec
from ..base import (
    Cluster,
    DryRun,
    FileTail,
    FinishedRun,
    JobRef,
    JobState,
    JobStatus,
    finished_in,
    hung_detail,
    require_script,
    run_resources,
)
from ..writer import write_rendered
from .section import LocalSection

if TYPE_CHECKING:
    from ...doctor import Preflight

PID_FILE = "local.pid"
ATTEMPT_FILE = "local.attempt"
LOG_FILES = ("launcher.out", "launcher.err")
# Longer than torchrun's own 30 s between forwarding SIGTERM and killing its ranks.
CANCEL_GRACE_S = 60.0

# The node agent on this machine (`python -m shardctl.orchestrator.agent`, its local
# adapter `agent/local.py`) runs every node of the spec and records the exit code and
# the verdict after every round; a crash or a hang with restarts left
# (`restart.max_in_allocation`) starts every node again under a new attempt token.
AGENT_MODULE = "shardctl.orchestrator.agent"


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _group_of(pid: int) -> int | None:
    """The process group of `pid`; None once it is gone."""
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


class LocalCluster(Cluster):
    name = "local"
    spec_section = LocalSection
    next_step = "start it here: bash {out}/launch.sh"
    can_follow = True
    follow_ticks = True
    poll_s = 0.5
    one_machine = True
    no_preemption_budget = "a local run is stopped by `shardctl cancel`, no deadline"

    def preflight(self, spec: JobSpec) -> Preflight:
        from ...doctor import Preflight
        from .preflight import local_checks

        return Preflight(local_checks(spec))

    def runtime_env(self, spec: JobSpec) -> list[EnvLine]:
        r = spec.resources
        return [
            export("SHARDCTL_NNODES", str(r.nodes), "this host is every node"),
            EnvLine(
                'export SHARDCTL_NODE_RANK="${SHARDCTL_NODE_RANK:-0}"',
                "preset it to start another node of a multi-node spec on this host",
            ),
            export("SHARDCTL_NPROC_PER_NODE", str(r.procs_per_node)),
            export("MASTER_ADDR", "127.0.0.1"),
            export("MASTER_PORT", str(spec.local.master_port)),
            EnvLine(
                f'export {ENV_ATTEMPT}="${{{ENV_ATTEMPT}:-0}}"',
                "starts of this run so far, counted by `shardctl submit`",
            ),
        ]

    # -- dryrun / schedule -----------------------------------------------------------

    def dryrun(self, spec: JobSpec) -> DryRun:
        require_script(spec, "exists here")
        # launch.sh finds job.yaml (and the launcher configs) beside itself.
        artifacts = self.artifacts(spec)
        run_dir = Path(spec.run_dir)
        logs = run_dir / LOGS_DIR
        argv = ["bash", str(run_dir / LAUNCH_FILE)]
        command = (
            f"{shlex.join(argv)} >>{shlex.quote(str(logs / LOG_FILES[0]))} "
            f"2>>{shlex.quote(str(logs / LOG_FILES[1]))}"
        )
        request = {
            "argv": argv,
            "run_dir": str(run_dir),
            "logs": [str(logs / name) for name in LOG_FILES],
        }
        nodes = spec.resources.nodes
        how = (
            f"once per node, with SHARDCTL_NODE_RANK=0..{nodes - 1} in its environment (all "
            "nodes on this host)"
            if nodes > 1
            else "once"
        )
        text = (
            f"# cluster local: write these files into {run_dir}/ and run, detached, from "
            f"the current directory, {how}:\n{command}\n"
            + "".join(
                f"\n# ---- {run_dir / name} ----\n{content}"
                + ("" if content.endswith("\n") else "\n")
                for name, content in sorted(artifacts.items())
            )
        )
        return DryRun(cluster="local", spec=spec, artifacts=artifacts, request=request, text=text)

    def schedule(self, dryrun: DryRun) -> JobRef:
        spec = dryrun.spec
        run_dir = Path(spec.run_dir)
        ref = JobRef(
            cluster="local",
            job_id="",
            name=spec.name,
            # Absolute: `status`/`logs` may run from another directory later.
            run_dir=str(run_dir.resolve()),
            extra={"cwd": os.getcwd()},
        )
        pid_info = self._pid(run_dir)
        if pid_info is not None and alive(*pid_info):
            raise ClusterError(
                f"job {spec.name!r} is already running here (pid {pid_info[0]}, run dir "
                f"{run_dir}); follow it with `shardctl logs {spec.name}` or stop it with "
                f"`shardctl cancel {spec.name}`"
            )
        logs = run_dir / LOGS_DIR
        write_rendered(dryrun.artifacts, run_dir)
        logs.mkdir(parents=True, exist_ok=True)
        offsets = {n: (logs / n).stat().st_size if (logs / n).is_file() else 0 for n in LOG_FILES}
        stale_files = (EXIT_FILE, OUTCOME_FILE, CANCELLED_FILE, PID_FILE, PREEMPTED_FILE)
        for stale in (*stale_files, FAILED_FILE, HUNG_FILE):
            (run_dir / stale).unlink(missing_ok=True)
        attempt = self._next_attempt(run_dir)
        env = dict(os.environ)
        env[ENV_ATTEMPT] = str(attempt)
        # This start is the run's current attempt: a rank of an earlier one that is
        # still alive can no longer publish a checkpoint (`orchestrator/fence.py`).
        token = new_token("local", spec.name, attempt)
        # `job`: the start's id in attempts.jsonl (goodput reads whose claim this is).
        claim_attempt(run_dir, token, cluster="local", attempt=attempt, job=f"local-{attempt}")
        env[ENV_ATTEMPT_TOKEN] = token
        # The newest checkpoint this start resumes from, read once its token is claimed:
        # the supervisor judges progress by step, never by a file time.
        start_step = newest_step(run_dir, spec.checkpoint_dir)
        # The launchers (torchrun, accelerate, deepspeed) of this interpreter come first.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env[PYTHON_VAR] = sys.executable  # the node watchdog's interpreter
        argv = [
            sys.executable, "-m", AGENT_MODULE,
            "--run-dir", str(run_dir), "--launch", str(run_dir / LAUNCH_FILE),
            "--out", str(logs / LOG_FILES[0]), "--err", str(logs / LOG_FILES[1]),
            "--nodes", str(spec.resources.nodes),
            # Judged per submit: its restarts' progress, in attempts.jsonl.
            "--job", f"local-{attempt}",
            "--checkpoint-dir", spec.checkpoint_dir,
            "--start-step", "" if start_step is None else str(start_step),
            "--max-restarts", str(spec.restart.max_in_allocation),
        ]  # fmt: skip
        # The agent's own words go nowhere (as a launcher's would to a terminal); what
        # it cannot do (a traceback) lands in the launcher's error log.
        with (logs / LOG_FILES[1]).open("ab") as err:
            proc = subprocess.Popen(
                argv, cwd=os.getcwd(), env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
            )  # fmt: skip
        ticks = start_ticks(proc.pid)
        write_text_atomic(run_dir / PID_FILE, f"{proc.pid} {ticks or ''}\n", durable=False)
        extra = {**ref.extra, "log_offsets": offsets, "attempt": attempt}
        return JobRef(**{**ref.to_json(), "job_id": str(proc.pid), "extra": extra})

    def finished_run(self, dryrun: DryRun) -> FinishedRun | None:
        # The supervisor's exit code is evidence too, of the run's current attempt only:
        # a DONE an earlier start left is judged by its own markers.
        run_dir = Path(dryrun.spec.run_dir)
        done = RunDir(run_dir).read_marker(DONE_FILE) or {}
        current = (current_attempt(run_dir) or {}).get("token")
        same = current is not None and done.get(TOKEN_FIELD) == current
        return finished_in(run_dir, self._exit_code(run_dir) if same else None)

    # -- status / logs / cancel ----------------------------------------------------------

    @staticmethod
    def _pid(run_dir: Path) -> tuple[int, str | None] | None:
        text = _read(run_dir / PID_FILE)
        if not text or not text.split():
            return None
        words = text.split()
        try:
            return int(words[0]), (words[1] if len(words) > 1 else None)
        except ValueError:
            return None

    @staticmethod
    def _next_attempt(run_dir: Path) -> int:
        """0 for a run's first start here, then +1 per start (the run contract's
        SHARDCTL_ATTEMPT); counted in the run dir, so it survives shardctl."""
        path = run_dir / ATTEMPT_FILE
        try:
            attempt = int(path.read_text().split()[0]) + 1
        except (OSError, ValueError, IndexError):
            attempt = 0
        write_text_atomic(path, f"{attempt}\n", durable=False)
        return attempt

    @staticmethod
    def _exit_code(run_dir: Path) -> int | None:
        text = _read(run_dir / EXIT_FILE)
        try:
            return int(text.strip()) if text else None
        except ValueError:
            return None

    def verdict(self, ref: JobRef) -> Verdict | None:
        """How the last start here ended (`shardctl.orchestrator.outcome`), from the exit
        code the supervisor recorded and the markers of this start; None while it runs."""
        run_dir = Path(ref.run_dir)
        pid_info = self._pid(run_dir)
        if pid_info is not None and alive(*pid_info):
            return None
        # Markers older than this start are an earlier start's (schedule removes all
        # but DONE, which a longer run of the same spec leaves behind).
        started = _mtime(run_dir / PID_FILE)
        # The last round's markers are those of the run's current token (fence.py).
        current = current_attempt(run_dir) or {}
        token = current.get("token") if isinstance(current.get("token"), str) else None
        return judge(Evidence.gather(run_dir, started, self._exit_code(run_dir), token=token))

    def attempts_job(self, ref: JobRef) -> str:
        # The supervisor judges each submit's restarts as `local-<attempt>` (schedule).
        attempt = ref.extra.get("attempt")
        return "" if attempt is None else f"local-{attempt}"

    def status(self, ref: JobRef) -> JobStatus:
        run_dir = Path(ref.run_dir)
        pid_info = self._pid(run_dir)
        verdict = self.verdict(ref)
        if verdict is None:
            return JobStatus(JobState.RUNNING, "running", f"pid {pid_info[0] if pid_info else '?'}")
        rc = self._exit_code(run_dir)
        out = verdict.outcome
        native = f"exit {rc}" if rc is not None else out.kind.value
        if out.kind is Kind.CANCELLED:
            step = f"; checkpoint at step {out.step}" if out.step is not None else ""
            by = out.reason or (f"stopped by {out.signal}" if out.signal else "cancelled")
            return JobStatus(JobState.CANCELLED, "cancelled", f"{by}{step}")
        if out.kind is Kind.HUNG:
            return JobStatus(JobState.HUNG, native, hung_detail(dict(out.marker), ref.name))
        if out.kind is Kind.PREEMPTED:
            at = f" at step {out.step}" if out.step is not None else ""
            why = f"signal {out.signal}" if out.signal else (out.reason or "no signal")
            if not out.saved:  # a rank without a handler: nothing saved, said plainly
                return JobStatus(
                    JobState.PREEMPTED, native, f"preempted ({why}), nothing saved: "
                    f"{out.unsaved_why()}; submit the spec again to resume"
                )  # fmt: skip
            return JobStatus(
                JobState.PREEMPTED,
                native if rc is not None else "preempted",
                f"preempted{at} ({why}), checkpoint saved; submit the spec again to resume",
            )
        if out.kind is Kind.DONE:
            detail = "exit 0" if out.step is None else f"finished step {out.step}"
            if (run_dir / MODEL_DIR).is_dir():
                detail += f"; consolidated model in {run_dir / MODEL_DIR}"
            return JobStatus(JobState.SUCCEEDED, "exit 0" if rc == 0 else "done", detail)
        if out.kind is Kind.PERMANENT:
            # The script said do not retry (exit 78): say why, and that a retry is futile.
            return JobStatus(
                JobState.FAILED, f"exit {out.code}", f"stopped: {out.summary()}; fix the "
                f"cause before submitting again (see `shardctl logs {ref.name}`)"
            )  # fmt: skip
        if out.kind is Kind.FAILED:
            if out.rank is not None:  # the script's own code, not the launcher's 1
                why = f": {out.reason}" if out.reason else ""  # e.g. a full disk, named
                return JobStatus(
                    JobState.FAILED, f"exit {out.code}", f"a rank exited with code {out.code}"
                    f"{why}; see `shardctl logs {ref.name}`"
                )  # fmt: skip
            return JobStatus(JobState.FAILED, native, f"see `shardctl logs {ref.name}`")
        if pid_info is not None:
            return JobStatus(
                JobState.FAILED,
                "vanished",
                "the launcher ended without recording an exit code (killed?)",
            )
        return JobStatus(JobState.UNKNOWN, "no record", f"nothing started in {run_dir}")

    def exit_code(self, ref: JobRef) -> int:
        """The job's exit code for `submit --wait`: the verdict's (`outcome.POLICY`): 0
        finished, 42 preempted and saved (torchrun turns every rank's 42 into 1), 143
        cancelled, 124 hung, a failed rank's own code, else the launch script's."""
        verdict = self.verdict(ref)
        return verdict.exit_code if verdict is not None else 1

    def logs(self, ref: JobRef, tail: int | None = None) -> str:
        logs = Path(ref.run_dir) / LOGS_DIR
        parts: list[str] = []
        for name in LOG_FILES:
            text = _read(logs / name)
            if text is None:
                continue
            lines = readable(text, where=str(logs / name)).splitlines(keepends=True)
            if tail is not None:
                lines = lines[-tail:]
            parts.append(f"==> {logs / name} <==\n" + "".join(lines))
            if parts[-1] and not parts[-1].endswith("\n"):
                parts[-1] += "\n"
        if not parts:
            return f"no logs yet in {logs}\n"
        return "\n".join(parts)

    def cancel(self, ref: JobRef, grace_s: float | None = None) -> None:
        run_dir = Path(ref.run_dir)
        pid_info = self._pid(run_dir)
        if pid_info is None or not alive(*pid_info):
            st = self.status(ref)
            raise ClusterError(
                f"job {ref.name!r} is not running (state {st.state.value}); nothing to cancel"
            )
        grace = CANCEL_GRACE_S if grace_s is None else grace_s
        pid, ticks = pid_info
        # The cancel is evidence of the run's current attempt (its token), not a time.
        token = (current_attempt(run_dir) or {}).get("token")
        marker = cancelled_marker()
        RunDir(run_dir).write_marker(
            CANCELLED_FILE, {**marker, "token": token} if isinstance(token, str) else marker
        )
        # Collected before signalling: once a parent exits, its children are re-parented
        # and no longer look like ours.
        procs = [Proc(pid, ticks), *descendants(pid)]
        # Each process gets one TERM: the group's members from the group's signal, the
        # rest directly. A second one would land inside torchrun's handling of the
        # first and cut its orderly stop of the ranks short.
        outside = [p for p in procs if _group_of(p.pid) != pid]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        signal_all(outside, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            procs = [p for p in procs if alive(*p)]
            if not procs:
                return
            time.sleep(0.2)
        signal_all(procs, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    # -- foreground ------------------------------------------------------------------------

    def has_ended(self, ref: JobRef, st: JobStatus) -> bool:
        # Restarts in place happen under the supervisor: once it is gone, the run ended.
        return st.state is not JobState.RUNNING

    def exit_code_of(self, ref: JobRef, st: JobStatus) -> int:
        return self.exit_code(ref)

    def follow_logs(
        self,
        ref: JobRef,
        write: Callable[[str], None],
        *,
        node: int | None = None,
        tail: int | None = None,
        poll_s: float | None = None,
    ) -> None:
        """`logs -f`: launcher.out and .err of this attempt as they grow, until the run
        ends. Every node of a local run writes to the same two files (the launchers do
        not tell ranks apart), so `node` must be 0 of a one-node run."""
        nodes = run_resources(ref.run_dir).get("nodes")
        if node is not None and (nodes != 1 or node != 0):
            raise UsageError(
                f"--node {node}: a local run writes every node and rank to the same "
                f"logs/launcher.out and .err (this one has {nodes or 'an unknown number of'} "
                "node(s)); accepted: --node 0 for a one-node run, or no --node"
            )
        logs = Path(ref.run_dir) / LOGS_DIR
        offsets = ref.extra.get("log_offsets", {})
        tails = {
            name: FileTail(logs / name, offset=int(offsets.get(name, 0)), tail=tail)
            for name in LOG_FILES
        }
        reports = {name: LauncherReport(str(logs / name)) for name in LOG_FILES}
        wait = self.poll_s if poll_s is None else poll_s

        def pump(final: bool = False) -> None:
            for name in LOG_FILES:
                text = reports[name].feed(tails[name].poll(final=final))
                if final:
                    text += reports[name].close()
                if text:
                    write(text)

        while not self.has_ended(ref, self.status(ref)):
            pump()
            time.sleep(wait)
        pump(final=True)

    def follow(
        self,
        ref: JobRef,
        write: Callable[[str], None] | None = None,
        poll_s: float = 0.5,
        tick: Callable[[], None] | None = None,
    ) -> int:
        """Stream the job's logs until it ends; return its exit code (see `exit_code`).

        Ctrl-C cancels the run gracefully (the ranks checkpoint) and keeps following
        until it has stopped; submitting the spec again resumes it. `tick` is called
        after each read (the progress bar reads metrics.jsonl then).
        """
        out = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        logs = Path(ref.run_dir) / LOGS_DIR
        # Only this attempt's output: earlier attempts appended to the same files.
        offsets = {name: int(ref.extra.get("log_offsets", {}).get(name, 0)) for name in LOG_FILES}
        decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in LOG_FILES}
        # The launcher's report of its own stop becomes one line (orchestrator/launcher_output.py).
        reports = {name: LauncherReport(str(logs / name)) for name in LOG_FILES}

        def pump(final: bool = False) -> None:
            for name in LOG_FILES:
                path = logs / name
                try:
                    with path.open("rb") as f:
                        f.seek(offsets[name])
                        chunk = f.read()
                except OSError:
                    chunk = b""
                offsets[name] += len(chunk)
                text = reports[name].feed(decoders[name].decode(chunk, final=final))
                if final:
                    text += reports[name].close()
                if text:
                    out(text)

        pid_info = self._pid(Path(ref.run_dir))
        while pid_info is not None and alive(*pid_info):
            try:
                pump()
                if tick is not None:
                    tick()
                time.sleep(poll_s)
            except KeyboardInterrupt:
                out("\nshardctl: stopping the run (ranks checkpoint first) ...\n")
                with contextlib.suppress(ClusterError):  # it may have ended meanwhile
                    self.cancel(ref)
        pump(final=True)
        if tick is not None:
            tick()
        return self.exit_code(ref)
