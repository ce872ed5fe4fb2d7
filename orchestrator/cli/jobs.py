"""Submitted jobs: `ls` (alias `ps`), `status [--watch]`, `logs [-f]`, `cancel`, and the
`submit --wait` display.

Every command finds a job through its record (clusters/records.py). `ls` asks every
cluster at once, each through at most LS_WORKERS threads of its own (a cluster that
asks for many jobs in one query, `Cluster.batch_status`, gets all its jobs in one
`status_many` call: Slurm runs one `scontrol` and one `sacct`, not one per job), and
waits at most `--timeout` seconds in all: a slow or unreachable cluster marks its rows
stale instead of holding the table, and the threads that still wait on it (daemons)
do not keep shardctl from exiting.
Step, total and loss come from the run's logs/metrics.jsonl where this machine can
read the run dir (local; Slurm's shared run dir), see orchestrator/progress.py; so does
the line `status` prints under the state when one rank is consistently the slowest, and
the goodput line and `ls` column (orchestrator/goodput.py, from attempts.jsonl).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NoReturn

import click

from .common import ClusterChoice, Seconds, echo_json, handle_errors, output_option

if TYPE_CHECKING:
    from ..clusters.base import Cluster, JobRef, JobStatus
    from ..goodput import Goodput
    from ..progress import Progress
    from ..spec import JobSpec

EXIT_INTERRUPTED = 130  # what a shell reports for Ctrl-C
LS_TIMEOUT_S = 10.0
# Threads `ls` gives each cluster. One per job started 1,000 threads (and, on Slurm, up
# to 1,000 commands at once) for 1,000 jobs; per cluster, so that one that never
# answers cannot take the threads the others need.
LS_WORKERS = 8


def job_exit_code(backend: Cluster, ref: JobRef, st: JobStatus, code: int | None = None) -> int:
    """The code `status --watch` and `submit --wait` exit with once the job ended: one
    meaning per code on every cluster (docs/reference/exit-codes.md). A cancel is
    EXIT_CANCELLED whatever the cluster and whether or not a checkpoint was saved on the
    way out (42 means a preemption's save); else the cluster's own (`code`: what its
    `follow` returned)."""
    from ..clusters.base import JobState
    from ..rundir import EXIT_CANCELLED

    if st.state is JobState.CANCELLED:
        return EXIT_CANCELLED
    return backend.exit_code_of(ref, st) if code is None else code


def _interrupted(message: str) -> NoReturn:
    click.echo(f"\n{message}", err=True)
    sys.exit(EXIT_INTERRUPTED)


def _where_it_stands(backend: Cluster, ref: JobRef, what: str) -> str:
    """After a Ctrl-C cut `what` short (`submit --wait`'s cancel, `cancel`'s wait): the
    line saying what became of the run and the command that follows it, never click's
    bare "Aborted!"."""
    from pathlib import Path

    from ..clusters.base import JobState
    from ..rundir import CANCELLED_FILE

    name = ref.name
    try:
        st = backend.status(ref)
    except (Exception, KeyboardInterrupt) as exc:  # a third Ctrl-C, or no answer
        why = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc)
        return f"stopped {what}; the state of {name} is unknown ({why}): `shardctl status {name}`"
    if backend.has_ended(ref, st):
        return f"stopped {what}; {name} has ended: {st.state.value}"
    # `cancel` writes the marker before its first signal (local; Slurm's scancel shows
    # as the job's state): a run that has it is on its way out.
    marked = backend.run_dir_here and (Path(ref.run_dir) / CANCELLED_FILE).is_file()
    if marked or st.state is JobState.CANCELLED:
        return (
            f"stopped {what}; {name} is being cancelled (its processes got SIGTERM and save "
            f"on the way out): follow it with `shardctl status {name} --watch`; `shardctl "
            f"cancel {name}` again ends what is left"
        )
    return (
        f"stopped {what}; {name} is still running: follow it with `shardctl status {name} "
        f"--watch`, stop it with `shardctl cancel {name}`"
    )


def _progress(backend: Cluster, ref: JobRef) -> tuple[Progress | None, str]:
    """(the newest logged step, "") or (None, why not)."""
    if not backend.run_dir_here:
        where = f" ({ref.extra['pvc']!s})" if ref.extra.get("pvc") else ""
        return None, f"{backend.run_dir_elsewhere}{where}"
    from ..progress import read_progress

    return read_progress(ref.run_dir)


def _straggler(backend: Cluster, ref: JobRef) -> str | None:
    """The line naming a consistently slowest rank, where the run dir is readable here."""
    if not backend.run_dir_here:
        return None
    from ..progress import straggler

    return straggler(ref.run_dir)


def _goodput(
    backend: Cluster, ref: JobRef, st: JobStatus | None, submitted: float | None = None
) -> Goodput | None:
    """The job's goodput (orchestrator/goodput.py) where its run dir is readable here;
    `st`: its state (None: unknown, counted as ended); `submitted`: its record's time."""
    if not backend.run_dir_here:
        return None
    from ..goodput import goodput

    running = st is not None and not backend.has_ended(ref, st)
    return goodput(
        ref.run_dir, backend.attempts_job(ref), running=running, now=time.time(),
        submitted=submitted,
    )  # fmt: skip


def _last_restore(backend: Cluster, ref: JobRef) -> dict[str, Any] | None:
    """Which checkpoint tier the run last resumed from (`train/memory_tier.py`), where
    the run dir is readable here."""
    if not backend.run_dir_here:
        return None
    from ...train.memory_tier import last_restore

    return last_restore(ref.run_dir)


def _status_line(ref: JobRef, st: JobStatus, prog: Progress | None) -> str:
    detail = f" — {st.detail}" if st.detail else ""
    step = f"; {prog.short()}" if prog is not None else ""
    return f"{ref.name} ({ref.cluster} {ref.job_id}): {st.state.value} [{st.native_state}]" + (
        f"{detail}{step}"
    )


def _status_json(
    ref: JobRef,
    st: JobStatus,
    prog: Progress | None,
    why: str,
    slow: str | None,
    good: Goodput | None = None,
    restore: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        **ref.to_json(),
        "state": st.state.value,
        "native_state": st.native_state,
        "detail": st.detail,
        "progress": prog.to_json() if prog is not None else None,
        "why": why if prog is None else "",
        "straggler": slow,
        "goodput": good.to_json() if good is not None else None,
        # The last resume: tier (memory, durable), step, lost_steps (None: no resume).
        "restore": restore,
        # The code it runs, recorded at submit (clusters/records.code_version); None
        # for a record from before it was kept.
        "code": ref.extra.get("code"),
    }


# ------------------------------------------------------------------------ status


@click.command()
@click.argument("job")
@click.option(
    "--watch",
    "-w",
    is_flag=True,
    help="Print the state (and step/loss) again on every change until the job ends; exit "
    "like `submit --wait` (0 succeeded, 42 preempted and saved: submit again to resume, "
    "143 cancelled, 124 hung, 1 failed).",
)
@click.option(
    "--interval",
    type=Seconds(0.1, 3600),
    default=None,
    help="--watch: seconds between looks (default: 0.5 local, 2 Slurm and k8s).",
)
@output_option
@handle_errors
def status(job: str, watch: bool, interval: float | None, output: str) -> None:
    """State of a submitted JOB (name or id), with its step and loss where known, the
    git commit of its code at submit, and the rank that is consistently the slowest,
    if one is."""
    from ..clusters import get_cluster
    from ..clusters.records import describe_code, recall

    ref = recall(job)
    backend = get_cluster(ref.cluster)
    code = describe_code(ref.extra.get("code"))
    wait = backend.poll_s if interval is None else interval
    last: tuple[Any, ...] | None = None
    try:
        while True:
            st = backend.status(ref)
            prog, why = _progress(backend, ref)
            seen = (st, prog.step if prog else None)
            if seen != last:
                slow = _straggler(backend, ref)
                good = _goodput(backend, ref, st)
                restore = _last_restore(backend, ref)
                if output == "json":
                    data = _status_json(ref, st, prog, why, slow, good, restore)
                    if watch:  # one JSON document per line, one line per change
                        import json

                        click.echo(json.dumps(data, sort_keys=True))
                    else:
                        echo_json(data)
                else:
                    click.echo(_status_line(ref, st, prog))
                    if code is not None and last is None:  # once: it does not change
                        click.echo(f"  {code}")
                    if slow is not None:
                        click.echo(f"  straggler: {slow}")
                    if good is not None:
                        click.echo(f"  {good.line()}")
                    if restore is not None:
                        from ...train.memory_tier import restore_words

                        click.echo(f"  {restore_words(restore)}")
                last = seen
            if not watch:
                return
            if backend.has_ended(ref, st):
                sys.exit(job_exit_code(backend, ref, st))
            time.sleep(wait)
    except KeyboardInterrupt:
        _interrupted(f"stopped watching; {ref.name} goes on (shardctl cancel {ref.name} stops it)")


# -------------------------------------------------------------------------- logs


@click.command()
@click.argument("job")
@click.option("--tail", type=click.IntRange(min=0), default=None, help="Last N lines only.")
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Keep printing as the job writes, every node's lines prefixed with where they come "
    "from, until the job ends (Ctrl-C stops following; the job goes on).",
)
@click.option(
    "--node", type=click.IntRange(min=0), default=None, help="With -f: node N only (0-based)."
)
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    default=None,
    help="With -f: the node that runs global rank R (its other ranks' lines come with it).",
)
@handle_errors
def logs(job: str, tail: int | None, follow: bool, node: int | None, rank: int | None) -> None:
    """Logs of every node/rank of a submitted JOB."""
    from ..clusters import get_cluster
    from ..clusters.base import run_resources
    from ..clusters.records import recall
    from ..errors import UsageError

    if not follow and (node is not None or rank is not None):
        what = "--node" if node is not None else "--rank"
        raise UsageError(f"{what} works with --follow/-f; accepted: logs JOB -f {what} N")
    if node is not None and rank is not None:
        raise UsageError("--node and --rank pick the same thing; accepted: one of them")
    ref = recall(job)
    backend = get_cluster(ref.cluster)
    if not follow:
        if tail != 0:  # --tail 0: nothing (with -f: only what comes from now on)
            click.echo(backend.logs(ref, tail=tail), nl=False)
        return
    if rank is not None:
        per_node = backend.procs_per_node(ref)
        if per_node is None:
            raise UsageError(
                f"--rank {rank}: cannot tell which node of {ref.name!r} runs it (its "
                "processes per node are unknown here); accepted: --node N"
            )
        nodes = run_resources(ref.run_dir).get("nodes")
        if nodes is not None and rank >= nodes * per_node:
            world = nodes * per_node
            raise UsageError(
                f"--rank {rank} is out of range: {ref.name!r} has world size {world} "
                f"({nodes} node(s) × {per_node} process(es)); accepted: 0..{world - 1}"
            )
        ran = backend.node_of_rank(ref, rank)  # where the cluster recorded it
        if ran is not None:
            node, host = ran
            click.echo(f"rank {rank} ran on node {node} ({host}); showing that node", err=True)
        else:
            node = rank // per_node
            first = node * per_node
            click.echo(
                f"rank {rank} runs on node {node} (ranks {first}..{first + per_node - 1}, "
                "in launch order); showing that node",
                err=True,
            )

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        backend.follow_logs(ref, write, node=node, tail=tail)
    except KeyboardInterrupt:
        _interrupted(f"stopped following; {ref.name} goes on")


