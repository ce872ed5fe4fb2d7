"""What every cluster backend is: `submit = schedule ∘ dryrun`.

A cluster class declares, in one place, everything that differs between
clusters:

- `runtime_env(spec)`: how a node learns its rank, the node count, the master
  address and port on that cluster (env lines of the launch script);
- `node_view(spec)`: the spec as its nodes read it and the path they read it
  from (Slurm makes the run dir absolute, Kubernetes moves it onto the volume);
- `own_artifacts(...)`: the files only that cluster needs (the Slurm
  submission, the PyTorchJob and Helm values);
- `dryrun(spec)`: pure; renders exactly what will be sent and talks to no
  cluster. `shardctl render` writes the dry run's artifacts.
- `schedule(dryrun)`: sends that and nothing else; `status`, `logs`, `cancel`;
  `follow_logs` (`logs -f`), `has_ended` and `exit_code_of` (`status --watch`);
  `status_many` with `batch_status` (`ls`: many jobs' states in one query);
- `spec_section`: its section of the job spec (a `ClusterSection` under the
  cluster's name), whose `run_problems` `check(spec)` raises before any render;
- `preflight(spec)`, `preemption_budget(spec)`, `network_check(spec, var)`,
  `one_machine`: what `shardctl doctor` asks of it.

Backend states map to `JobState` through one explicit table per backend, with
UNKNOWN as the default. This module imports no cluster module.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import RenderError, ShardctlError, SpecError, UsageError
from ..launch import TRAIN_MODULE, EnvLine, entry_words, env_file, launch_script
from ..render import common_artifacts
from ..rundir import DONE_FILE, EXIT_HUNG, EXIT_PREEMPTED, SPEC_FILE, TOKEN_FIELD, RunDir
from ..spec import JobSpec

if TYPE_CHECKING:
    from ..doctor import Check, Preflight
    from ..outcome import Evidence
    from ..spec.common import ClusterSection


class JobState(enum.StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"  # stopped by the cluster; will resume (requeue/restart)
    HUNG = "HUNG"  # ended by its watchdog (no rank advanced); resumes like PREEMPTED
    UNKNOWN = "UNKNOWN"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


def hung_detail(hung: dict[str, Any] | None, name: str) -> str:
    """What `status` says of a run its watchdog declared hung (the HUNG marker)."""
    if not hung:
        return (
            f"hung: ended by its watchdog (exit 124); see `shardctl logs {name}`; submit the "
            "spec again to resume from the newest complete checkpoint"
        )
    # Read defensively: a marker edited or cut short by hand must not break `status`.
    raw_first, raw_ranks = hung.get("first"), hung.get("ranks")
    first = [r for r in raw_first if isinstance(r, int)] if isinstance(raw_first, list) else []
    rows = raw_ranks if isinstance(raw_ranks, list) else []
    ranks = {r.get("rank"): r for r in rows if isinstance(r, dict)}
    who = (
        ", ".join(f"rank {r} at step {ranks.get(r, {}).get('step', '?')}" for r in first)
        or f"every rank of node {hung.get('node', '?')} waiting at step {hung.get('step', '?')}"
    )
    report = f"; stacks in {hung['report']}" if isinstance(hung.get("report"), str) else ""
    return (
        f"hung: no rank advanced for {hung.get('idle_s', '?')} s (timeout "
        f"{hung.get('timeout_s', '?')} s); stopped first: {who}{report}; submit the spec "
        "again to resume from the newest complete checkpoint"
    )


@dataclass(frozen=True)
class NodeView:
    """The spec as a cluster's nodes read it, and the path of their job.yaml."""

    spec: JobSpec
    spec_path: str = SPEC_FILE
    # The spec as the user gave it, where the node view changed paths (k8s: the
    # entrypoint's script is read here and travels to the pods).
    origin: JobSpec | None = None


@dataclass(frozen=True)
class DryRun:
    """Exactly what `schedule` will send. Never changed after it is made."""

    cluster: str
    spec: JobSpec
    # Rendered files (relative path → text) that `schedule` writes or sends.
    artifacts: dict[str, str]
    # The backend's request (submitit parameters, the PyTorchJob object, argv ...).
    request: Any
    # What `--dry-run` prints: the request in the form the cluster receives it.
    text: str


@dataclass(frozen=True)
class JobRef:
    """A submitted job: enough to find it again."""

    cluster: str
    job_id: str
    name: str
    run_dir: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class JobStatus:
    state: JobState
    native_state: str  # the backend's own word, for humans
    detail: str = ""


