"""The Slurm node task from the command line: what `job.sbatch`'s srun runs on every node.

    python -m shardctl.orchestrator.clusters.slurm --run-dir DIR [--checkpoint-dir DIR]
        [--signal USR2] [--max-requeues N] [--max-restarts N] [--spare-nodes S]
        -- bash .../launch.sh

The same `NodeTask` that submitit runs for `shardctl submit` (see `node_task.py`), so a
job sbatch'ed by hand is fenced by attempt, restarts in place, requeues itself and
leaves a bad node behind as a submitted one does. Exit 0 when the node finished, was
cancelled or the job was requeued; 1 with the reason on stderr when the job stops
(`slurm.max_requeues`, a script's "do not retry", no progress, a crash).
"""

from __future__ import annotations

import argparse
import sys

from ...outcome import MAX_ATTEMPTS_WITHOUT_PROGRESS
from .node_task import NodeTask


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shardctl.orchestrator.clusters.slurm",
        description="Run this node's launcher as shardctl's Slurm node task.",
    )
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--signal", default="USR2", choices=["USR2", "USR1", "TERM", "INT"])
    parser.add_argument("--max-requeues", type=int, default=10)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--spare-nodes", type=int, default=0)
    parser.add_argument("--max-stalled", type=int, default=MAX_ATTEMPTS_WITHOUT_PROGRESS)
    parser.add_argument("command", nargs="+", help="the node's launch command, after --")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    task = NodeTask(
        command=args.command, run_dir=args.run_dir, signal_name=args.signal,
        max_requeues=args.max_requeues, checkpoint_dir=args.checkpoint_dir,
        max_stalled=args.max_stalled, max_restarts=args.max_restarts,
        spare_nodes=args.spare_nodes,
    )  # fmt: skip
    try:
        task()
    except RuntimeError as stop:  # the job stops here: said once, no traceback
        print(f"shardctl: {stop}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
