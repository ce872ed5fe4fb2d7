"""`python3 -m shardctl.train.watchdog -- LAUNCHER ARGS...`: one node's hang watchdog.

A rendered launch script run by hand, with no node agent above it, execs this instead
of the launcher (unless the spec says `watchdog.enabled: false`); under a node agent
the script runs none, and the agent applies the rule (`HangWatch`) itself. It starts
the launcher as its child with `$SHARDCTL_HEARTBEAT_DIR` pointing at a fresh folder on
this node, passes on the signals it receives, and reads the ranks' heartbeats
(`shardctl.train.heartbeat`) every few seconds. It exits with the launcher's code, except:

- **hung**: when no rank of this node advanced for the hang timeout, it writes
  `<run dir>/HUNG`, asks every rank for its Python stack (SIGQUIT; a stopped rank
  also gets SIGCONT so it can answer), prints the report and the stacks to its
  stderr (the node's log) and to `<run dir>/logs/hang-attempt<A>-node<N>.txt`,
  SIGKILLs the launcher and everything below it, and exits `EXIT_HUNG` (124). Every
  node of a hung job declares it; the marker kept is that of the node whose rank
  stopped first (it writes again before it exits if a node that names no rank wrote
  over it in the same instant);
- **another node hung**: the launcher failed after another node's watchdog wrote a
  fresh HUNG (its ranks lost their peers): this node exits 124 too, so the whole
  job is retried as a hang and not failed (not under a node agent that says it
  judges from the markers, `SHARDCTL_NODE_SUPERVISOR`: Slurm's).

The rule itself, one look at a time, is `HangWatch`: this watchdog's loop calls it,
and so does the node agent on every cluster (a Kubernetes pod's,
`orchestrator/clusters/k8s/node_agent.py`, `--watch-hangs`; this machine's and
Slurm's, `orchestrator/agent/hangs.py`, from the launcher's own environment), which
runs the launcher with no watchdog process between.

The hang timeout is `$SHARDCTL_HANG_TIMEOUT_S` when set, else derived as the run goes
(`HangRule`): the largest of 300 s, 10× the median step time and 3× the longest
checkpoint save seen (this attempt's, and the `save_s` that earlier attempts
recorded in the checkpoint manifests); while no save has been measured, saves get
at least 900 s. A rank still in start-up (its heartbeat says so: from its first
heartbeat until it finished its first training step, see `heartbeat`) gets the
start-up allowance instead: `$SHARDCTL_STARTUP_TIMEOUT_S` when set, else 900 s kept
120 s under the collectives' timeout (`$SHARDCTL_COLLECTIVE_TIMEOUT_S`), and never
less than the hang timeout. A rank stuck in start-up is ended too, once that
allowance is spent. The clock starts at a rank's first heartbeat: before it, the
launcher's rendezvous timeout and the collectives' timeout apply.

Only this node's ranks are watched: every node decides alone, without a network of
its own, and in a hang every rank stops (the others wait in a collective for the
stuck one). Torch-free; imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from shardctl.orchestrator.checkpoint_list import save_times
from shardctl.orchestrator.outcome import Kind
from shardctl.orchestrator.proctree import (
    Proc,
    alive,
    descendants,
    forward_to_catchers,
    proc,
    signal_all,
)
from shardctl.orchestrator.rundir import (
    ENV_ATTEMPT,
    ENV_ATTEMPT_TOKEN,
    ENV_CHECKPOINT_DIR,
    ENV_COLLECTIVE_TIMEOUT,
    ENV_HANG_TIMEOUT,
    ENV_HEARTBEAT_DIR,
    ENV_NODE_SUPERVISOR,
    ENV_RESTART,
    ENV_RUN_DIR,
    ENV_STARTUP_TIMEOUT,
    EXIT_HUNG,
    HUNG_FILE,
    TOKEN_FIELD,
    RunDir,
)

from .heartbeat import STACK_SIGNAL, Beat, read_beats, stack_path

USAGE = "usage: python3 -m shardctl.train.watchdog -- LAUNCHER [ARGS...]"

FLOOR_S = 300.0  # never below a few minutes when derived
STEP_FACTOR = 10.0  # × the median step time
SAVE_FACTOR = 3.0  # × the longest checkpoint save
UNMEASURED_FLOOR_S = 900.0  # saves before any save was measured
# The start-up allowance when `watchdog.startup_timeout_s` is unset (mirrors
# spec.STARTUP_FLOOR_S, which says why 15 minutes), kept COLLECTIVE_MARGIN_S under
# the process group's timeout: a rank that waits in a collective for a peer still
# importing must not fail (FAILED, no retry) before its peer is ended as hung.
STARTUP_FLOOR_S = 900.0
COLLECTIVE_MARGIN_S = 120.0  # mirrors spec.COLLECTIVE_MARGIN_S
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0  # torch's; what env.sh renders when nothing is set
STACK_WAIT_S = 5.0  # how long the ranks get to write their stacks
KILL_WAIT_S = 30.0  # how long the killed launcher's tree gets to be gone
OTHER_NODE_WAIT_S = 10.0  # for another node's HUNG after this node's launcher failed
MAX_POLL_S = 5.0
# Signals passed on: TERM, INT and HUP to the launcher, as if it had received them
# (it stops its ranks its own way); USR1 and USR2 (preemption) to every process
# below that catches them — the ranks; a launcher would die of one. A signal ignored
# when the watchdog started stays ignored (Slurm's node task ignores the preemption
# signal for the launcher and sends it to the ranks itself).
TO_LAUNCHER = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
TO_RANKS = (signal.SIGUSR1, signal.SIGUSR2)
# Start-up and restore have their own allowance (HangRule.startup_limit).
SLOW_PHASES = ("save",)


def _say(text: str) -> None:
    print(f"[shardctl watchdog] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the rule


@dataclass
class HangRule:
    """The hang timeout: fixed (`explicit`), or derived from what the run shows."""

    explicit: float | None = None
    earlier_saves: list[float] = field(default_factory=list)
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=200))
    save_times: list[float] = field(default_factory=list)
    startup_explicit: float | None = None
    collective_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S

    def startup_base(self) -> float:
        """The start-up allowance before the hang timeout raises it."""
        if self.startup_explicit is not None:
            return self.startup_explicit
        return min(STARTUP_FLOOR_S, self.collective_s - COLLECTIVE_MARGIN_S)

    def startup_limit(self, phase: str) -> float:
        """A rank still in start-up: its own allowance, never below the hang timeout."""
        return max(self.limit(phase), self.startup_base())

    def limit_of(self, beat: Beat) -> float:
        return self.startup_limit(beat.phase) if beat.starting else self.limit(beat.phase)

    def limit(self, phase: str) -> float:
        if self.explicit is not None:
            return self.explicit
        saves = self.earlier_saves + self.save_times
        limit = FLOOR_S
        if self.step_times:
            limit = max(limit, STEP_FACTOR * statistics.median(self.step_times))
        if saves:
            limit = max(limit, SAVE_FACTOR * max(saves))
        elif phase in SLOW_PHASES:
            limit = max(limit, UNMEASURED_FLOOR_S)
        return limit

    def describe(self) -> str:
        if self.explicit is not None:
            return f"{self.explicit:g} s (watchdog.hang_timeout_s)"
        median = f"{statistics.median(self.step_times):.3g} s" if self.step_times else "unknown"
        saves = self.earlier_saves + self.save_times
        longest = f"{max(saves):.3g} s" if saves else "none measured"
        return (
            f"{self.limit('step'):g} s (derived: max({FLOOR_S:g} s, {STEP_FACTOR:g} × median "
            f"step {median}, {SAVE_FACTOR:g} × longest save {longest}))"
        )

    def describe_startup(self) -> str:
        """The start-up allowance, as the watchdog's first line and a hang report say it."""
        if self.startup_explicit is not None:
            how = "watchdog.startup_timeout_s"
        else:
            how = (
                f"derived: min({STARTUP_FLOOR_S:g} s, collective timeout {self.collective_s:g} s "
                f"- {COLLECTIVE_MARGIN_S:g} s)"
            )
        return (
            f"{self.startup_limit('start'):g} s ({how}; never below the hang timeout), from a "
            "rank's first heartbeat until it finished its first training step"
        )