# ------------------------------------------------------------------------ cancel


@click.command()
@click.argument("job")
@handle_errors
def cancel(job: str) -> None:
    """Cancel a submitted JOB on every node."""
    from ..clusters import get_cluster
    from ..clusters.records import recall

    ref = recall(job)
    backend = get_cluster(ref.cluster)
    try:
        backend.cancel(ref)
    except KeyboardInterrupt:
        _interrupted(_where_it_stands(backend, ref, "waiting for the cancel"))
    click.echo(f"cancelled {ref.name} ({ref.cluster} {ref.job_id})")


# ---------------------------------------------------------------------------- ls


@dataclass
class Row:
    name: str
    cluster: str
    job_id: str
    run_dir: str
    record: str
    submitted: float | None
    state: str = "?"
    native_state: str = ""
    detail: str = ""
    stale: str = ""  # why the record no longer describes a job ("" when it does)
    progress: Progress | None = None
    why: str = ""  # why there is no progress
    goodput: Goodput | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "cluster": self.cluster,
            "job_id": self.job_id,
            "run_dir": self.run_dir,
            "record": self.record,
            "state": self.state,
            "native_state": self.native_state,
            "detail": self.detail,
            "stale": bool(self.stale),
            "why_stale": self.stale,
            "progress": self.progress.to_json() if self.progress is not None else None,
            "why": self.why if self.progress is None else "",
            "submitted": self.submitted,
            "age_s": round(now - self.submitted, 1) if self.submitted is not None else None,
            "goodput": self.goodput.to_json() if self.goodput is not None else None,
        }


