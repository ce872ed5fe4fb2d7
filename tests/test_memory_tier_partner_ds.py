"""The memory tier on two nodes with DeepSpeed (ZeRO 2): a wiped node served by its
partner's copy (DeepSpeed saves synchronously, and its rank 0 alone writes the model
states file: the restore sends it to the other node)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.train_run import tiny_spec
from test_memory_tier_partner import _hold_then_kill, _loop, _restores, _run_nodes


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_deepspeed_on_two_nodes_a_wiped_node_resumes_from_its_partners_copy(
    tmp_path: Path,
) -> None:
    tier = tmp_path / "tier"
    spec = tiny_spec(
        tmp_path, "ds", resources={"nodes": 2, "procs_per_node": 1},
        strategy={"backend": "deepspeed", "sharding": "shard_grad_op", "precision": "fp32"},
        train={"steps": 6, "log_every": 1},
        checkpoint={"every_steps": 5, "memory_every_steps": 2, "memory_dir": str(tier)},
    )  # fmt: skip
    ready = [tier / "node-0" / "partner-of-node-1" / "step-00000004" / "manifest.json"]
    _hold_then_kill(spec, 5, tmp_path / "hold", ready)
    shutil.rmtree(tier / "node-1")
    out = _run_nodes(_loop(spec))
    assert "resumed at step 4 (from partner: node 1 served by node 0's partner copy" in out
    assert (_restores(tmp_path / "ds")[-1]["tier"]) == "partner"
