"""The configs we write load in their owners' own code.

accelerate: the rendered YAML through `load_config_from_file` (ClusterConfig), then
the rendered `accelerate launch` flags through accelerate's own argument parser
and launch validation, and the resulting environment through accelerate's
FSDP / DeepSpeed plugin classes, which check every value.
DeepSpeed: the rendered JSON through `deepspeed.runtime.config.DeepSpeedConfig`
with the job's world size (its batch-size arithmetic must hold).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.render_util import variant, write_files
from shardctl.orchestrator.accelerate_config import accelerate_config, accelerate_config_text
from shardctl.orchestrator.clusters import render_artifacts
from shardctl.orchestrator.dsconfig import deepspeed_config
from shardctl.orchestrator.launch import launch_argv
from shardctl.orchestrator.precision import rendered_precision
from shardctl.orchestrator.spec import JobSpec

CUDA2 = {"nodes": 2, "device": "cuda"}

ACCELERATE_CASES: dict[str, dict[str, Any]] = {
    "fsdp-full": {},
    "fsdp-shard-grad-op": {"strategy": {"sharding": "shard_grad_op"}},
    "fsdp-no-shard": {"strategy": {"sharding": "no_shard"}},
    "fsdp-hybrid": {"resources": {"nodes": 2}, "strategy": {"sharding": "hybrid_shard"}},
    "fsdp-offload-ckpt": {
        "resources": {"device": "cuda"},
        "strategy": {"offload": "params", "activation_checkpointing": True},
    },
    "fsdp-wrap-list-fp32": {"strategy": {"wrap": ["LlamaDecoderLayer"], "precision": "fp32"}},
    "fsdp-bf16-pure": {"strategy": {"precision": "bf16-pure"}},
    # `auto` is decided on the node; the file says what it renders as for the device.
    "fsdp-auto-cpu": {"strategy": {"precision": "auto"}},
    "fsdp-auto-cuda": {"resources": {"device": "cuda"}, "strategy": {"precision": "auto"}},
    "ds-auto-cuda": {
        "resources": {"device": "cuda"},
        "strategy": {"backend": "deepspeed", "precision": "auto"},
    },
    "fsdp-pretrained": {"train": {"model": {"llama": None, "pretrained": "models/tiny"}}},
    "ds-zero3": {"strategy": {"backend": "deepspeed", "sharding": None, "zero_stage": 3}},
    "ds-zero2-2nodes": {
        "resources": CUDA2,
        "strategy": {
            "backend": "deepspeed",
            "sharding": None,
            "zero_stage": 2,
            "offload": "optimizer",
        },
    },
    "ds-zero3-pretrained": {
        "strategy": {"backend": "deepspeed"},
        "train": {"model": {"llama": None, "pretrained": "models/tiny"}},
    },
}


def _accelerate_spec(patch: dict[str, Any]) -> JobSpec:
    return variant({"launcher": "accelerate", **patch})


def _node_words(spec: JobSpec, folder: Path, node_rank: int) -> list[str]:
    """The words after `accelerate launch`, as node `node_rank`'s shell expands them."""
    values = {
        "${SHARDCTL_RENDER_DIR}": str(folder),
        "${SHARDCTL_NODE_RANK}": str(node_rank),
        "${MASTER_ADDR}": "10.1.2.3",
        "${MASTER_PORT}": "29555",
    }
    words = []
    for word in launch_argv(spec, str(folder / "job.yaml"))[2:]:
        for ref, value in values.items():
            word = word.replace(ref, value)
        words.append(word)
    return words


@pytest.mark.parametrize("case", sorted(ACCELERATE_CASES))
def test_accelerate_config_loads_with_accelerates_loader(tmp_path: Path, case: str) -> None:
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    spec = _accelerate_spec(ACCELERATE_CASES[case])
    folder = write_files(render_artifacts(spec, "local"), tmp_path)
    loaded = load_config_from_file(str(folder / "accelerate_config.yaml"))
    assert isinstance(loaded, ClusterConfig)
    assert loaded.num_processes == spec.world_size
    assert loaded.num_machines == spec.resources.nodes
    assert loaded.use_cpu is (spec.resources.device == "cpu")
    assert loaded.distributed_type.value == (
        "DEEPSPEED" if spec.strategy.backend == "deepspeed" else "FSDP"
    )
    # What accelerate read is what we meant: the dict round-trips through its class.
    expected = accelerate_config(spec)
    for key in ("fsdp_config", "deepspeed_config", "parallelism_config"):
        assert (getattr(loaded, key) or {}) == expected.get(key, {}), key