def earlier_save_times(checkpoint_dir: str | None) -> list[float]:
    """`save_s` of the complete checkpoints in `checkpoint_dir` (earlier attempts),
    from the one lister (`checkpoint_list.save_times`, torch-free)."""
    return save_times(checkpoint_dir)


# ------------------------------------------------------------------ the monitor


@dataclass
class RankView:
    beat: Beat
    changed: float  # monotonic time at which this beat was first seen


@dataclass
class Verdict:
    idle_s: float  # since the most recent advance of any watched rank
    limit_s: float
    ranks: list[RankView]

    @property
    def starting(self) -> bool:
        """Some rank was still in start-up: its allowance, not the hang timeout, ran out."""
        return any(v.beat.starting for v in self.ranks)


class Monitor:
    """What the watchdog knows of this node's ranks, fed one poll at a time."""

    def __init__(self, rule: HangRule) -> None:
        self.rule = rule
        self.ranks: dict[int, RankView] = {}

    def observe(self, beats: Sequence[Beat], now: float) -> None:
        for b in beats:
            old = self.ranks.get(b.rank)
            if old is not None and old.beat == b:
                continue
            self.ranks[b.rank] = RankView(b, now)
            if old is None or old.beat.pid != b.pid:
                continue
            prev = old.beat
            if b.phase == "step" and prev.phase == "step" and b.step > prev.step:
                self.rule.step_times.append((b.time - prev.time) / (b.step - prev.step))
            elif prev.phase == "save" and b.phase != "save" and b.time > prev.time:
                self.rule.save_times.append(b.time - prev.time)

    def watched(self, alive: set[int]) -> list[RankView]:
        """Ranks that still run and have not finished their steps."""
        return [v for v in self.ranks.values() if v.beat.phase != "finish" and v.beat.pid in alive]

    def verdict(self, now: float, alive: set[int]) -> Verdict | None:
        """A Verdict when every watched rank has been idle past its phase's limit."""
        watched = self.watched(alive)
        if not watched:
            return None
        if any(now - v.changed <= self.rule.limit_of(v.beat) for v in watched):
            return None
        idle = now - max(v.changed for v in watched)
        limit = max(self.rule.limit_of(v.beat) for v in watched)
        return Verdict(idle, limit, sorted(watched, key=lambda v: v.beat.rank))