def _look(backend: Cluster, ref: JobRef, row: Row, answer: JobStatus | Exception) -> Row:
    """`row` filled from the cluster's `answer` (its status of the job, or the error
    asking raised) and the run dir; a copy, so that no thread sees a half-filled row."""
    from ..clusters.base import JobState
    from ..errors import ShardctlError

    row = replace(row)
    st: JobStatus | None = None
    if isinstance(answer, ShardctlError):
        row.state, row.stale = "?", f"cluster {ref.cluster} did not answer: {answer}"
    elif isinstance(answer, Exception):  # a client library's own error: shown, never a traceback
        row.state = "?"
        row.stale = f"cluster {ref.cluster} failed: {type(answer).__name__}: {answer}"
    else:
        st = answer
        row.state, row.native_state, row.detail = st.state.value, st.native_state, st.detail
        if st.state is JobState.UNKNOWN:
            row.stale = f"{ref.cluster} no longer knows the job: {st.detail or st.native_state}"
    try:
        row.progress, row.why = _progress(backend, ref)
    except OSError as exc:
        row.why = f"cannot read the run dir: {exc}"
    row.goodput = _goodput(backend, ref, st, row.submitted)
    return row


def _answers(backend: Cluster, refs: list[JobRef]) -> list[JobStatus | Exception]:
    """`backend.status_many(refs)`, one answer per job: an error raised about all of
    them is each one's answer."""
    from ..errors import ClusterError

    try:
        answers = backend.status_many(refs)
    except Exception as exc:  # no client, no answer: on each of their rows
        return [exc] * len(refs)
    if len(answers) != len(refs):  # a plugin's mistake: said on the rows, not a traceback
        wrong = ClusterError(f"status_many gave {len(answers)} answer(s) for {len(refs)} job(s)")
        return [wrong] * len(refs)
    return answers


