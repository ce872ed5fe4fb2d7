"""Preemption: a signal sets a flag; ranks agree at the step boundary; save; exit 42.

SIGUSR2 (what Slurm sends before the time limit with `slurm.signal: USR2`) and
SIGTERM (what Kubernetes, torchrun and `shardctl cancel` send) only set a flag — no
work happens inside the handler. After every optimizer step the loop all-reduces the
flag (in the same collective as the logged loss, so it costs nothing extra); if any
rank saw a signal, every rank saves the same step together and the process exits with
`EXIT_PREEMPTED`, distinct from success (0) and failure (anything else). torchrun
and `accelerate launch` turn any non-zero rank exit into their own exit 1, so rank 0
also writes `<run dir>/PREEMPTED` (`{"step", "reason"}`, see `shardctl.orchestrator.rundir`):
supervisors that only see the launcher's code read that marker.

Testing aid: `SHARDCTL_STOP_AFTER_STEP=K` makes the loop behave exactly as if a
preemption signal had arrived during step K (save step K, exit `EXIT_PREEMPTED`).
It exists so tests can stop a run at a known step; do not set it in real jobs.
`SHARDCTL_HOLD_AT_STEP=K:DIR` (testing aid too) holds every rank at step K's
agreement: it touches `DIR/held-<RANK>` and waits until a signal reached it, so a
test can send each rank its own signal within one step (`shardctl.train.stop`).

Which signal names a stop when ranks received different ones: `shardctl.train.stop`.

Before a rank's own code runs (`shardctl.train.entry`, the built-in loop's
`__main__`), `undo_inherited_ignores` gives SIGUSR2, SIGTERM and SIGINT back their
usual action where the rank inherited them ignored (Slurm's node task starts the
launcher with its warning signal ignored, so that the launcher survives it, and an
ignored signal stays ignored across `exec`), and `UnhandledWarning` catches SIGUSR2
for as long as the rank's code has no handler of its own. A rank whose code will
install shardctl's handler later (a Hugging Face Trainer script: the callback comes
at `on_train_begin`; `expect_handler`) holds the signal, and that handler takes it
when installed: the run stops and saves at its first step. Any other rank holds it
for a bounded part of the warning's grace period (`SHARDCTL_WARNING_HOLD_S`, 30 s
unless the cluster sets it), because a warning often lands while the script is
still importing or building its model: a handler installed within the hold (its own
`signal.signal`, shardctl's) gets the signal then; a script that imports the Trainer
within it is held for the callback as above. Past the hold a rank that cannot save
says so, then ends as it would have without shardctl.

This module imports nothing heavy. The exit codes are defined in
`shardctl.orchestrator.rundir` and re-exported here.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

# The codes live with the run-directory contract (torch-free, shared with every
# launcher and cluster backend); re-exported here for the loop and older callers.
from shardctl.orchestrator.rundir import (
    ENV_WARNING_HOLD,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_SPEC,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_SPEC",
    "HOLD_AT_STEP_ENV",
    "SIGNALS",
    "STOP_AFTER_STEP_ENV",
    "WARNING_HOLD_ENV",
    "PreemptionFlag",
    "UnhandledWarning",
    "expect_handler",
    "undo_inherited_ignores",
    "warning_hold_s",
]

SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
STOP_AFTER_STEP_ENV = "SHARDCTL_STOP_AFTER_STEP"
HOLD_AT_STEP_ENV = "SHARDCTL_HOLD_AT_STEP"
HOLD_WAIT_S = 300.0  # a test that never signals fails instead of hanging for ever
# What a rank may inherit ignored from its launcher, and the action Python gives each
# when it starts with it not ignored.
INHERITED = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
WARNING_SIGNAL = signal.SIGUSR2  # what every supervisor sends the ranks for a preemption
# How long a warning waits for a handler of the script's (see the module docstring):
# the cluster may set it from its grace period; without one, 30 s leaves most of
# Slurm's default 120 s for the save.
WARNING_HOLD_ENV = ENV_WARNING_HOLD
DEFAULT_WARNING_HOLD_S = 30.0
HOLD_POLL_S = 0.1  # how soon a handler installed during the hold gets the signal


def undo_inherited_ignores(signals: tuple[signal.Signals, ...] = INHERITED) -> list[str]:
    """Give each of `signals` that this process inherited ignored its usual action
    (SIGINT: Python's KeyboardInterrupt; the others: the default, which ends the
    process); the names of those changed. An ignored preemption signal would make a
    rank without a handler carry on unaware until the cluster kills it."""
    changed = []
    for sig in signals:
        if signal.getsignal(sig) is signal.SIG_IGN:
            usual = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, usual)
            changed.append(sig.name)
    return changed


# A warning that arrived while a handler of shardctl's was known to be on its way (see
# `expect_handler`); the first `PreemptionFlag` installed in this process takes it.
_expecting_handler = False
_held_signal: int | None = None


def expect_handler() -> None:
    """Say that this rank's code will install a `PreemptionFlag` (the Trainer callback
    at `on_train_begin`): until it does, `UnhandledWarning` holds SIGUSR2 for it
    instead of ending the rank, so a warning that lands while the model and data are
    still being built is saved at the first step rather than losing the attempt."""
    global _expecting_handler
    _expecting_handler = True


def _take_held_signal() -> int | None:
    """The warning held for the first handler, once (the expectation is met then: a
    warning between two trainings has nobody coming for it)."""
    global _expecting_handler, _held_signal
    held, _held_signal, _expecting_handler = _held_signal, None, False
    return held


def warning_hold_s(environ: dict[str, str] | None = None) -> float:
    """How long a warning waits for the script's handler: `SHARDCTL_WARNING_HOLD_S`
    (seconds, 0 to end the rank at once), else `DEFAULT_WARNING_HOLD_S`. A value that
    is not a number, negative or not finite falls back to the default: a rank cannot
    stop to complain while a warning is on its way."""
    raw = (os.environ if environ is None else environ).get(WARNING_HOLD_ENV, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_WARNING_HOLD_S
    return value if 0 <= value < float("inf") else DEFAULT_WARNING_HOLD_S


class UnhandledWarning:
    """shardctl's handler of SIGUSR2 while the rank's own code has none.

    A script that installs its own handler (shardctl's `api`, the HF callback, its
    own `signal.signal`) replaces this one, and puts it back when it uninstalls its
    own. When SIGUSR2 reaches this handler it is held (`held` is called with it and
    whether a handler of shardctl's is expected, to say so):

    - a handler of shardctl's is expected (`expect_handler`): until it is installed,
      and it takes the signal;
    - else for `hold_s`: a watcher thread hands the signal to a handler the script
      installs within it (re-sent to the main thread, where Python runs handlers), or
      keeps holding it if the script comes to expect shardctl's. Past `hold_s` nothing
      in the rank can save: `notice` is called with the signal (to say so: a line, a
      marker), then the signal's default action ends the rank as it would have
      without shardctl, and the job is requeued to resume from whatever the script
      saved before."""

    def __init__(
        self,
        notice: Callable[[int], None],
        held: Callable[[int, bool], None] | None = None,
        hold_s: float | None = None,
    ) -> None:
        self.notice = notice
        self.held = held
        self.hold_s = warning_hold_s() if hold_s is None else hold_s
        self._expired = False
        self._watching = False

    def install(self) -> None:
        signal.signal(WARNING_SIGNAL, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        global _held_signal
        if _expecting_handler:
            _held_signal = signum
            if self.held is not None:
                self.held(signum, True)
            return
        if not self._expired and self.hold_s > 0:
            if not self._watching:  # a second warning during the hold changes nothing
                _held_signal = signum
                self._watching = True
                if self.held is not None:
                    self.held(signum, False)
                threading.Thread(
                    target=self._watch, args=(signum,), name="shardctl-warning-hold",
                    daemon=True,
                ).start()  # fmt: skip
            return
        try:
            self.notice(signum)
        finally:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def _watch(self, signum: int) -> None:
        """The hold's watcher (a thread; only the main thread may set handlers, so it
        hands the signal back there with `pthread_kill`)."""
        global _held_signal
        deadline = time.monotonic() + self.hold_s
        while True:
            if _held_signal is None or _expecting_handler:
                return  # shardctl's handler took it, or is on its way and will
            if signal.getsignal(signum) != self._handle:
                break  # the script's own handler (or action) is in place: it gets it
            if time.monotonic() >= deadline:
                self._expired = True  # this handler ends the rank when it comes back
                break
            time.sleep(HOLD_POLL_S)
        _held_signal = None
        self._watching = False
        signal.pthread_kill(threading.main_thread().ident, signum)


class PreemptionFlag:
    """Set by SIGUSR2/SIGTERM (or the test env var); read at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None
        raw = os.environ.get(STOP_AFTER_STEP_ENV, "").strip()
        self.stop_after_step = int(raw) if raw else None
        hold = os.environ.get(HOLD_AT_STEP_ENV, "").strip()
        step, _, folder = hold.partition(":")
        self._hold = (int(step), Path(folder)) if hold else None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        held = _take_held_signal()
        if held is not None and self.signum is None:
            self.signum = held  # it arrived before this handler: stop at the first step

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def local(self, step: int) -> bool:
        """Whether this rank wants to stop after `step` (before agreement)."""
        if self._hold is not None and self._hold[0] == step:
            self._wait_for_signal(self._hold[1])
        if self.signum is not None:
            return True
        return self.stop_after_step is not None and step >= self.stop_after_step

    def _wait_for_signal(self, folder: Path) -> None:
        """The hold testing aid: say this rank is at the agreement, wait for a signal
        (its handler runs during the sleep)."""
        (folder / f"held-{os.environ.get('RANK', '0')}").touch()
        deadline = time.monotonic() + HOLD_WAIT_S
        while self.signum is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def reason(self, signum: int | None) -> str:
        """Why the ranks stopped; `signum` is the signal any rank received (agreed)."""
        if signum is not None:
            try:
                return f"signal {signal.Signals(signum).name}"
            except ValueError:
                return f"signal {signum}"
        if self.stop_after_step is None:  # a signal that arrived during the agreement
            return "a preemption signal"
        return f"{STOP_AFTER_STEP_ENV}={self.stop_after_step} (testing aid)"
