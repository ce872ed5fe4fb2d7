"""The accelerate config file of a job (`accelerate launch --config_file`).

Two flavours, chosen by `strategy.backend`:

- FSDP: `distributed_type: FSDP` with an `fsdp_config` for FSDP2 (fsdp_version 2).
  FSDP2 has no sharding-strategy enum; the choice is `reshard_after_forward`
  (full_shard → true, shard_grad_op → false) plus, for hybrid_shard and
  no_shard, a 2-D data-parallel mesh in `parallelism_config` (replicate ×
  shard).
- DeepSpeed: `distributed_type: DEEPSPEED` pointing at the rendered
  `ds_config.json`, which then owns ZeRO stage, offload, precision, batch sizes
  and clipping (accelerate refuses those keys beside a config file).

Per-node values (machine rank, master address and port) are not in the file: a
config file cannot hold shell variables, so the launch script passes them as
`accelerate launch` flags. The file holds what is the same on every node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .precision import AUTO, rendered_precision

if TYPE_CHECKING:  # only for annotations: `shardctl convert` reads the tables without pydantic
    from .spec import JobSpec

# `auto` wrapping of a tiny-Llama model: one FSDP unit per decoder block. For
# pretrained/factory models accelerate finds the blocks from `_no_split_modules`.
LLAMA_BLOCK = "LlamaDecoderLayer"

# strategy.precision → accelerate's mixed_precision. The one table of this mapping:
# `shardctl convert` reads job specs through it too.
MIXED_PRECISION = {
    "bf16-mixed": "bf16",
    "fp16-mixed": "fp16",
    # bf16-pure: the model itself is bf16, nothing is cast up or down.
    "bf16-pure": "no",
    "fp32": "no",
}

# strategy.sharding → FSDP2's fsdp_reshard_after_forward. full/hybrid free the
# gathered parameters after forward (gather again for backward); shard_grad_op and
# no_shard keep them until backward is done.
RESHARD_AFTER_FORWARD = {
    "full_shard": True,
    "hybrid_shard": True,
    "shard_grad_op": False,
    "no_shard": False,
}


def mixed_precision(spec: JobSpec) -> str:
    """accelerate's mixed_precision for `spec`; `auto` as rendered for its device."""
    return MIXED_PRECISION[rendered_precision(spec.strategy.precision, spec.resources.device)]


def header(spec: JobSpec) -> str:
    """The comment block above the rendered YAML (accelerate's loader skips it)."""
    lines = [
        f"accelerate config of job {spec.name}, rendered by shardctl.",
        "Per-node values (--machine_rank, --main_process_ip/port) come from launch.sh.",
    ]
    s, device = spec.strategy, spec.resources.device
    if s.precision == AUTO:
        # The file is written before any node is known; say what `auto` became here,
        # since the built-in loop decides again on the node (see precision.py).
        lines.append(
            f"strategy.precision auto rendered as {rendered_precision(s.precision, device)} "
            f"(resources.device {device}); shardctl's own loop resolves auto on the node."
        )
    return "".join(f"# {line}\n" for line in lines)


def accelerate_config_text(spec: JobSpec) -> str:
    """The accelerate config file: `header` then the YAML of `accelerate_config`."""
    import yaml

    return header(spec) + yaml.safe_dump(accelerate_config(spec), sort_keys=False)


def accelerate_config(spec: JobSpec) -> dict[str, Any]:
    """The accelerate config dict (what accelerate's `ClusterConfig` loads)."""
    r = spec.resources
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "DEEPSPEED" if spec.strategy.backend == "deepspeed" else "FSDP",
        "downcast_bf16": False,
        "enable_cpu_affinity": False,
        "gpu_ids": "all",
        # Overridden per node by --machine_rank; 0 keeps the file valid on its own.
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": r.nodes,
        "num_processes": spec.world_size,
        # Node ranks are given (Slurm's node id, the operator's node rank), so the
        # rendezvous need not assign them.
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": r.device == "cpu",
    }
    if spec.strategy.backend == "deepspeed":
        config["deepspeed_config"] = _deepspeed_section(spec)
    else:
        config["mixed_precision"] = mixed_precision(spec)
        config["fsdp_config"] = _fsdp_section(spec)
        mesh = _parallelism_section(spec)
        if mesh:
            config["parallelism_config"] = mesh
    return dict(sorted(config.items()))


def _fsdp_section(spec: JobSpec) -> dict[str, Any]:
    s = spec.strategy
    pretrained = _loads_pretrained(spec)
    fsdp: dict[str, Any] = {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": RESHARD_AFTER_FORWARD[s.sharding],
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_offload_params": s.offload == "params",
        "fsdp_activation_checkpointing": s.activation_checkpointing,
        # Only rank 0 reads pretrained weights; the others receive them by broadcast.
        "fsdp_cpu_ram_efficient_loading": pretrained,
    }
    if pretrained:
        fsdp["fsdp_sync_module_states"] = True  # required by cpu_ram_efficient_loading
    classes = _wrap_classes(spec)
    if classes:
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(classes)
    return dict(sorted(fsdp.items()))


def _wrap_classes(spec: JobSpec) -> list[str]:
    wrap = spec.strategy.wrap
    if isinstance(wrap, list):
        return list(wrap)
    if spec.train is not None and spec.train.model.llama is not None:
        return [LLAMA_BLOCK]
    # Otherwise accelerate takes the model's own `_no_split_modules` (transformers
    # models name their blocks there).
    return []


def _loads_pretrained(spec: JobSpec) -> bool:
    # A user's own script loads what it loads; the built-in loop says so in the spec.
    return spec.train is not None and spec.train.model.pretrained is not None


def _parallelism_section(spec: JobSpec) -> dict[str, int]:
    """FSDP2's spelling of hybrid_shard and no_shard: a replicate × shard mesh."""
    r, sharding = spec.resources, spec.strategy.sharding
    if sharding == "hybrid_shard":
        replicate, shard = r.nodes, r.procs_per_node
    elif sharding == "no_shard":
        replicate, shard = spec.world_size, 1
    else:
        return {}
    return dp_mesh(replicate, shard)


def dp_mesh(replicate: int, shard: int) -> dict[str, int]:
    """A replicate × shard data-parallel mesh as accelerate's parallelism_config keys."""
    return {
        "parallelism_config_dp_replicate_size": replicate,
        "parallelism_config_dp_shard_size": shard,
    }


def _deepspeed_section(spec: JobSpec) -> dict[str, Any]:
    from .launch import DS_CONFIG  # launch needs the spec model; keep this module light

    ds: dict[str, Any] = {
        # Relative to this file's folder; the launch script passes the absolute
        # path with --deepspeed_config_file, as accelerate resolves it from the cwd.
        "deepspeed_config_file": DS_CONFIG,
        # zero.Init while loading pretrained weights: DeepSpeed's twin of FSDP's
        # cpu_ram_efficient_loading.
        "zero3_init_flag": spec.strategy.zero_stage == 3 and _loads_pretrained(spec),
    }
    if spec.resources.nodes > 1:
        # Every node runs its own `accelerate launch` (torchrun underneath); no pdsh/ssh.
        ds["deepspeed_multinode_launcher"] = "standard"
    return dict(sorted(ds.items()))
