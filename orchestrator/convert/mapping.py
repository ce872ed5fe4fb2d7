"""The vocabulary of accelerate configs and DeepSpeed JSON that `convert` reads and writes.

The tables of accelerate's own names live here, once: FSDP sharding strategies ⇄
ZeRO stages, the accepted values of each key, and the keys accelerate 1.15 accepts.
The job-spec side has its own vocabulary (lower-case strategy names) in
`spec.SHARDING_TO_ZERO`, and the spec → accelerate choices (mixed precision,
reshard_after_forward, the FSDP2 mesh) are `accelerate_config`'s; a job spec is
converted through those, never through a second copy here.
"""

from __future__ import annotations

# FSDP1's ShardingStrategy enum, in its order: older accelerate wrote the 1-based number.
FSDP_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
STRATEGY_TO_ZERO = {
    "FULL_SHARD": 3,
    "SHARD_GRAD_OP": 2,
    "NO_SHARD": 0,
    # Hybrid: sharded inside a node, replicated across nodes; DeepSpeed's twin of the
    # stage-3 flavour is ZeRO++ hpZ (zero_hpz_partition_size in a DeepSpeed JSON).
    "HYBRID_SHARD": 3,
    "HYBRID_SHARD_ZERO2": 2,
}
# ZeRO-1 (optimizer state only) has no FSDP mode; SHARD_GRAD_OP is the nearest.
ZERO_TO_STRATEGY = {3: "FULL_SHARD", 2: "SHARD_GRAD_OP", 1: "SHARD_GRAD_OP", 0: "NO_SHARD"}


def strategy_of_zero(stage: int, hpz_partition_size: int | None) -> str:
    """The FSDP strategy of a ZeRO stage; stage 3 with hpZ is HYBRID_SHARD."""
    if stage == 3 and (hpz_partition_size or 1) > 1:
        return "HYBRID_SHARD"
    return ZERO_TO_STRATEGY[stage]


STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
MIXED_PRECISION_VALUES = ("no", "fp16", "bf16", "fp8")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")

# Top-level keys of accelerate 1.15's ClusterConfig (commands/config/config_args.py).
ACCELERATE_TOP_KEYS = frozenset(
    {
        "compute_environment",
        "distributed_type",
        "mixed_precision",
        "use_cpu",
        "debug",
        "num_processes",
        "machine_rank",
        "num_machines",
        "gpu_ids",
        "main_process_ip",
        "main_process_port",
        "rdzv_backend",
        "same_network",
        "main_training_function",
        "enable_cpu_affinity",
        "fp8_config",
        "deepspeed_config",
        "fsdp_config",
        "parallelism_config",
        "megatron_lm_config",
        "mpirun_config",
        "downcast_bf16",
        "tpu_name",
        "tpu_zone",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "command_file",
        "commands",
        "tpu_vm",
        "tpu_env",
        "dynamo_config",
        "dynamo_backend",
        "fp16",
    }
)
# Keys `accelerate launch` accepts inside fsdp_config (its --fsdp_* arguments).
FSDP_KEYS = frozenset(
    {
        "fsdp_version",
        "fsdp_sharding_strategy",
        "fsdp_reshard_after_forward",
        "fsdp_offload_params",
        "fsdp_min_num_params",
        "fsdp_auto_wrap_policy",
        "fsdp_transformer_layer_cls_to_wrap",
        "fsdp_backward_prefetch",
        "fsdp_backward_prefetch_policy",
        "fsdp_state_dict_type",
        "fsdp_forward_prefetch",
        "fsdp_use_orig_params",
        "fsdp_cpu_ram_efficient_loading",
        "fsdp_sync_module_states",
        "fsdp_activation_checkpointing",
        "fsdp_activation_checkpointing_offload",
        "fsdp_ignored_modules",
    }
)
# Keys `accelerate launch` accepts inside deepspeed_config (its DeepSpeed arguments).
DEEPSPEED_KEYS = frozenset(
    {
        "deepspeed_config_file",
        "zero_stage",
        "offload_optimizer_device",
        "offload_param_device",
        "offload_optimizer_nvme_path",
        "offload_param_nvme_path",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "zero3_init_flag",
        "zero3_save_16bit_model",
        "deepspeed_moe_layer_cls_names",
        "deepspeed_multinode_launcher",
        "deepspeed_hostfile",
        "deepspeed_exclusion_filter",
        "deepspeed_inclusion_filter",
    }
)
# Inline deepspeed_config keys that accelerate refuses next to a deepspeed_config_file.
DS_KEYS_FILE_OWNS = (
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero3_save_16bit_model",
)
# DeepSpeed JSON keys the converter reads; every other one is reported as DeepSpeed-only.
DS_JSON_READ = {
    "zero_optimization.stage",
    "zero_optimization.offload_param.device",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.zero_hpz_partition_size",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16.enabled",
    "fp16.enabled",
}