@dataclass(frozen=True)
class FinishedRun:
    """What the last run of a run dir finished, as its cluster records it: the built-in
    loop's last step and a script's command (DONE's `step` and `command`)."""

    where: str  # where that is recorded, for the user ("DONE in /path/to/run")
    step: int | None = None
    command: list[str] | None = None

    def completes(self, spec: JobSpec) -> bool:
        """The one rule of "run complete", on every cluster: the built-in loop reached
        `train.steps`; a script ran the same command (its words as the ranks got them,
        `launch.entry_words`), whatever its steps."""
        command = entry_words(spec)
        if command is None:
            steps = spec.train.steps if spec.train is not None else 0
            return self.step is not None and self.step >= steps
        return self.command == command


def finished_in(run_dir: Path, exit_code: int | None = None) -> FinishedRun | None:
    """The run dir's DONE as a `FinishedRun`; None without one. A script's DONE (rank 0's,
    with the command) counts only when the classifier judges its attempt done: no rank
    of that attempt (DONE's token) left FAILED, HUNG or KILLED (`exit_code`: the
    supervisor's, where this machine recorded one)."""
    from ..outcome import Kind, classify

    folder = RunDir(run_dir)
    done = folder.read_marker(DONE_FILE)
    if done is None:
        return None
    command = folder.done_command()
    if command is not None:
        evidence = _evidence_of_done(folder, done, exit_code)
        if evidence is None or classify(evidence).kind is not Kind.DONE:
            return None
    return FinishedRun(f"DONE in {run_dir.resolve()}", folder.done_step(), command)


def _evidence_of_done(
    folder: RunDir, done: dict[str, Any], exit_code: int | None
) -> Evidence | None:
    """The markers of the attempt that wrote `done`: those carrying its token, whatever
    their times (every writer of a fenced attempt stamps its token; a tokenless marker
    beside it is another writer's). A tokenless DONE (an older version's, or a run
    started by hand) falls back to the time rule: markers written since DONE was. None:
    DONE was removed meanwhile."""
    from ..outcome import MARKER_FILES, Evidence

    token = done.get(TOKEN_FIELD)
    if isinstance(token, str) and token:
        found = {name: folder.read_marker(name) for name in MARKER_FILES}
        mine = {n: m for n, m in found.items() if m is not None and m.get(TOKEN_FIELD) == token}
        return Evidence(exit_code, mine, token=token)
    try:
        since = folder.done_file.stat().st_mtime
    except OSError:
        return None
    return Evidence.gather(folder.root, since, exit_code)


def require_script(spec: JobSpec, where: str) -> None:
    """An entrypoint's script (and code_dir) must exist where the nodes will read it: on
    this machine's file system, which `where` says the nodes share."""
    from ..inputs import script_problems

    problems = script_problems(spec, where)
    if problems:
        raise SpecError(problems[:1])


