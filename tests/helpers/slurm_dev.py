"""The dev Slurm cluster's node count, as the tests that need more than its default
2 nodes set it (the `resize_cluster` fixture of tests/conftest.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

DEV_CLUSTER = Path(__file__).resolve().parents[2] / "scripts" / "slurm-dev-cluster"


def dev_cluster_up(*args: str) -> None:
    """`slurm-dev-cluster up ARGS`: does nothing when the cluster already has that
    count; another count restarts the Slurm daemons (10-15 s on 2 vCPUs)."""
    proc = subprocess.run(
        ["bash", str(DEV_CLUSTER), "up", *args], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


class DevClusterSize:
    """The node count this session brought the dev cluster to (None: not set yet)."""

    def __init__(self) -> None:
        self.nodes: int | None = None

    def resize(self, nodes: int, *, or_more: bool = False) -> None:
        """Bring the cluster to `nodes` nodes; with `or_more`, a cluster this session
        already made larger is kept as it is (a job of fewer nodes runs on it)."""
        if self.nodes is not None and (self.nodes == nodes or (or_more and self.nodes > nodes)):
            return
        dev_cluster_up("--nodes", str(nodes))
        self.nodes = nodes

    def back_to_default(self) -> None:
        """The cluster's default 2 nodes again (nothing to do when it has them)."""
        dev_cluster_up()
        self.nodes = None
