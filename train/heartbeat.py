"""A rank's heartbeat: one small file per rank that the node's watchdog reads.

The watchdog (`shardctl.train.watchdog`) runs the launcher as its child, makes a
folder on the node and exports it as `$SHARDCTL_HEARTBEAT_DIR`. Every rank keeps one
file there, `rank-<RANK>`, and overwrites it in place (one `pwrite` of a fixed-size
record, no fsync: the file never leaves the node's page cache) whenever it advances:

    <step> <phase> <pid> <unix time> <starting|running>

Phases: `start` (the process group is up), `restore`, `step` (a step finished),
`save` (a checkpoint is being written), `eval`, `finish` (the rank is done with steps;
the watchdog stops watching it). Outside shardctl (no variable) every call is a no-op.

The last word says whether the rank is still starting up, for the watchdog's
start-up allowance (`watchdog.startup_timeout_s`). Start-up ends when the rank
finished its first training step: at its second `step` heartbeat (the built-in loop,
`Checkpointer` and the Hugging Face callback each write one when training begins,
after the restore, and then one per finished step), or at its first `save`, `eval`
or `finish` heartbeat. The rank counts its own beats: the watchdog reads only the
latest record every few seconds and would miss the short ones.

`install_stack_dump` makes SIGQUIT print the Python stack of every thread of the
rank, from C inside the signal handler (faulthandler): it works while the main
thread is blocked in a collective, and needs no ptrace rights (py-spy would, and
cluster nodes rarely grant them). The stack goes to `rank-<RANK>.stack` beside the
heartbeat, where the watchdog collects it, or to stderr without a watchdog.

Torch-free and import-light: the user's script and the built-in loop both call it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shardctl.orchestrator.rundir import ENV_HEARTBEAT_DIR

PHASES = ("start", "restore", "step", "save", "eval", "finish")
# A heartbeat in one of these phases ends the rank's start-up (a step finished before
# it); so does a second `step` heartbeat (the first says training begins).
AFTER_STARTUP_PHASES = ("save", "eval", "finish")
STARTING, RUNNING = "starting", "running"
RECORD_BYTES = 96  # fixed: a rewrite in place never leaves the tail of a longer one
STACK_SIGNAL = signal.SIGQUIT  # the JVM's and Go's "dump your threads" signal
BEAT_PREFIX = "rank-"
STACK_SUFFIX = ".stack"


@dataclass(frozen=True)
class Beat:
    """One rank's latest heartbeat as the watchdog reads it."""

    rank: int
    step: int
    phase: str
    pid: int
    time: float
    starting: bool = False  # still in start-up (see the module docstring)


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


class _Writer:
    def __init__(self, folder: str, rank: int) -> None:
        self.rank = rank
        self.path = Path(folder) / f"{BEAT_PREFIX}{rank}"
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pid = os.getpid()

    def write(self, step: int, phase: str, starting: bool) -> None:
        state = STARTING if starting else RUNNING
        text = f"{step} {phase} {self.pid} {time.time():.3f} {state}"
        os.pwrite(self.fd, text.ljust(RECORD_BYTES - 1).encode() + b"\n", 0)


_writer: _Writer | None = None
_writer_ready = False
_last_step = -1
_training_began = False  # a first `step` heartbeat was written
_starting = True  # see the module docstring: until the first step finished
_stack_file: IO[str] | None = None


def _get_writer() -> _Writer | None:
    global _writer, _writer_ready
    if not _writer_ready:
        _writer_ready = True
        folder = os.environ.get(ENV_HEARTBEAT_DIR)
        if folder:
            try:
                _writer = _Writer(folder, _rank())
            except OSError as exc:  # the watchdog's folder vanished: no heartbeat
                print(f"[shardctl] heartbeat disabled: {exc}", file=sys.stderr, flush=True)
    return _writer


def beat(step: int | None = None, phase: str = "step") -> None:
    """Tell the watchdog this rank advanced: finished `step` (None: the last one
    given), or entered `phase` (one of PHASES). Costs one small write."""
    global _last_step, _training_began, _starting
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"heartbeat step {step!r}; accepted: an int (the last finished step)")
        _last_step = step
    writer = _get_writer()
    if writer is None:
        return
    if phase not in PHASES:
        raise ValueError(f"heartbeat phase {phase!r}; accepted: {', '.join(PHASES)}")
    if phase in AFTER_STARTUP_PHASES or (phase == "step" and _training_began):
        _starting = False
    _training_began = _training_began or phase == "step"
    # A full /tmp must not stop training; the watchdog then sees no beats.
    with contextlib.suppress(OSError):
        writer.write(_last_step, phase, _starting)


def install_stack_dump() -> None:
    """SIGQUIT → every thread's Python stack (see the module docstring). Idempotent."""
    global _stack_file
    if _stack_file is not None:
        return
    folder = os.environ.get(ENV_HEARTBEAT_DIR)
    target: IO[str] = sys.stderr
    if folder:
        with contextlib.suppress(OSError):
            # Append mode: the watchdog empties the file before it asks again.
            target = open(Path(folder) / f"{BEAT_PREFIX}{_rank()}{STACK_SUFFIX}", "a")  # noqa: SIM115
    _stack_file = target
    # No SIGQUIT (not POSIX) or no usable file: the watchdog reports "no stack".
    with contextlib.suppress(AttributeError, ValueError, RuntimeError, OSError):
        faulthandler.register(STACK_SIGNAL, file=target, all_threads=True, chain=False)


def read_beats(folder: str | Path) -> list[Beat]:
    """Every rank's latest heartbeat in `folder` (the watchdog's side)."""
    beats: list[Beat] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return beats
    for name in names:
        if not name.startswith(BEAT_PREFIX) or name.endswith(STACK_SUFFIX):
            continue
        try:
            words = (Path(folder) / name).read_text().split()
            rank = int(name[len(BEAT_PREFIX) :])
            # A record without the last word: start and restore count as start-up.
            starting = words[4] == STARTING if len(words) > 4 else words[1] in ("start", "restore")
            beat = Beat(rank, int(words[0]), words[1], int(words[2]), float(words[3]), starting)
            beats.append(beat)
        except (OSError, ValueError, IndexError):
            continue  # being created: read again at the next poll
    return sorted(beats, key=lambda b: b.rank)


def stack_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"{BEAT_PREFIX}{rank}{STACK_SUFFIX}"