# ------------------------------------------------------------------ processes


def proc_state(pid: int, thread: str | None = None) -> str:
    """`R`, `S`, `D` (uninterruptible, e.g. a stuck file system), `T` (stopped), ...
    of the process, or of one of its threads (`thread`: its id under /proc/PID/task)."""
    where = f"/proc/{pid}/task/{thread}/stat" if thread is not None else f"/proc/{pid}/stat"
    try:
        text = Path(where).read_text()
        return text[text.rfind(")") + 2 :].split()[0]
    except (OSError, IndexError):
        return "?"


STATE_WORDS = {
    "R": "running",
    "S": "sleeping (waiting, e.g. in a collective)",
    "D": "uninterruptible wait in the kernel (file system or device)",
    "T": "stopped (SIGSTOP)",
    "t": "stopped by a debugger",
    "Z": "exited (zombie)",
}


def _wchan(pid: int) -> str:
    try:
        word = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        return ""
    return "" if word in ("", "0") else f", kernel wait {word}"


def _alive_pids(root: int) -> set[int]:
    return {p.pid for p in descendants(root)}


def collect_stacks(
    folder: Path, ranks: list[RankView], states: Mapping[int, str]
) -> dict[int, str]:
    """Ask every rank for its Python stack; what each wrote (or why nothing).

    Every rank gets SIGQUIT. The ranks that can run answer at once; then they are
    frozen (SIGSTOP) before a stopped rank is continued to answer, so the continued
    rank cannot finish a step (nor a save) with them while the watchdog listens.
    """
    stopped = [v for v in ranks if states[v.beat.rank] in ("T", "t")]
    running = [v for v in ranks if v not in stopped]
    for v in ranks:
        with contextlib.suppress(OSError):
            stack_path(folder, v.beat.rank).write_text("")  # the rank appends to it
        _signal(v.beat.pid, STACK_SIGNAL)
    _wait_for_stacks(folder, running, poll_s=0.5)
    for v in running:
        _signal(v.beat.pid, signal.SIGSTOP)
    for v in stopped:  # a stopped process runs its handler only once continued
        _signal(v.beat.pid, signal.SIGCONT)
    _wait_for_stacks(folder, stopped, poll_s=0.05)
    for v in stopped:
        _signal(v.beat.pid, signal.SIGSTOP)
    stacks: dict[int, str] = {}
    for v in ranks:
        try:
            text = stack_path(folder, v.beat.rank).read_text(errors="replace")
        except OSError:
            text = ""
        if not text.strip():
            state = states[v.beat.rank]
            text = (
                f"(no stack: the process did not answer SIGQUIT within {STACK_WAIT_S:g} s; "
                f"state {state}: {STATE_WORDS.get(state, 'unknown')}{_wchan(v.beat.pid)})\n"
            )
        stacks[v.beat.rank] = text
    return stacks


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _wait_for_stacks(folder: Path, ranks: list[RankView], poll_s: float) -> None:
    """Until every rank of `ranks` wrote a whole stack (≤ STACK_WAIT_S).

    faulthandler writes a stack in many small writes, with no end mark. A size that
    stopped growing is not enough on a loaded host: a rank preempted between two
    writes (`  File ` written, the file name not yet) looks finished. A stack is
    whole once it ends a line, its size held for two polls, and no thread of the
    rank is runnable or in a kernel write (a writer preempted mid-stack is `R`).
    """
    sizes: dict[int, int] = {}
    deadline = time.monotonic() + STACK_WAIT_S
    while ranks and time.monotonic() < deadline:
        now = {v.beat.rank: _size(stack_path(folder, v.beat.rank)) for v in ranks}
        if (
            all(now.values())
            and now == sizes
            and all(_ends_a_line(stack_path(folder, v.beat.rank)) for v in ranks)
            and not any(_some_thread_busy(v.beat.pid) for v in ranks)
        ):
            return
        sizes = now
        time.sleep(poll_s)


