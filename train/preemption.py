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
for as long as the rank's code has no handler of its own: a rank that cannot save
says so, then ends as it would have without shardctl. A rank whose code will install
shardctl's handler later (a Hugging Face Trainer script: the callback comes at
`on_train_begin`; `expect_handler`) holds the signal instead, and that handler takes
it when installed: the run stops and saves at its first step.

This module imports nothing heavy. The exit codes are defined in
`shardctl.orchestrator.rundir` and re-exported here.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

# The codes live with the run-directory contract (torch-free, shared with every
# launcher and cluster backend); re-exported here for the loop and older callers.
from shardctl.orchestrator.rundir import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, EXIT_SPEC

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_SPEC",
    "HOLD_AT_STEP_ENV",
    "SIGNALS",
    "STOP_AFTER_STEP_ENV",
    "PreemptionFlag",
    "UnhandledWarning",
    "expect_handler",
    "undo_inherited_ignores",
]

SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
STOP_AFTER_STEP_ENV = "SHARDCTL_STOP_AFTER_STEP"
HOLD_AT_STEP_ENV = "SHARDCTL_HOLD_AT_STEP"
HOLD_WAIT_S = 300.0  # a test that never signals fails instead of hanging for ever
# What a rank may inherit ignored from its launcher, and the action Python gives each
# when it starts with it not ignored.
INHERITED = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
WARNING_SIGNAL = signal.SIGUSR2  # what every supervisor sends the ranks for a preemption


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


class UnhandledWarning:
    """shardctl's handler of SIGUSR2 while the rank's own code has none.

    A script that installs its own handler (shardctl's `api`, the HF callback, its
    own `signal.signal`) replaces this one, and puts it back when it uninstalls its
    own. When SIGUSR2 reaches this handler and a handler of shardctl's is expected
    (`expect_handler`), the signal is held for it and `held` is called with it (to say
    so). Otherwise nothing in the rank can save: `notice` is called with the signal
    (to say so: a line, a marker), then the signal's default action ends the rank as
    it would have without shardctl, and the job is requeued to resume from whatever
    the script saved before."""

    def __init__(
        self, notice: Callable[[int], None], held: Callable[[int], None] | None = None
    ) -> None:
        self.notice = notice
        self.held = held

    def install(self) -> None:
        signal.signal(WARNING_SIGNAL, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        global _held_signal
        if _expecting_handler:
            _held_signal = signum
            if self.held is not None:
                self.held(signum)
            return
        try:
            self.notice(signum)
        finally:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)


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
