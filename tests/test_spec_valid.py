"""Valid job specs: derived settings (sharding ⇄ zero_stage, defaults) come out right."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from click.testing import CliRunner
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
BASE: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-llama.yaml").read_text())


def with_strategy(nodes: int = 1, **strategy: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["strategy"] = strategy
    data["resources"]["nodes"] = nodes
    return data


@pytest.mark.parametrize(
    ("sharding", "nodes", "stage"),
    [("full_shard", 1, 3), ("shard_grad_op", 1, 2), ("no_shard", 1, 0), ("hybrid_shard", 2, 3)],
)
def test_zero_stage_derived_from_sharding(sharding: str, nodes: int, stage: int):
    for backend in ("fsdp", "deepspeed"):
        s = parse_spec(with_strategy(nodes, backend=backend, sharding=sharding)).strategy
        assert (s.sharding, s.zero_stage) == (sharding, stage)


@pytest.mark.parametrize(
    ("stage", "sharding"), [(3, "full_shard"), (2, "shard_grad_op"), (0, "no_shard")]
)
def test_sharding_derived_from_zero_stage(stage: int, sharding: str):
    for backend in ("fsdp", "deepspeed"):
        s = parse_spec(with_strategy(backend=backend, zero_stage=stage)).strategy
        assert (s.sharding, s.zero_stage) == (sharding, stage)


def test_zero_stage_1_is_deepspeed_only_and_has_no_sharding_name():
    s = parse_spec(with_strategy(backend="deepspeed", zero_stage=1)).strategy
    assert (s.sharding, s.zero_stage) == (None, 1)


def test_neither_given_means_full_shard_zero_3():
    s = parse_spec(with_strategy()).strategy
    assert (s.backend, s.sharding, s.zero_stage) == ("fsdp", "full_shard", 3)


def test_both_given_and_agreeing_is_accepted():
    s = parse_spec(with_strategy(sharding="shard_grad_op", zero_stage=2)).strategy
    assert (s.sharding, s.zero_stage) == ("shard_grad_op", 2)


@pytest.mark.parametrize(
    ("strategy", "derived", "offloaded"),
    [
        # given → (sharding, zero_stage) derived; what the launcher's config offloads
        ({"backend": "fsdp", "sharding": "full_shard", "offload": "params"},
         ("full_shard", 3), {"fsdp_offload_params": True}),
        ({"backend": "deepspeed", "zero_stage": 3, "offload": "params"},
         ("full_shard", 3), {"offload_optimizer": "cpu", "offload_param": "cpu"}),
        ({"backend": "deepspeed", "zero_stage": 2, "offload": "optimizer"},
         ("shard_grad_op", 2), {"offload_optimizer": "cpu"}),
        ({"backend": "deepspeed", "zero_stage": 1, "offload": "optimizer"},
         (None, 1), {"offload_optimizer": "cpu"}),
    ],
)  # fmt: skip
def test_offload_pairs_that_work_on_cuda(
    strategy: dict[str, Any], derived: tuple[str | None, int], offloaded: dict[str, Any]
):
    """Accepted on cuda (refused on cpu: tests/test_spec_invalid.py), kept as given, and
    the rendered launcher config offloads exactly what was asked."""
    from shardctl.orchestrator.accelerate_config import accelerate_config
    from shardctl.orchestrator.dsconfig import deepspeed_config

    cuda = copy.deepcopy(BASE)
    cuda["resources"]["device"] = "cuda"
    spec = parse_spec({**cuda, "strategy": strategy})
    s = spec.strategy
    assert (s.backend, s.offload, (s.sharding, s.zero_stage)) == (
        strategy["backend"], strategy["offload"], derived,
    )  # fmt: skip
    if s.backend == "fsdp":
        fsdp = accelerate_config(spec)["fsdp_config"]
        assert {k: fsdp[k] for k in offloaded} == offloaded
    else:
        zero = deepspeed_config(spec)["zero_optimization"]
        found = {k: zero[k]["device"] for k in ("offload_optimizer", "offload_param") if k in zero}
        assert found == offloaded


def test_defaults_derived_once():
    spec = parse_spec(BASE)
    assert spec.checkpoint_dir == "runs/tiny-llama/checkpoints"
    assert spec.run_dir == "runs/tiny-llama"
    assert spec.world_size == 2
    with pytest.raises(pydantic.ValidationError):
        spec.name = "other"  # type: ignore[misc]  # frozen


def test_env_values_become_strings_and_async_alias():
    data = copy.deepcopy(BASE)
    data["env"] = {"NCCL_DEBUG": "INFO", "MY_FLAG": True, "THREADS": 4, "RATIO": 0.5}
    data["checkpoint"]["async"] = True
    spec = parse_spec(data)
    assert spec.env == {"NCCL_DEBUG": "INFO", "MY_FLAG": "1", "THREADS": "4", "RATIO": "0.5"}
    assert spec.checkpoint.async_save is True
    assert spec.to_yaml_dict()["checkpoint"]["async"] is True


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_is_valid_and_round_trips(path: Path):
    spec = load_spec(path)
    again = parse_spec(yaml.safe_load(yaml.safe_dump(spec.to_yaml_dict(), sort_keys=False)))
    assert again == spec


def test_validate_json_shows_derived_fields(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(with_strategy(backend="deepspeed", zero_stage=2)))
    result = CliRunner().invoke(cli, ["validate", str(path), "--output", "json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["strategy"]["sharding"] == "shard_grad_op"
    assert doc["strategy"]["zero_stage"] == 2
    assert doc["checkpoint"]["dir"] == str(tmp_path / "runs" / "tiny-llama" / "checkpoints")
