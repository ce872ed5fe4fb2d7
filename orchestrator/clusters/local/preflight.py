"""`shardctl doctor --cluster local`: this machine's master address, port and checkpoint dir."""

from __future__ import annotations

from pathlib import Path

from ...doctor import Check, bucket_check, port_check, writable_check
from ...spec import JobSpec
from ...storage import is_object_url


def local_checks(spec: JobSpec) -> list[Check]:
    checks = []
    if spec.resources.nodes > 1:
        checks.append(
            Check(
                "master address",
                "warn",
                f"127.0.0.1: all {spec.resources.nodes} nodes must start on this machine "
                "(SHARDCTL_NODE_RANK preset per node); no other machine can reach it",
                "use --cluster slurm or k8s for nodes on different machines",
            )
        )
    else:
        checks.append(Check("master address", "ok", "127.0.0.1 (one node)"))
    checks.append(port_check(spec.local.master_port))
    if is_object_url(spec.checkpoint_dir):
        checks.append(bucket_check(spec.checkpoint_dir))
    else:
        checks.append(writable_check(Path(spec.checkpoint_dir)))
    return checks