def _ends_a_line(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except OSError:
        return False


def _some_thread_busy(pid: int) -> bool:
    """A thread of `pid` is running or waiting to run (`R`) or in an uninterruptible
    kernel wait (`D`): it may be between two writes of its stack."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False  # gone: it writes nothing more
    return any(proc_state(pid, tid) in ("R", "D") for tid in tasks)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# ------------------------------------------------------------------ the report


def read_states(ranks: Sequence[RankView]) -> dict[int, str]:
    """Every rank's process state, read once at the verdict: the report, the marker and
    the stack collection then agree on it."""
    return {v.beat.rank: proc_state(v.beat.pid) for v in ranks}


def report_lines(
    verdict: Verdict, rule: HangRule, node: int, now_wall: float, states: Mapping[int, str]
) -> list[str]:
    lines = [
        f"node {node}: HUNG — no rank of this node advanced for {verdict.idle_s:.0f} s "
        f"({describe_limit(verdict, rule)})"
    ]
    culprits = first_stopped(verdict.ranks, states)
    for v in verdict.ranks:
        b = v.beat
        state = states[b.rank]
        first = "  ← stopped advancing first" if b.rank in culprits else ""
        phase = f"{b.phase}, in start-up" if b.starting else b.phase
        lines.append(
            f"  rank {b.rank} (pid {b.pid}): last at step {b.step} ({phase}), "
            f"{now_wall - b.time:.0f} s ago; process {STATE_WORDS.get(state, state)}"
            f"{_wchan(b.pid)}{first}"
        )
    if not culprits:
        lines.append(
            "  no rank of this node stands out: all wait (for a rank of another node, the "
            "network, or each other); the other nodes' logs name theirs"
        )
    return lines


def describe_limit(verdict: Verdict, rule: HangRule) -> str:
    """The limit that ran out: the start-up allowance when a rank was still starting."""
    if verdict.starting:
        return f"start-up allowance {rule.describe_startup()}"
    return f"hang timeout {rule.describe()}"


STUCK_STATES = ("T", "t", "D")


def first_stopped(ranks: Sequence[RankView], states: Mapping[int, str]) -> list[int]:
    """The ranks that stopped advancing first: stopped or in an uninterruptible wait
    if any is; else those whose last beat is older than the others' by over a second
    (none when all beat together: they wait for something outside this node)."""
    stuck = [v.beat.rank for v in ranks if states[v.beat.rank] in STUCK_STATES]
    if stuck:
        return sorted(stuck)
    times = [v.beat.time for v in ranks]
    oldest = min(times)
    first = [v.beat.rank for v in ranks if v.beat.time - oldest < 1.0]
    return sorted(first) if len(first) < len(ranks) else []


def write_hung_marker(
    run_dir: str | None,
    verdict: Verdict,
    rule: HangRule,
    node: int,
    attempt: int,
    report: str,
    since: float,
    states: Mapping[int, str] | None = None,
    token: str | None = None,
) -> dict[str, Any] | None:
    """HUNG for this node, unless another node of this attempt already wrote one that
    names the ranks that stopped first (every node of a hung job declares it; the one
    with the stuck rank knows the most). Returns what it wrote (None: nothing).
    `token`: the attempt's (a node agent's round), else this process's."""
    if not run_dir:
        return None
    states = read_states(verdict.ranks) if states is None else states
    first = first_stopped(verdict.ranks, states)
    other = RunDir.of(run_dir).fresh_marker(HUNG_FILE, since, token)
    if not first and other is not None and other.get("first"):
        return None
    data = {
        # The typed outcome (shardctl.orchestrator.outcome): hung, at which step, the
        # rank that stopped first (None: none of this node stands out), which node.
        "kind": Kind.HUNG.value,
        "step": min(v.beat.step for v in verdict.ranks),
        "rank": first[0] if first else None,
        "node": node,
        "attempt": attempt,
        "idle_s": round(verdict.idle_s, 1),
        "timeout_s": round(verdict.limit_s, 1),
        "rule": describe_limit(verdict, rule),
        "ranks": [
            {
                "rank": v.beat.rank,
                "step": v.beat.step,
                "phase": v.beat.phase,
                "state": states[v.beat.rank],
            }
            for v in verdict.ranks
        ],
        "first": first,
        "report": report,
        "time": time.time(),
    }
    if token:
        data[TOKEN_FIELD] = token
    with contextlib.suppress(OSError):
        RunDir.of(run_dir).write_marker(HUNG_FILE, data)
    return data