class _Lookup:
    """`ls`'s questions to one cluster, answered by at most LS_WORKERS daemon threads
    into `rows` until `deadline` (time.monotonic()). A batch cluster's jobs are one
    question (`status_many` of all of them); any other's, one question per job. An
    answer counts only while the lookup is open: `close` (at the deadline) keeps the
    rows answered by then and returns the indices of the others."""

    def __init__(self, rows: list[Row], deadline: float) -> None:
        self.rows, self.deadline = rows, deadline
        self._lock = threading.Condition()
        self._waiting: set[int] = set()  # indices of rows not answered yet
        self._open = True

    def start(self, backend: Cluster, jobs: Sequence[tuple[int, JobRef]]) -> None:
        """Ask `backend` about `jobs` ((row index, record) pairs) in the background."""
        with self._lock:
            self._waiting.update(i for i, _ in jobs)
        groups = [list(jobs)] if backend.batch_status else [[job] for job in jobs]
        todo = deque(groups)
        for _ in range(min(LS_WORKERS, len(groups))):
            # Daemon threads: a cluster that never answers cannot keep shardctl from exiting.
            threading.Thread(target=self._work, args=(backend, todo), daemon=True).start()

    def _work(self, backend: Cluster, todo: deque[list[tuple[int, JobRef]]]) -> None:
        while time.monotonic() < self.deadline:  # past it, no new question is asked
            try:
                group = todo.popleft()  # deque: safe across threads without a lock
            except IndexError:
                return
            answers = _answers(backend, [ref for _, ref in group])
            for (i, ref), answer in zip(group, answers, strict=True):
                try:
                    row = _look(backend, ref, self.rows[i], answer)
                except Exception as exc:  # a run dir's surprise: on its row, not a traceback
                    row = replace(self.rows[i], state="?")
                    row.stale = f"cannot show {ref.name}: {type(exc).__name__}: {exc}"
                with self._lock:
                    if self._open:
                        self.rows[i] = row
                        self._waiting.discard(i)
                        if not self._waiting:  # woken once, not once per row
                            self._lock.notify_all()

    def wait(self) -> None:
        """Until every row is answered or the deadline passes."""
        with self._lock:
            self._lock.wait_for(
                lambda: not self._waiting, max(0.0, self.deadline - time.monotonic())
            )

    def close(self) -> list[int]:
        """Stop taking answers; the indices of the rows without one."""
        with self._lock:
            self._open = False
            return sorted(self._waiting)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(max(seconds, 0))}s"


