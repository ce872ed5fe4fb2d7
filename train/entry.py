"""`python -m shardctl.train.entry script PATH [ARGS...]` or `... module NAME [ARGS...]`:
how every rank of an `entrypoint:` job runs the user's own code.

The launcher (torchrun, accelerate launch, deepspeed) starts this on every rank; it
runs the script or module as `__main__` with exactly the arguments the spec gave
(`sys.argv[0]` is the script, as if Python had started it), then turns its end into
the run contract's markers, because a launcher reports every failure as its own
exit 1:

- exit 0: rank 0 writes `<run dir>/DONE` unless the code (or shardctl's checkpoint
  library, which records the step) already wrote one during this attempt;
- exit 42 (`EXIT_PREEMPTED`): the code saved and stopped for a preemption. The first
  rank to exit 42 writes `<run dir>/PREEMPTED` unless the code (or shardctl's
  checkpoint library) already wrote one during this attempt (torchrun stops the
  other ranks once one ends: rank 0 may never get to write it);
- anything else: the first rank to fail writes `<run dir>/FAILED` with its code, so
  `status` says "FAILED, exit 3" rather than the launcher's 1. Code 78
  (`EXIT_DO_NOT_RETRY`, `shardctl.train.api.permanent_failure`) is a permanent error:
  the classifier stops the run instead of retrying it, on every cluster.

The markers carry the typed outcome (`kind`, `code`, `rank`, ...) that the one
classifier, `shardctl.orchestrator.outcome`, reads. DONE also records the command
(`script PATH ARGS...`), so that submitting the same command again after a success
says the run is complete (the local cluster's `schedule`).

Before the user's code, every rank:

- gets back the usual action of SIGUSR2, SIGTERM and SIGINT where it inherited them
  ignored (Slurm's node task starts the launcher with its warning signal ignored);
- catches SIGUSR2 while the code has no handler of its own and holds it for a
  bounded part of the grace period (`SHARDCTL_WARNING_HOLD_S`, 30 s unless the
  cluster sets it): a handler the script installs within it gets the signal then. A
  Trainer script's rank (transformers' Trainer imported, or `shardctl.train.hf`)
  holds it until shardctl's callback installs its handler at `on_train_begin`,
  which takes it: that rank saves at its first step. Past the hold, with no handler,
  the rank says that nothing was saved (a line on stderr; PREEMPTED with `"saved":
  false` and its rank, the first rank's only), then ends by the signal's default
  action. The job is a preemption: it is requeued and the script starts from what it
  saved itself;
- wraps transformers' `Trainer.train` once the script imports it
  (`shardctl.train.hf_auto`): an unmodified Trainer script resumes and saves on a
  preemption (`entrypoint.hf_trainer_auto: false` turns it off);
- on a DeepSpeed rank of `accelerate launch` on CPU, hands accelerate the gloo group
  it cannot find itself (`shardctl.train.accelerate_cpu`), so the script's
  `Accelerator()` runs DeepSpeed on every rank.

Then the rank leaves through `shardctl.train.leave`: Python's own shutdown for
Python code (threads joined, `atexit` hooks run), then `os._exit`, because tearing
down a process group the script left up aborted finished ranks.

Torch-free and import-light: it must not cost the user's script start-up time.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from pathlib import Path

from shardctl.orchestrator.outcome import (
    done_marker,
    failed_marker,
    preempted_marker,
    signal_name,
    unsaved_marker,
)
from shardctl.orchestrator.rundir import (
    DONE_FILE,
    ENV_RUN_DIR,
    EXIT_DO_NOT_RETRY,
    EXIT_OK,
    EXIT_PREEMPTED,
    FAILED_FILE,
    PREEMPTED_FILE,
    RunDir,
)

from .accelerate_cpu import install as deepspeed_on_cpu_under_accelerate
from .heartbeat import install_stack_dump
from .hf_auto import install as wrap_hf_trainer
from .leave import leave
from .libwarnings import show_library_warnings_once
from .preemption import WARNING_HOLD_ENV, UnhandledWarning, undo_inherited_ignores

USAGE = "usage: python -m shardctl.train.entry script PATH [ARGS...] | module NAME [ARGS...]"


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return EXIT_OK
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints and exits 1
    return 1


# The message of a shardctl error that ended the user's script, for its FAILED marker.
_failure_reason: str | None = None


def run(kind: str, target: str, args: list[str]) -> int:
    """Run the target as `__main__`; return its exit code (an exception is exit 1)."""
    global _failure_reason
    _failure_reason = None
    try:
        if kind == "script":
            sys.argv = [target, *args]
            # As `python script.py` does: the script's folder comes first on sys.path.
            sys.path.insert(0, str(Path(target).resolve().parent))
            runpy.run_path(target, run_name="__main__")
        else:
            missing = _missing_module(target)
            if missing is not None:
                # Every retry would find it missing too: said once, not retried.
                _failure_reason = f"-m {target}: {missing} here; the run is not retried"
                print(f"shardctl: {_failure_reason}", file=sys.stderr, flush=True)
                return EXIT_DO_NOT_RETRY
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException as exc:  # the user's code raised: show it as Python would
        traceback.print_exc()
        # shardctl's own errors (a save on a full disk) say why: FAILED records it.
        if any(c.__module__.startswith("shardctl.") for c in type(exc).__mro__[:-2]):
            _failure_reason = str(exc)[:2000]
        return 1
    return EXIT_OK


def _missing_module(target: str) -> str | None:
    """ "No module named ..." when `target` or a package above it cannot be found on
    this rank's sys.path, else None (an error inside the user's package is theirs, and
    shows when the module runs)."""
    from importlib.util import find_spec

    try:
        found = find_spec(target)
    except ModuleNotFoundError as exc:
        ours = exc.name is not None and (target + ".").startswith(exc.name + ".")
        return str(exc) if ours else None
    except Exception:
        return None
    return None if found is not None else f"No module named {target!r}"


def record(
    code: int, started: float, run_dir: str | None, rank: int, command: list[str] | None = None
) -> None:
    """The markers for a rank that ended with `code` (see the module docstring);
    `command`: the words after `shardctl.train.entry`, kept in DONE."""
    if not run_dir:
        return
    folder = RunDir.of(run_dir)
    if code == EXIT_OK and rank == 0 and command is not None:
        # The script's own DONE (shardctl's checkpoint library records the step) is
        # kept, with the command added.
        done = folder.fresh_marker(DONE_FILE, started) or done_marker(None)
        folder.write_marker(DONE_FILE, {**done, "command": command, "time": time.time()})
        return
    if code == EXIT_PREEMPTED:
        # The first rank to exit 42, not rank 0 alone: once one rank ends, torchrun
        # stops the others, and rank 0 may be stopped before it gets here. The marker
        # of this attempt (its token) already there is kept (the checkpoint library's
        # names the step); the script's own 42 names no signal.
        marker = {**preempted_marker(None, None, "exit 42"), "time": time.time()}
        folder.write_first_marker(PREEMPTED_FILE, marker, started)
        return
    if code == EXIT_OK:
        # This attempt's own (its token; rundir.belongs_to_attempt), not an earlier one's.
        if rank == 0 and folder.fresh_marker(DONE_FILE, started) is None:
            folder.write_marker(DONE_FILE, {**done_marker(None), "time": time.time()})
        return
    write_failed(folder, started, failed_marker(code, rank, _failure_reason or ""))


def write_failed(folder: RunDir, started: float, marker: dict[str, object]) -> bool:
    """Write FAILED unless a rank of this attempt (started at `started`) was first;
    True when this one wrote it."""
    return folder.write_first_marker(FAILED_FILE, dict(marker), started)


def prepare_signals(started: float, run_dir: str | None, rank: int) -> None:
    """No stop signal inherited ignored; SIGUSR2 without the code's own handler is said
    and recorded before it ends the rank (see the module docstring)."""
    undo_inherited_ignores()

    def nothing_saved(signum: int) -> None:
        print(
            f"[rank {rank}] {signal_name(signum)} arrived and the script has no handler "
            "for it: nothing was saved. This rank stops; the next attempt starts from "
            "the script's own last checkpoint, if it saved one (docs/guides/own-script.md)",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        if run_dir:
            marker = unsaved_marker(signum, rank)
            RunDir.of(run_dir).write_first_marker(PREEMPTED_FILE, marker, started)

    warning = None

    def held(signum: int, for_callback: bool) -> None:
        if for_callback:
            text = (
                "arrived before the Trainer began training: it is held for shardctl's "
                "callback, which saves at the first step"
            )
        else:
            text = (
                f"arrived before the script installed a handler for it: it is held up to "
                f"{warning.hold_s:g} s for one ({WARNING_HOLD_ENV}); a Trainer or "
                "shardctl Checkpointer started by then saves at its first step"
            )
        print(f"[rank {rank}] {signal_name(signum)} {text}", file=sys.stderr, flush=True)

    warning = UnhandledWarning(nothing_saved, held)
    warning.install()


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if len(words) < 2 or words[0] not in ("script", "module"):
        print(USAGE, file=sys.stderr)
        return 2
    started = time.time()
    # SIGQUIT prints every thread's stack (the watchdog asks for it on a hang).
    install_stack_dump()
    rank = int(os.environ.get("RANK", "0") or 0)
    # Before the user's code: its own filters, set later, come first.
    show_library_warnings_once(rank)
    run_dir = os.environ.get(ENV_RUN_DIR)
    prepare_signals(started, run_dir, rank)
    wrap_hf_trainer()
    deepspeed_on_cpu_under_accelerate()
    code = run(words[0], words[1], words[2:])
    sys.stdout.flush()
    sys.stderr.flush()
    record(code, started, run_dir, rank, words)
    return code


if __name__ == "__main__":
    leave(main())
