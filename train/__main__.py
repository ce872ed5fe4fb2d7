"""`python -m shardctl.train SPEC` — what every rank runs.

Launch commands (one line per node; `shardctl render` writes them for you):

    torchrun --nnodes 1 --nproc-per-node 2 -m shardctl.train job.yaml
    accelerate launch --config_file accelerate_config.yaml -m shardctl.train job.yaml
    deepspeed --num_gpus 2 --module shardctl.train job.yaml

Exit codes: 0 finished (or already complete), 42 preempted after saving a checkpoint
(`shardctl.train.preemption.EXIT_PREEMPTED`), 2 invalid spec, 78 a configuration error
every retry would repeat (`PermanentError`: not retried), 1 any other failure.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from shardctl.orchestrator.errors import PermanentError, ShardctlError


def _spec_arg(argv: list[str]) -> str:
    # The deepspeed launcher appends `--local_rank=N` to the script's arguments; the
    # rank comes from the LOCAL_RANK env var anyway, so it is accepted and ignored.
    words: list[str] = []
    skip_next = False
    for word in argv:
        if skip_next:
            skip_next = False
            continue
        if word in ("--local_rank", "--local-rank"):
            skip_next = True
            continue
        if word.startswith(("--local_rank=", "--local-rank=")):
            continue
        words.append(word)
    if len(words) != 1 or words[0] in ("-h", "--help"):
        print("usage: python -m shardctl.train SPEC.yaml", file=sys.stderr)
        sys.exit(2)
    return words[0]


def _record_failure(exc: ShardctlError, rank: str, started: float) -> None:
    """A FAILED marker whose reason is the error, so that `shardctl status` says why
    the run stopped (a full disk, a corrupt checkpoint), not only an exit code."""
    from shardctl.orchestrator.outcome import failed_marker
    from shardctl.orchestrator.rundir import ENV_RUN_DIR, RunDir

    from .entry import write_failed

    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir:
        return
    reason = str(exc)
    if len(reason) > 2000:
        reason = reason[:2000] + "…"
    rank_no = int(rank) if rank.isdigit() else 0
    write_failed(RunDir.of(run_dir), started, failed_marker(exc.exit_code, rank_no, reason))


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    path = _spec_arg(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO if rank == "0" else logging.WARNING,
        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    # SIGQUIT prints every thread's stack (the watchdog asks for it on a hang).
    from .heartbeat import install_stack_dump
    from .libwarnings import show_library_warnings_once
    from .preemption import undo_inherited_ignores

    install_stack_dump()
    # TERM and INT inherited ignored would make the rank deaf to its launcher's stop.
    # SIGUSR2 stays ignored until the loop installs its handler a few seconds on: the
    # node task sends the warning again once the ranks catch it, so one that lands
    # while the model is still being built is saved at the first step, not fatal (a
    # time-limit warning during start-up ended the first attempt with nothing saved).
    undo_inherited_ignores((signal.SIGTERM, signal.SIGINT))
    show_library_warnings_once(int(rank or 0))
    try:
        from shardctl.orchestrator.spec import read_job_yaml

        from .loop import run

        return run(read_job_yaml(path))
    except ShardctlError as exc:
        # A permanent error (exit 78) says so: the user knows no restart is coming.
        after = f" (not retried: exit {exc.exit_code})" if isinstance(exc, PermanentError) else ""
        print(f"[rank {rank}] error: {exc}{after}", file=sys.stderr, flush=True)
        _record_failure(exc, rank, started)
        return exc.exit_code


if __name__ == "__main__":
    from .leave import leave

    leave(main())
