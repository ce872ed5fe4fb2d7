"""The rendered `accelerate launch` and `deepspeed` commands start the real loop on
CPU (torchrun is the launcher of every other training test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.local_run import follow_to_end
from helpers.render_util import LAUNCH_WRAPPER
from helpers.train_run import metrics, tiny_spec
from shardctl.orchestrator.clusters.base import JobState
from shardctl.orchestrator.clusters.local import LocalCluster
from shardctl.orchestrator.spec import load_spec

pytestmark = pytest.mark.slow

DS = {"backend": "deepspeed", "sharding": None, "zero_stage": 2}


@pytest.mark.parametrize(
    ("launcher", "strategy"),
    [
        ("accelerate", {"backend": "fsdp", "sharding": "full_shard"}),
        ("accelerate", DS),
        ("deepspeed", DS),
    ],
    ids=["accelerate-fsdp", "accelerate-deepspeed", "deepspeed-deepspeed"],
)
def test_launcher_runs_the_loop_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launcher: str, strategy: dict
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = load_spec(
        tiny_spec(
            tmp_path,
            "l",
            launcher=launcher,
            strategy=strategy,
            train={"steps": 2},
            checkpoint={"every_steps": 2},
        )
    )
    local = LocalCluster()
    plan = local.dryrun(spec)
    # accelerate runs in-process under the launch wrapper; deepspeed as it is.
    first_word = {"accelerate": LAUNCH_WRAPPER + "accelerate launch", "deepspeed": "deepspeed"}[
        launcher
    ]
    first_word = f'exec "$@" \\\n    {first_word}'  # "$@": the watchdog, by hand only
    assert first_word in plan.artifacts["launch.sh"]
    ref = local.schedule(plan)
    code = follow_to_end(local, ref)
    logs = local.logs(ref)
    assert code == 0, logs[-5000:]
    assert local.status(ref).state == JobState.SUCCEEDED
    assert f"{strategy['backend']} on 2 rank(s)" in logs
    assert [r["step"] for r in metrics(tmp_path / "l")] == [1, 2]
    manifest = json.loads(
        (tmp_path / "l" / "checkpoints" / "step-00000002" / "manifest.json").read_text()
    )
    assert (manifest["backend"], manifest["world_size"]) == (strategy["backend"], 2)