def _table(rows: list[Row], now: float) -> str:
    head = ("NAME", "CLUSTER", "ID", "STATE", "STEP", "LOSS", "GOODPUT", "AGE")
    lines = [head]
    for r in rows:
        p = r.progress
        step = "—" if p is None else (f"{p.step}/{p.total}" if p.total is not None else str(p.step))
        loss = "—" if p is None or p.loss is None else f"{p.loss:.4g}"
        state = r.state + ("*" if r.stale else "")
        age = _age(now - r.submitted if r.submitted is not None else None)
        good = r.goodput.percent() if r.goodput is not None else ""
        lines.append((r.name, r.cluster, r.job_id or "-", state, step, loss, good, age))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    ]
    stale = [r for r in rows if r.stale]
    if stale:
        out.append("")
        out += [f"* {r.name}: {r.stale}" for r in stale]
    return "\n".join(out)


def _wanted_states(given: Sequence[str]) -> set[str] | None:
    """`--state` values (repeated or comma-separated, any case) as JobState names; None
    when none was given. An unknown one is refused with the closest known state."""
    import difflib

    from ..clusters.base import JobState
    from ..errors import UsageError

    known = [state.value for state in JobState]
    wanted = {word.strip().upper() for value in given for word in value.split(",")}
    wanted.discard("")
    for word in sorted(wanted):
        if word not in known:
            hint = difflib.get_close_matches(word, known, n=1)
            did_you_mean = f" (did you mean {hint[0]}?)" if hint else ""
            raise UsageError(
                f"--state {word!r} is not a job state{did_you_mean}; accepted: "
                f"{', '.join(known)} (repeat --state or separate them with commas)"
            )
    return wanted or None


def _row_state(row: Row) -> str:
    """The state `--state` matches: a row whose cluster did not answer is UNKNOWN."""
    return "UNKNOWN" if row.state == "?" else row.state


def _ls(
    cluster: str | None,
    timeout: float,
    output: str,
    states: set[str] | None = None,
    pattern: str | None = None,
) -> None:
    from fnmatch import fnmatchcase

    from ..clusters import get_cluster
    from ..clusters.records import scan_records

    now = time.time()
    rows: list[Row] = []
    # Per cluster: its backend and its jobs, (row index, record) pairs.
    work: dict[str, tuple[Cluster, list[tuple[int, JobRef]]]] = {}
    backends: dict[str, Cluster | Exception] = {}
    for rec in scan_records():
        ref = rec.ref
        # The name filter comes first: a job left out is not asked about.
        if pattern is not None and not fnmatchcase(ref.name if ref else rec.path.stem, pattern):
            continue
        if ref is None:
            if cluster is None and states is None:  # an unreadable record has no state
                rows.append(
                    Row(rec.path.stem, "?", "?", "", str(rec.path), rec.submitted,
                        stale=f"unreadable record {rec.path} ({rec.error}); delete it if the "
                        "job is gone")
                )  # fmt: skip
            continue
        if cluster is not None and ref.cluster != cluster:
            continue
        row = Row(ref.name, ref.cluster, ref.job_id, ref.run_dir, str(rec.path), rec.submitted)
        rows.append(row)
        if ref.cluster not in backends:
            try:  # an unknown cluster name (a record from another version) is one bad row
                backends[ref.cluster] = get_cluster(ref.cluster)
            except Exception as exc:
                backends[ref.cluster] = exc
        backend = backends[ref.cluster]
        if isinstance(backend, Exception):
            row.stale = f"cannot use cluster {ref.cluster!r}: {backend}"
            continue
        work.setdefault(ref.cluster, (backend, []))[1].append((len(rows) - 1, ref))
    # The clock starts before the first question: `--timeout` bounds the whole wait.
    lookup = _Lookup(rows, time.monotonic() + timeout)
    for backend, jobs in work.values():
        lookup.start(backend, jobs)
    lookup.wait()
    for i in lookup.close():
        rows[i].state = "?"
        rows[i].stale = f"cluster {rows[i].cluster} gave no answer within {timeout:g} s"
    if states is not None:
        rows = [r for r in rows if _row_state(r) in states]
    if output == "json":
        echo_json({"jobs": [r.to_json(now) for r in rows]})
    elif not rows:
        where = f" on {cluster}" if cluster else ""
        filters = [f"--state {','.join(sorted(states))}"] if states else []
        filters += [f"name {pattern!r}"] if pattern is not None else []
        if filters:
            click.echo(f"no submitted jobs{where} match {' and '.join(filters)}")
        else:
            click.echo(f"no submitted jobs{where}; submit one with `shardctl submit SPEC`")
    else:
        click.echo(_table(rows, now))