def keep_hung_marker(
    run_dir: str | None, mine: dict[str, Any] | None, since: float, token: str | None = None
) -> None:
    """Write this node's HUNG again if it names the ranks that stopped first and the
    marker there now names none. Nodes' watchdogs start together and poll at the same
    pace, so two may declare in the same instant: each looks, finds no marker, writes,
    and the one that knows nothing can land last."""
    if not run_dir or not mine or not mine.get("first"):
        return
    there = RunDir.of(run_dir).fresh_marker(HUNG_FILE, since, token)
    if there is None or not there.get("first"):
        with contextlib.suppress(OSError):
            RunDir.of(run_dir).write_marker(HUNG_FILE, mine)


# ------------------------------------------------------------------ main


def _env_int(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    try:
        return int((os.environ if env is None else env).get(name, "") or default)
    except ValueError:
        return default


def _env_seconds(name: str, env: Mapping[str, str] | None = None) -> float | None:
    """A positive number of seconds from the environment; None when unset or bad."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        _say(f"{name}={raw!r} is not a positive number of seconds; deriving it")
        return None
    return value


class HangWatch:
    """The hang rule over one node's ranks, one look at a time: a library that the
    watchdog's loop and a node agent (`Adapter.watch`: Kubernetes' pods) call.

    The ranks beat into `folder` (their `SHARDCTL_HEARTBEAT_DIR`). `look` reads the
    beats, passes on a stack a rank wrote on someone's SIGQUIT and, once no rank
    advanced past its limit, ends them (`end_hung`): the HUNG marker, the report with
    every rank's stack, SIGKILL to the launcher's whole tree. What it knows of the
    run comes from the rendered environment (node, attempt, run dir, timeouts): this
    process's, or `env`, the launcher's own (a node agent above `launch.sh`, which
    reads it from the launcher's process; its HUNG then carries that env's token)."""

    def __init__(self, folder: Path, env: Mapping[str, str] | None = None) -> None:
        self.folder = folder
        self.node = _env_int("SHARDCTL_NODE_RANK", 0, env)
        self.attempt = _env_int(ENV_ATTEMPT, 0, env)
        self.restart = _env_int(ENV_RESTART, 0, env)
        source = os.environ if env is None else env
        self.run_dir = source.get(ENV_RUN_DIR) or None
        # None: this process's token (`stamped`), as the watchdog's.
        self.token = None if env is None else env.get(ENV_ATTEMPT_TOKEN) or None
        self.rule = HangRule(
            explicit=_env_seconds(ENV_HANG_TIMEOUT, env),
            earlier_saves=earlier_save_times(source.get(ENV_CHECKPOINT_DIR)),
            startup_explicit=_env_seconds(ENV_STARTUP_TIMEOUT, env),
            collective_s=_env_seconds(ENV_COLLECTIVE_TIMEOUT, env) or DEFAULT_COLLECTIVE_TIMEOUT_S,
        )
        self.monitor = Monitor(self.rule)
        self.stack_seen: dict[int, int] = {}  # bytes of each rank's stack file passed on
        self.started = time.time()
        self.next_look = time.monotonic()

    def describe(self) -> str:
        return (f"hang timeout {self.rule.describe()}; start-up allowance "
                f"{self.rule.describe_startup()}")  # fmt: skip

    def look(self, launcher: int, *, own_child: bool = False) -> bool:
        """One look at the ranks below `launcher` (at most one per poll interval): True
        once it ended them as hung. `own_child`: the launcher is this process's child,
        whose caller reaps it (the watchdog); else this waits for it to be gone."""
        now = time.monotonic()
        if now < self.next_look:
            return False
        self.next_look = now + min(MAX_POLL_S, max(0.5, self.rule.limit("step") / 10))
        beats = read_beats(self.folder)
        self.monitor.observe(beats, now)
        self._pass_on_stacks(beats)
        verdict = self.monitor.verdict(now, _alive_pids(launcher))
        if verdict is None:
            return False
        self.end_hung(verdict, launcher)
        return True

    def _pass_on_stacks(self, beats: Sequence[Beat]) -> None:
        """Stacks a rank wrote on someone's `kill -QUIT` go to the node's log."""
        for b in beats:
            path = stack_path(self.folder, b.rank)
            size, seen = _size(path), self.stack_seen.get(b.rank, 0)
            if size <= seen:
                continue
            try:
                with path.open("rb") as f:
                    f.seek(seen)
                    text = f.read(size - seen).decode(errors="replace")
            except OSError:
                continue
            self.stack_seen[b.rank] = size
            _say(f"rank {b.rank} (pid {b.pid}, step {b.step}): Python stack on SIGQUIT")
            sys.stderr.write(text if text.endswith("\n") else text + "\n")
            sys.stderr.flush()

    def end_hung(self, verdict: Verdict, launcher: int) -> None:
        """HUNG, the report and the stacks, then SIGKILL to the launcher and every
        process below it; returns once they are gone (at most `KILL_WAIT_S`)."""
        states = read_states(verdict.ranks)
        lines = report_lines(verdict, self.rule, self.node, time.time(), states)
        # A restart inside the allocation keeps the attempt number: its own report.
        restart = f"-restart{self.restart}" if self.restart else ""
        report_name = f"hang-attempt{self.attempt}{restart}-node{self.node}.txt"
        report_path = Path(self.run_dir or ".") / "logs" / report_name
        # The marker first: another node whose ranks fail once these are killed must
        # find it and count the end as a hang too.
        marker = write_hung_marker(
            self.run_dir, verdict, self.rule, self.node, self.attempt,
            str(report_path) if self.run_dir else "", self.started, states, self.token,
        )  # fmt: skip
        for line in lines:
            _say(line)
        _say(f"node {self.node}: collecting every rank's Python stack (SIGQUIT)")
        stacks = collect_stacks(self.folder, verdict.ranks, states)
        text = ""
        for v in verdict.ranks:
            b = v.beat
            header = (
                f"---- rank {b.rank} (pid {b.pid}), last at step {b.step} ({b.phase}): "
                "Python stack, most recent call first ----"
            )
            text += f"\n{header}\n{stacks[b.rank]}"
        text = text if text.endswith("\n") else text + "\n"
        sys.stderr.write(text)  # the report's lines are in the log already (above)
        sys.stderr.flush()
        if self.run_dir:
            with contextlib.suppress(OSError):
                report_path.parent.mkdir(parents=True, exist_ok=True)
                report_path.write_text("\n".join(lines) + "\n" + text)
        # Seconds after the marker (the stacks took them): a node that declared in the
        # same instant has written by now.
        keep_hung_marker(self.run_dir, marker, self.started, self.token)
        procs = [proc(launcher), *descendants(launcher)]
        signal_all(procs, signal.SIGKILL)
        _wait_gone(procs, KILL_WAIT_S)
        keep_hung_marker(self.run_dir, marker, self.started, self.token)  # once more, the last
        where = f"; report in {report_path}" if self.run_dir else ""
        _say(f"node {self.node}: ended the launcher and {len(procs) - 1} process(es) below "
             f"it (hung: nothing saved, resume from the newest complete checkpoint)"
             f"{where}")  # fmt: skip


def _wait_gone(procs: Sequence[Proc], wait_s: float) -> None:
    """Until every process of `procs` exited (a zombie counts as gone), at most `wait_s`."""
    deadline = time.monotonic() + wait_s
    while any(alive(p.pid, p.ticks) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)


def heartbeat_folder() -> Path | None:
    """A fresh folder for this node's heartbeats (None, said in one line, when the
    temporary directory is not writable: train without hang detection rather than not
    at all)."""
    try:
        return Path(tempfile.mkdtemp(prefix="shardctl-heartbeat-"))
    except OSError as exc:
        _say(f"cannot make a heartbeat folder ({exc}); running without hang detection "
             "(set TMPDIR to a writable folder)")  # fmt: skip
        return None


class Watchdog:
    """The launcher's parent on a node: passes signals on, applies the hang rule
    (`HangWatch`), and exits with the launcher's code or 124."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.node = _env_int("SHARDCTL_NODE_RANK", 0)
        self.nnodes = _env_int("SHARDCTL_NNODES", 1)
        self.run_dir = os.environ.get(ENV_RUN_DIR) or None
        # A node agent above the launcher (Slurm's) judges from the markers.
        self.judged_above = bool(os.environ.get(ENV_NODE_SUPERVISOR))
        self.received: list[int] = []
        self.signalled = False  # a stop was asked for: a failure then is not a hang
        self.started = time.time()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        self.signalled = True

    def run(self) -> int:
        folder = heartbeat_folder()
        if folder is None:
            try:
                os.execvp(self.command[0], self.command)
            except OSError as err:
                _say(f"cannot start {self.command[0]!r}: {err}")
                return 127
        try:
            code = self._run(HangWatch(folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return code

    def _run(self, hang: HangWatch) -> int:
        handled = []
        for sig in (*TO_LAUNCHER, *TO_RANKS):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, self._on_signal)
                handled.append(sig)
        env = dict(os.environ)
        env[ENV_HEARTBEAT_DIR] = str(hang.folder)
        try:
            child = subprocess.Popen(self.command, env=env)
        except OSError as exc:
            _say(f"cannot start {self.command[0]!r}: {exc}")
            return 127
        _say(f"node {self.node}: watching the ranks of {launcher_name(self.command)} "
             f"(pid {child.pid}); {hang.describe()}")  # fmt: skip
        forwarded: set[tuple[int, int]] = set()
        while True:
            try:
                # Short waits: a signal is passed on within a quarter second.
                rc = child.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                pass
            while self.received:
                signum = self.received.pop(0)
                if signum in TO_LAUNCHER:
                    with contextlib.suppress(ProcessLookupError):
                        child.send_signal(signum)
                else:
                    forwarded |= forward_to_catchers(child.pid, signum, forwarded)
            if hang.look(child.pid):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=KILL_WAIT_S)
                _say(f"node {self.node}: exiting with {EXIT_HUNG}")
                return EXIT_HUNG
        for sig in handled:
            signal.signal(sig, signal.SIG_IGN)  # the children are gone: nothing to pass on
        code = rc if rc >= 0 else 128 - rc
        # Another node's HUNG turns this node's lost peers into its own 124, for a
        # launcher whose supervisor reads exit codes only. A node agent that reads the
        # markers itself (Slurm's) needs no such wait: it cost every crash of a Slurm
        # job 10 s.
        if code != 0 and self.nnodes > 1 and not self.signalled and not self.judged_above:
            other = (
                RunDir.of(self.run_dir).wait_for_marker(HUNG_FILE, self.started, OTHER_NODE_WAIT_S)
                if self.run_dir
                else None
            )
            if other is not None:
                _say(f"node {self.node}: the launcher exited with code {code} after node "
                     f"{other.get('node')} declared the job hung (ranks of this node lost "
                     f"their peers); exiting with {EXIT_HUNG}")  # fmt: skip
                return EXIT_HUNG
        return code


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["--"]:
        words = words[1:]
    if not words or words[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    return Watchdog(words).run()


def launcher_name(command: list[str]) -> str:
    """The launcher a command runs: torchrun, not the Python that runs it under
    `shardctl.orchestrator.launch_wrapper` (which records each rank's end)."""
    for i, word in enumerate(command[:-1]):
        if word == "-m" and command[i + 1].endswith("launch_wrapper") and i + 2 < len(command):
            return command[i + 2]
    return command[0]


if __name__ == "__main__":
    sys.exit(main())