@pytest.mark.parametrize("case", sorted(ACCELERATE_CASES))
def test_accelerate_launch_validates_the_rendered_flags(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """accelerate's own launch path (parser → validation → env → plugin) accepts the job."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    spec = _accelerate_spec(ACCELERATE_CASES[case])
    folder = write_files(render_artifacts(spec, "local"), tmp_path)
    node = spec.resources.nodes - 1
    args = launch_command_parser().parse_args(_node_words(spec, folder, node))
    args, defaults, _ = _validate_launch_command(args)
    assert (args.num_machines, args.num_processes) == (spec.resources.nodes, spec.world_size)
    assert int(args.machine_rank) == node and args.main_process_ip == "10.1.2.3"
    assert args.training_script == "shardctl.train" and args.module
    assert args.training_script_args == [str(folder / "job.yaml")]
    for name in [k for k in list(__import__("os").environ) if k.startswith(("FSDP_", "ACCEL"))]:
        monkeypatch.delenv(name)
    if spec.strategy.backend == "fsdp":
        assert args.use_fsdp and not args.use_deepspeed
        env = prepare_multi_gpu_env(args)
        for key, value in env.items():
            if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")):
                monkeypatch.setenv(key, value)
        plugin = FullyShardedDataParallelPlugin()
        s = spec.strategy
        assert plugin.fsdp_version == 2
        assert plugin.reshard_after_forward is (s.sharding in ("full_shard", "hybrid_shard"))
        assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
        assert plugin.activation_checkpointing is s.activation_checkpointing
        assert type(plugin.cpu_offload).__name__ == (
            "CPUOffloadPolicy" if s.offload == "params" else "OffloadPolicy"
        )
        if spec.train.model.llama is not None:
            assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
        assert plugin.cpu_ram_efficient_loading is (spec.train.model.pretrained is not None)
        if s.sharding in ("hybrid_shard", "no_shard"):
            # FSDP2's hybrid/no-shard: a replicate × shard mesh that must fill the world.
            from accelerate.parallelism_config import ParallelismConfig

            assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
            mesh = ParallelismConfig()
            assert mesh.total_size == spec.world_size
            assert mesh.dp_shard_size == (
                spec.resources.procs_per_node if s.sharding == "hybrid_shard" else 1
            )
    else:
        assert args.use_deepspeed and not args.use_fsdp
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
        for key, value in env.items():
            if key.startswith("ACCELERATE_"):
                monkeypatch.setenv(key, value)
        # Raises if the accelerate config also sets what the JSON owns (zero stage,
        # offload, precision, clipping ...).
        plugin = DeepSpeedPlugin()
        assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(folder / "ds_config.json")
        assert plugin.deepspeed_config["zero_optimization"]["stage"] == spec.strategy.zero_stage


# ------------------------------------------------------------------ DeepSpeed

DS_CASES: dict[str, dict[str, Any]] = {
    "zero0": {"strategy": {"zero_stage": 0}},
    "zero1": {"strategy": {"zero_stage": 1}},
    "zero2-accum-fp32": {
        "strategy": {"zero_stage": 2, "precision": "fp32"},
        "train": {"grad_accum": 4},
    },
    "zero3-ckpt-noclip": {
        "strategy": {"zero_stage": 3, "activation_checkpointing": True},
        "train": {"clip": 0},
    },
    "zero3-hybrid": {
        "resources": {"nodes": 2, "procs_per_node": 4, "device": "cuda"},
        "strategy": {"sharding": "hybrid_shard", "zero_stage": None},
    },
    "zero3-offload-params-fp16": {
        "resources": {"device": "cuda"},
        "strategy": {"zero_stage": 3, "offload": "params", "precision": "fp16-mixed"},
    },
    "zero2-offload-optimizer": {
        "resources": {"device": "cuda"},
        "strategy": {"zero_stage": 2, "offload": "optimizer"},
    },
    "zero3-auto-cpu": {"strategy": {"precision": "auto"}},
    "zero3-auto-cuda": {"resources": {"device": "cuda"}, "strategy": {"precision": "auto"}},
}


def _ds_spec(patch: dict[str, Any]) -> JobSpec:
    strategy = {"backend": "deepspeed", **patch.get("strategy", {})}
    return variant({**patch, "strategy": strategy}, example="deepspeed-zero3")


def _load_ds(config: dict[str, Any], world_size: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """DeepSpeedConfig as a rank of a `world_size` job sees it, without a process group.

    DeepSpeedConfig asks deepspeed.comm for the rank and the data-parallel world
    size (through `mpu`); outside a process group it would assume 1.
    """
    import deepspeed.runtime.config as ds_config

    class DataParallel:
        def get_data_parallel_world_size(self) -> int:
            return world_size

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    return ds_config.DeepSpeedConfig(config, mpu=DataParallel())


@pytest.mark.parametrize("case", sorted(DS_CASES))
def test_deepspeed_config_loads_in_deepspeeds_config_class(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _ds_spec(DS_CASES[case])
    s, t = spec.strategy, spec.train
    config = json.loads(render_artifacts(spec, "local")["ds_config.json"])
    # Exactly what the training loop passes to deepspeed.initialize.
    assert config == deepspeed_config(spec)
    ds = _load_ds(config, spec.world_size, monkeypatch)
    assert ds.world_size == spec.world_size
    assert ds.train_batch_size == t.micro_batch_size * t.grad_accum * spec.world_size
    assert ds.train_micro_batch_size_per_gpu == t.micro_batch_size
    assert ds.gradient_accumulation_steps == t.grad_accum
    assert ds.gradient_clipping == t.clip
    assert ds.zero_optimization_stage == s.zero_stage
    precision = rendered_precision(s.precision, spec.resources.device)
    assert ds.bfloat16_config.enabled is (precision == "bf16-mixed")
    assert ds.float16_config.enabled is (precision == "fp16-mixed")
    if precision == "fp16-mixed":
        assert ds.float16_config.loss_scale == 0  # dynamic
    zero = ds.zero_config
    assert zero.zero_hpz_partition_size == (
        spec.resources.procs_per_node if s.sharding == "hybrid_shard" else 1
    )
    assert (zero.offload_optimizer is not None) is (s.offload in ("optimizer", "params"))
    assert (zero.offload_param is not None) is (s.offload == "params")
    assert "optimizer" not in config and "scheduler" not in config
    assert ds.wall_clock_breakdown is False


def test_deepspeed_config_with_the_wrong_world_size_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch arithmetic is real: DeepSpeed itself rejects a mismatched world."""
    spec = _ds_spec({})
    with pytest.raises(AssertionError, match="train_batch_size"):
        _load_ds(deepspeed_config(spec), spec.world_size + 1, monkeypatch)


# ------------------------------------------------------------------ precision auto


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
@pytest.mark.parametrize(("device", "rendered"), [("cuda", "bf16-mixed"), ("cpu", "fp32")])
def test_auto_renders_loadable_configs_that_say_what_auto_became(
    tmp_path: Path, backend: str, device: str, rendered: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    patch: dict[str, Any] = {
        "resources": {"device": device},
        "strategy": {"backend": backend, "precision": "auto"},
    }
    spec = _accelerate_spec(patch)
    text = accelerate_config_text(spec)
    # The header (comments, which accelerate's loader skips) names the choice.
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert f"# strategy.precision auto rendered as {rendered} (resources.device {device});" in (
        "\n".join(comments)
    )
    (tmp_path / "accelerate_config.yaml").write_text(text)
    loaded = load_config_from_file(str(tmp_path / "accelerate_config.yaml"))
    ds_json = deepspeed_config(spec)
    if backend == "fsdp":
        assert str(loaded.mixed_precision) == ("bf16" if rendered == "bf16-mixed" else "no")
    else:
        # DeepSpeed's precision lives in its JSON, which DeepSpeed's own class reads.
        ds = _load_ds(ds_json, spec.world_size, monkeypatch)
        assert ds.bfloat16_config.enabled is (rendered == "bf16-mixed")
        assert ds.float16_config.enabled is False
    assert ("bf16" in ds_json) is (rendered == "bf16-mixed")


@pytest.mark.parametrize("case", sorted(ACCELERATE_CASES))
def test_the_header_names_auto_only_for_auto(case: str) -> None:
    from shardctl.orchestrator.render import accelerate_config_yaml

    spec = _accelerate_spec(ACCELERATE_CASES[case])
    text = accelerate_config_text(spec)
    assert ("auto rendered as" in text) is (spec.strategy.precision == "auto")
    if spec.strategy.precision != "auto":
        # Render writes the same bytes (the golden files hold them).
        assert accelerate_config_yaml(spec) == text
