"""The node agent on this machine, from the command line (what the local cluster's
`schedule` starts, detached, in a session of its own):

    python -m shardctl.orchestrator.agent --run-dir DIR --launch DIR/launch.sh
        --out OUT --err ERR --nodes N --job local-<attempt> [--checkpoint-dir DIR]
        [--start-step STEP] [--max-restarts N]

Its attempt token is the environment's (`SHARDCTL_ATTEMPT_TOKEN`, claimed by
`schedule`). Exits with the launch scripts' exit code of the last round.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from ..outcome import _step_arg
from ..rundir import ENV_ATTEMPT_TOKEN
from .core import UNREAD, NodeAgent
from .local import EXIT_FILE, OUTCOME_FILE, LocalAdapter, nodes_command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shardctl.orchestrator.agent",
        description="Run every node of a local run under shardctl's node agent.",
    )
    p.add_argument("--run-dir", required=True)
    p.add_argument("--launch", required=True, help="the run's launch.sh")
    p.add_argument("--out", required=True, help="the launcher's stdout log (appended)")
    p.add_argument("--err", required=True, help="the launcher's stderr log (appended)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--job", required=True, help="the job the ledger records: local-<attempt>")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument(
        "--start-step", type=_step_arg, default=UNREAD,
        help="the newest complete checkpoint's step when this start's token was claimed",
    )  # fmt: skip
    p.add_argument("--max-restarts", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run_dir = args.run_dir
    adapter = LocalAdapter(
        run_dir, args.job, os.environ.get(ENV_ATTEMPT_TOKEN),
        exit_file=str(Path(run_dir) / EXIT_FILE),
        outcome_file=str(Path(run_dir) / OUTCOME_FILE), err_log=args.err,
    )  # fmt: skip
    agent = NodeAgent(
        adapter, nodes_command(args.launch, args.out, args.err, args.nodes), run_dir,
        checkpoint_dir=args.checkpoint_dir, max_restarts=args.max_restarts,
        # One agent for every node: no other node's marker to wait for.
        marker_wait_s=0.0, first_start_step=args.start_step,
        # The hang rule, in this process (each node's launch.sh runs no watchdog).
        watch_hangs=True,
    )  # fmt: skip
    # An INT reaches the launch scripts from the NODES wrapper; the agent lives on to
    # judge the round.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    agent.run()
    return adapter.last_rc


if __name__ == "__main__":
    sys.exit(main())