class Cluster(ABC):
    """One cluster backend."""

    name: ClassVar[str]
    # The spec section under `name` (None: the cluster takes no settings). A built-in
    # cluster's is also named in REGISTRY, so that a spec is read without this module.
    spec_section: ClassVar[type[ClusterSection] | None] = None
    # What `shardctl render` prints after writing the files ({out}, {name}, {spec},
    # {chart}, {manifests}); `next_step_for` may pick it per spec.
    next_step: ClassVar[str] = ""
    # The module of the node agent the launch script execs above the launcher (None:
    # the cluster starts its agent above the script; Kubernetes: the pod's own).
    node_agent: ClassVar[str | None] = None

    def next_step_for(self, spec: JobSpec) -> str:
        return self.next_step

    # -- what the nodes get ----------------------------------------------------------

    @abstractmethod
    def runtime_env(self, spec: JobSpec) -> list[EnvLine]:
        """Env lines that set SHARDCTL_NNODES, SHARDCTL_NODE_RANK, SHARDCTL_NPROC_PER_NODE,
        MASTER_ADDR and MASTER_PORT on a node of this cluster (see launch.RUNTIME_VARS)."""

    def node_view(self, spec: JobSpec) -> NodeView:
        return NodeView(spec)

    def own_artifacts(self, node: NodeView, common: dict[str, str]) -> dict[str, str]:
        """Files only this cluster needs; `common` holds the shared ones already."""
        return {}

    def run_problems(self, spec: JobSpec) -> list[str]:
        """What running on this cluster needs that `spec` (as the nodes read it) lacks,
        one line each: its section's `run_problems`. The one list of these checks:
        `submit` refuses them (`check`), `validate` and `doctor` show them
        (`submit_problems`)."""
        section = spec.cluster_section(self.name)
        return section.run_problems(spec) if section is not None else []

    def submit_problems(self, spec: JobSpec) -> list[str]:
        """`run_problems` of `spec` as read from its file, as `submit` would find them."""
        return self.run_problems(self.node_view(spec).spec)

    def check(self, spec: JobSpec) -> None:
        """Raise `SpecError` naming what running on this cluster needs that `spec` (as
        the nodes read it) lacks: `run_problems`, one line each."""
        problems = self.run_problems(spec)
        if problems:
            raise SpecError(problems)

    def artifacts(self, spec: JobSpec, *, own: dict[str, str] | None = None) -> dict[str, str]:
        """Every file of the job for this cluster, sorted by name. Pure, deterministic.
        A cluster whose `dryrun` renders without this calls `check` itself. `own`: this
        cluster's own files when the caller made them already (a dry run renders them
        from the request it holds, so that both come from one computation)."""
        node = self.node_view(spec)
        self.check(node.spec)
        files = common_artifacts(
            node.spec, node.spec_path, self.name, self.runtime_env(node.spec),
            node_agent=self.node_agent,
        )  # fmt: skip
        if own is None:
            own = self.own_artifacts(node, dict(files))
        clash = sorted(k for k in own.keys() & files.keys() if own[k] != files[k])
        if clash:
            raise RenderError(f"{self.name} renders {', '.join(clash)} twice, differently")
        return dict(sorted({**files, **own}.items()))

    def env_file(self, spec: JobSpec) -> str:
        return env_file(spec, self.name, self.runtime_env(spec))

    def launch_script(
        self, spec: JobSpec, spec_path: str = SPEC_FILE, *, module: str = TRAIN_MODULE
    ) -> str:
        return launch_script(spec, self.name, self.runtime_env(spec), spec_path, module=module)

    # -- submit --------------------------------------------------------------------

    @abstractmethod
    def dryrun(self, spec: JobSpec) -> DryRun: ...

    @abstractmethod
    def schedule(self, dryrun: DryRun) -> JobRef: ...

    def submit(self, spec: JobSpec) -> JobRef:
        return self.schedule(self.dryrun(spec))

    # -- follow-up -------------------------------------------------------------------

    @abstractmethod
    def status(self, ref: JobRef) -> JobStatus: ...

    # `status_many` asks the cluster once for many jobs, so `ls` hands it all of this
    # cluster's jobs in one call; False: `ls` calls it with one job at a time, a few
    # at once (jobs.LS_WORKERS), which suits a cluster whose question is per job.
    batch_status: ClassVar[bool] = False

    def status_many(self, refs: Sequence[JobRef]) -> list[JobStatus | Exception]:
        """The status of each job of `refs`, in order; in a job's place, the error that
        asking for it raised (`ls` shows it on that job's row and goes on). An error
        that concerns every job (no client, no answer) is raised instead. A cluster
        that can ask for many jobs at once overrides this and sets `batch_status`."""
        answers: list[JobStatus | Exception] = []
        for ref in refs:
            try:
                answers.append(self.status(ref))
            except Exception as exc:  # one job's error, shown on its row by the caller
                answers.append(exc)
        return answers

    @abstractmethod
    def logs(self, ref: JobRef, tail: int | None = None) -> str: ...

    @abstractmethod
    def cancel(self, ref: JobRef) -> None: ...

    can_follow: ClassVar[bool] = False  # submit --wait
    supports_replace: ClassVar[bool] = False  # submit --replace
    # The run dir (logs/metrics.jsonl, job.yaml) is on a file system this machine reads:
    # `ls`, `status` and `submit --wait` show step and loss from it.
    run_dir_here: ClassVar[bool] = True
    # Why not, when it is not (`ls -o json` says it).
    run_dir_elsewhere: ClassVar[str] = ""
    # How often `status --watch` and `logs -f` ask the cluster.
    poll_s: ClassVar[float] = 2.0
    # `follow` takes `write=` and `tick=` (the `submit --wait` progress bar).
    follow_ticks: ClassVar[bool] = False

    # -- shardctl doctor -------------------------------------------------------------

    # Every node is this machine: collectives never cross a network.
    one_machine: ClassVar[bool] = False
    # What the preemption budget check says where `preemption_budget` is None.
    no_preemption_budget: ClassVar[str] = "this cluster gives no time to save before a stop"

    def preflight(self, spec: JobSpec) -> Preflight:
        """This cluster's own pre-flight checks (master address, port, a shared
        checkpoint dir ...); each says `skip` when it cannot run, never passes silently."""
        from ..doctor import Preflight

        return Preflight()

    def preemption_budget(self, spec: JobSpec) -> tuple[int, str] | None:
        """Seconds the ranks get to save between the stop signal and the kill, and the
        spec field that sets them; None when nothing stops the job on a deadline."""
        return None

    def network_check(self, spec: JobSpec, var: str) -> Check | None:
        """The network interface check of a multi-node job, where this cluster knows
        better than the nodes' interfaces (`var`: the *_SOCKET_IFNAME that picks one)."""
        return None

    def follow(self, ref: JobRef) -> int:
        """`submit --wait`: follow the job until it ends and return its exit code."""
        raise UsageError(f"--wait is not supported with --cluster {self.name}")

    def finished_run(self, dryrun: DryRun) -> FinishedRun | None:
        """What the last run of the dry run's run dir finished; None when it did not end
        well or this machine cannot tell. Here: its DONE (`finished_in`), where this
        machine reads the run dir."""
        return finished_in(Path(dryrun.spec.run_dir)) if self.run_dir_here else None

    def complete_run(self, dryrun: DryRun) -> str | None:
        """Where the dry run's work is recorded as done already (`FinishedRun.completes`,
        judged on the spec as the nodes read it); `submit` then starts nothing."""
        done = self.finished_run(dryrun)
        node_spec = self.node_view(dryrun.spec).spec
        return done.where if done is not None and done.completes(node_spec) else None

    def attempts_job(self, ref: JobRef) -> str:
        """The job's id in the run dir's attempts.jsonl (`outcome.record_attempt`),
        read by `status` and `ls` for its goodput (`orchestrator/goodput.py`)."""
        return ref.job_id

    def has_ended(self, ref: JobRef, st: JobStatus) -> bool:
        """Whether the job will change no more (`status --watch`, `logs -f` stop then)."""
        return st.state.is_terminal

    def exit_code_of(self, ref: JobRef, st: JobStatus) -> int:
        """The code `status --watch` exits with once the job ended, like `submit --wait`:
        0 succeeded, 42 preempted (a checkpoint is saved: submit again), 124 hung (ended
        by its watchdog: submit again), else 1."""
        if st.state is JobState.SUCCEEDED:
            return 0
        if st.state is JobState.HUNG:
            return EXIT_HUNG
        return EXIT_PREEMPTED if st.state is JobState.PREEMPTED else 1

    def procs_per_node(self, ref: JobRef) -> int | None:
        """Processes per node of a submitted job (`logs --rank` → node), from the job.yaml
        in its run dir; None when that cannot be read."""
        return run_resources(ref.run_dir).get("procs_per_node")

    def node_of_rank(self, ref: JobRef, rank: int) -> tuple[int, str] | None:
        """The node (index, host) that really ran global `rank` of a submitted job, where
        the cluster recorded it (`logs --rank`); None: not known, `rank //
        procs_per_node` in launch order."""
        return None

    def follow_logs(
        self,
        ref: JobRef,
        write: Callable[[str], None],
        *,
        node: int | None = None,
        tail: int | None = None,
        poll_s: float | None = None,
    ) -> None:
        """`logs -f`: every node's output as it comes, each line prefixed with where it
        came from, until the job ends. `node`: that node only."""
        raise UsageError(f"logs -f is not supported with --cluster {self.name}")


