"""A stand-in trainer for launcher tests: `python -m rank_probe SPEC`.

Each rank joins the process group the launcher set up (gloo), all-reduces its
rank, and writes what it saw to $PROBE_OUT/rank-<RANK>.json — proving that the
launcher's real flags produced a working world of the expected size.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

SEEN = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "OMP_NUM_THREADS", "SHARDCTL_NODE_RANK", "SHARDCTL_NNODES",
    "SHARDCTL_NPROC_PER_NODE", "SHARDCTL_RENDER_DIR", "DS_ACCELERATOR", "PROBE_HOSTILE",
)  # fmt: skip


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    record = {
        "argv": sys.argv[1:],
        "env": {k: os.environ.get(k) for k in SEEN},
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum_of_ranks": value.item(),
    }
    out = Path(os.environ["PROBE_OUT"])
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    from shardctl.train.leave import leave

    leave(main())  # not the interpreter's teardown of gloo: see shardctl.train.leave
