"""Slurm's per-node task (`NodeTask`) run on this machine as a node's srun would run it,
for the tests that hand it a stand-in launcher (the SLURM_* variables in its env).

    python tests/helpers/node_task_run.py LAUNCH_SH RUN_DIR [MAX_RESTARTS]

Prints `RESULT <what the task returned>` or `ERROR <its message>` (a stop it raised).
"""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve()


def main(argv: list[str]) -> None:
    from shardctl.orchestrator.clusters.slurm import NodeTask

    launch, run_dir, *rest = argv
    restarts = {"max_restarts": int(rest[0])} if rest else {}
    task = NodeTask(command=["bash", launch], run_dir=run_dir, max_requeues=10, **restarts)
    try:
        print("RESULT", task(), flush=True)
    except RuntimeError as exc:
        print("ERROR", exc, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