def run_resources(run_dir: str | Path) -> dict[str, int]:
    """`resources.nodes` and `procs_per_node` of the job.yaml a run was started with (the
    integers found; none when the file is missing or unreadable)."""
    from ..yamlio import read_yaml_file

    try:
        data = read_yaml_file(Path(run_dir) / SPEC_FILE, written=True)
    except ShardctlError:
        return {}
    res = data.get("resources") if isinstance(data, dict) else None
    if not isinstance(res, dict):
        return {}
    return {
        k: v
        for k in ("nodes", "procs_per_node")
        if isinstance(v := res.get(k), int) and not isinstance(v, bool) and v > 0
    }


class FileTail:
    """A log file read as it grows, one complete line at a time, each line prefixed.

    `tail`: start with the last N lines already there (None: from `offset`)."""

    def __init__(
        self, path: Path, prefix: str = "", offset: int = 0, tail: int | None = None
    ) -> None:
        self.path, self.prefix, self.offset = path, prefix, offset
        self._partial = b""
        self._tail = tail

    def poll(self, final: bool = False) -> str:
        try:
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self.offset:  # truncated or replaced: start again
                    self.offset, self._partial = 0, b""
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            chunk = b""
        self.offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        if self._tail is not None:
            lines, self._tail = lines[-self._tail :] if self._tail else [], None
        return "".join(
            f"{self.prefix}{line.decode('utf-8', errors='replace').rstrip(chr(13))}\n"
            for line in lines
        )


def prefix_lines(prefix: str, text: str) -> str:
    """Every line of `text` (complete lines) with `prefix` in front, like `kubectl logs
    --prefix`."""
    return "".join(f"{prefix}{line}" for line in text.splitlines(keepends=True))
