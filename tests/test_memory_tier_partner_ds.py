"""The memory tier on two nodes with the layouts whose ranks read files written on the
other node: DeepSpeed (ZeRO 2: synchronous saves; rank 0 alone writes the model states
file) and FSDP's hybrid_shard (each shard replicated across the nodes, written once).
A wiped node is served by its partner's copy and gets every file it reads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.train_run import tiny_spec
from test_memory_tier_partner import _hold_then_kill, _loop, _restores, _run_nodes


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("strategy", "nproc"),
    [
        ({"backend": "deepspeed", "sharding": "shard_grad_op", "precision": "fp32"}, 1),
        ({"backend": "fsdp", "sharding": "hybrid_shard"}, 2),  # sharded over 2 ranks a node
    ],
    ids=["deepspeed", "hybrid_shard"],
)
def test_a_wiped_node_resumes_from_its_partners_copy(
    tmp_path: Path, strategy: dict, nproc: int
) -> None:
    tier = tmp_path / "tier"
    spec = tiny_spec(
        tmp_path, "ds", resources={"nodes": 2, "procs_per_node": nproc}, strategy=strategy,
        train={"steps": 6, "log_every": 1},
        checkpoint={"every_steps": 5, "memory_every_steps": 2, "memory_dir": str(tier)},
    )  # fmt: skip
    ready = [tier / "node-0" / "partner-of-node-1" / "step-00000004" / "manifest.json"]
    _hold_then_kill(spec, 5, tmp_path / "hold", ready, nproc)
    shutil.rmtree(tier / "node-1")
    out = _run_nodes(_loop(spec), nproc=nproc)
    assert "resumed at step 4 (from partner: node 1 served by node 0's partner copy" in out
    assert (_restores(tmp_path / "ds")[-1]["tier"]) == "partner"