def _ls_command(name: str, help_text: str) -> click.Command:
    @click.command(name, help=help_text)
    @click.argument("pattern", required=False, metavar="[NAME_GLOB]")
    @click.option(
        "--cluster",
        type=ClusterChoice(),
        default=None,
        help="Only the jobs of this cluster.",
    )
    @click.option(
        "--state",
        "states",
        multiple=True,
        metavar="STATE",
        help="Only the jobs in this state (repeatable, or a comma list): PENDING, RUNNING, "
        "SUCCEEDED, FAILED, CANCELLED, PREEMPTED, HUNG, UNKNOWN (a cluster that did not "
        "answer counts as UNKNOWN).",
    )
    @click.option(
        "--timeout",
        type=Seconds(0.1, 3600),
        default=LS_TIMEOUT_S,
        show_default=True,
        help="Seconds to wait for the clusters in all; jobs of a cluster that has not "
        "answered by then are marked stale.",
    )
    @output_option
    @handle_errors
    def command(
        cluster: str | None,
        timeout: float,
        output: str,
        states: tuple[str, ...] = (),
        pattern: str | None = None,
    ) -> None:
        _ls(cluster, timeout, output, _wanted_states(states), pattern)

    return command


LS_HELP = (
    "Every submitted job on every cluster: state, step/total, loss, age. NAME_GLOB keeps "
    "the jobs whose name it matches (quote it: 'sweep-*'); --state keeps those in a state.\n\n"
    "Stale records (the cluster no longer knows the job, the record is unreadable, the "
    "cluster did not answer) are marked * and explained below the table."
)
ls_cmd = _ls_command("ls", LS_HELP)
ps_cmd = _ls_command("ps", "Alias of `ls`.")


# ----------------------------------------------------------------- submit --wait


def follow_submitted(backend: Cluster, ref: JobRef, job: JobSpec, console: Any = None) -> int:
    """`submit --wait`: follow the job until it ends, say what happened on stderr, and
    return its exit code. On a terminal, a run of the built-in loop whose run dir is
    here shows a progress bar (step/total, loss, tokens/s, ETA) from metrics.jsonl
    instead of the per-step lines; otherwise (a pipe, a file, a user script, k8s) the
    output is plain lines. `console`: a rich Console to draw on (tests)."""
    total = job.train.steps if job.train is not None else None
    terminal = console is not None or sys.stdout.isatty()
    try:
        if terminal and total and backend.follow_ticks:
            from ..progress import ProgressDisplay

            with ProgressDisplay(ref.run_dir, ref.name, total, console=console) as display:
                code = backend.follow(ref, write=display.write, tick=display.tick)  # type: ignore[call-arg]
        else:
            code = backend.follow(ref)
    except KeyboardInterrupt:  # a second Ctrl-C: the first one's cancel is under way
        _interrupted(_where_it_stands(backend, ref, "following"))
    # The last word is what happened, not the last line a launcher printed.
    st = backend.status(ref)
    detail = f": {st.detail}" if st.detail else ""
    click.echo(f"{ref.name}: {st.state.value}{detail}", err=True)
    good = _goodput(backend, ref, st)
    if good is not None and good.lost_steps is None:  # a script that logs no steps
        click.echo(f"  {good.line()}", err=True)
    return job_exit_code(backend, ref, st, code)
