"""The accelerate configs and accelerate-side loaders the `shardctl convert` tests share."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from shardctl.orchestrator.convert import read_plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-llama.yaml"

BASE = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "machine_rank": 0,
    "main_training_function": "main",
    "num_machines": 1,
    "num_processes": 8,
    "rdzv_backend": "static",
    "same_network": True,
    "use_cpu": False,
}


def fsdp(fsdp_config: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {
        **BASE,
        "distributed_type": "FSDP",
        "mixed_precision": "bf16",
        **top,
        "fsdp_config": fsdp_config,
    }


def deepspeed(ds_config: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {**BASE, "distributed_type": "DEEPSPEED", **top, "deepspeed_config": ds_config}


FSDP_CONFIGS = {
    "v1-full-shard-everything": fsdp(
        {
            "fsdp_version": 1,
            "fsdp_sharding_strategy": "FULL_SHARD",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "fsdp_backward_prefetch": "BACKWARD_PRE",
            "fsdp_forward_prefetch": False,
            "fsdp_use_orig_params": True,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_sync_module_states": True,
            "fsdp_offload_params": False,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_activation_checkpointing": True,
        }
    ),
    "v1-shard-grad-op-full-state": fsdp(
        {
            "fsdp_version": 1,
            "fsdp_reshard_after_forward": "SHARD_GRAD_OP",
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
        },
        mixed_precision="fp16",
    ),
    "v1-no-shard-numeric": fsdp({"fsdp_sharding_strategy": 3}, mixed_precision="no"),
    "v1-full-shard-offload": fsdp(
        {
            "fsdp_version": 1,
            "fsdp_sharding_strategy": "1",
            "fsdp_offload_params": "true",
            "fsdp_state_dict_type": "FULL_STATE_DICT",
        }
    ),
    "v2-reshard-true-offload": fsdp(
        {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": True,
            "fsdp_offload_params": True,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    ),
    "v2-reshard-false": fsdp(
        {"version": 2, "reshard_after_forward": False, "state_dict_type": "FULL_STATE_DICT"}
    ),
    # As older `accelerate config` wrote it (the accelerate 0.x docs' example).
    "v1-old-accelerate-style": {
        "compute_environment": "LOCAL_MACHINE",
        "deepspeed_config": {},
        "distributed_type": "FSDP",
        "downcast_bf16": "no",
        "fsdp_config": {
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_backward_prefetch_policy": "BACKWARD_PRE",
            "fsdp_offload_params": False,
            "fsdp_sharding_strategy": 2,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_transformer_layer_cls_to_wrap": "GPT2Block",
        },
        "machine_rank": 0,
        "main_training_function": "main",
        "megatron_lm_config": {},
        "mixed_precision": "no",
        "num_machines": 1,
        "num_processes": 2,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    },
    # FSDP2's NO_SHARD: a mesh that only replicates (what shardctl render writes).
    "v2-no-shard-mesh": fsdp(
        {"fsdp_version": 2, "fsdp_reshard_after_forward": False},
        parallelism_config={
            "parallelism_config_dp_replicate_size": 8,
            "parallelism_config_dp_shard_size": 1,
        },
    ),
}

HYBRID = {
    "v1": fsdp(
        {"fsdp_version": 1, "fsdp_sharding_strategy": "HYBRID_SHARD"},
        num_machines=2,
        num_processes=16,
    ),
    "v2": fsdp(
        {"fsdp_version": 2, "fsdp_reshard_after_forward": True},
        num_machines=2,
        num_processes=16,
        parallelism_config={
            "parallelism_config_dp_replicate_size": 2,
            "parallelism_config_dp_shard_size": 8,
        },
    ),
}


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def launch_env(config_file: Path) -> dict[str, str]:
    """The env `accelerate launch --config_file F` gives the training processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        # What launch_command does before it calls deepspeed_launcher.
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        assert args.use_fsdp
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_"))}


def deepspeed_plugin_config(env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """accelerate's DeepSpeedPlugin built from that env: the dict handed to DeepSpeed."""
    from accelerate.utils import DeepSpeedPlugin

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    try:
        os.environ.update(env)
        os.chdir(cwd)
        plugin = DeepSpeedPlugin()
        return {**plugin.deepspeed_config, "zero3_init": plugin.zero3_init_flag}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)


def load_with_accelerate(path: Path) -> Any:
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(path))


def settings(data: dict[str, Any]) -> dict[str, Any]:
    """The mappable settings of a config, as the converter reads them."""
    return read_plan(data).mappable()
