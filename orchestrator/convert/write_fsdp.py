"""Writing a `Plan` as an FSDP accelerate config, in FSDP2 (default) or FSDP1 key style.

FSDP2 has no sharding-strategy enum: it says the strategy with reshard_after_forward
and, for NO_SHARD/HYBRID_SHARD, a replicate × shard mesh. Both spellings are
`accelerate_config`'s, the same that `shardctl render` writes.
"""

from __future__ import annotations

from typing import Any

from ..accelerate_config import RESHARD_AFTER_FORWARD, dp_mesh
from ..errors import UsageError
from .plan import Plan


def to_fsdp(plan: Plan, version: int | None, source: str | None = None) -> dict[str, Any]:
    """The FSDP accelerate config of `plan` in key style `version` (None: the best fit)."""
    sharding = plan.sharding
    if plan.zero_stage == 1:
        plan.note(
            "changed",
            "zero_stage",
            "1 (optimizer-state sharding only) has no FSDP "
            "mode; SHARD_GRAD_OP is the nearest (it also shards gradients)",
        )
    # FSDP2 has no strategy enum: NO_SHARD/HYBRID_SHARD are a replicate × shard mesh
    # in parallelism_config, which needs the process counts.
    mesh = _fsdp2_mesh(plan) if sharding not in ("FULL_SHARD", "SHARD_GRAD_OP") else None
    if version is None:
        version = plan.fsdp_version or 2
        if version == 2 and sharding not in ("FULL_SHARD", "SHARD_GRAD_OP") and mesh is None:
            version = 1
            plan.note(
                "changed",
                "fsdp_version",
                f"1: {sharding} in FSDP2 needs num_processes (and num_machines) to build the "
                "replicate × shard mesh; without them only the FSDP1 key style can say it",
            )
    if version == 2 and sharding not in ("FULL_SHARD", "SHARD_GRAD_OP") and mesh is None:
        # The input is fine; the key style asked for cannot say it: a usage error.
        where = f"{source}: " if source else ""
        raise UsageError(
            f"{where}--fsdp-version 2 expresses sharding {sharding} as a parallelism_config "
            "mesh, which needs num_processes (and num_machines > 1 for HYBRID_SHARD) in the "
            "config; accepted: add them, or --fsdp-version 1"
        )

    cfg: dict[str, Any] = {"fsdp_version": version}
    if version == 1:
        # accelerate 1.15 reads fsdp_sharding_strategy for FSDP1 and documents
        # fsdp_reshard_after_forward as its successor: write both, equal.
        cfg["fsdp_sharding_strategy"] = sharding
        cfg["fsdp_reshard_after_forward"] = sharding
        mesh = None
    else:
        cfg["fsdp_reshard_after_forward"] = RESHARD_AFTER_FORWARD.get(sharding.lower(), False)
    if sharding == "HYBRID_SHARD":
        plan.note(
            "changed",
            "zero_hpz_partition_size",
            f"{plan.hpz_partition_size} → "
            "HYBRID_SHARD: FSDP shards within each node (the node size comes from the "
            "launch, not from the config)",
        )

    off = plan.offload_param != "none" or plan.offload_optimizer != "none"
    if plan.offload_param != plan.offload_optimizer:
        plan.note(
            "changed",
            "offload",
            f"offload_param_device {plan.offload_param!r} and "
            f"offload_optimizer_device {plan.offload_optimizer!r}: FSDP offloads all or "
            f"nothing, so fsdp_offload_params is {str(off).lower()} (parameters, gradients "
            "and the optimizer step all move to CPU)",
        )
    if "nvme" in (plan.offload_param, plan.offload_optimizer):
        plan.note("changed", "offload", "FSDP cannot offload to NVMe; it offloads to CPU")
    if off and sharding == "NO_SHARD":
        plan.note(
            "changed",
            "offload",
            "FSDP offloads only sharded parameters; NO_SHARD keeps everything on the device",
        )
        off = False
    cfg["fsdp_offload_params"] = off
    plan.note(
        "mapped",
        "offload_param_device/offload_optimizer_device",
        f"{plan.offload_param}/{plan.offload_optimizer} → fsdp_offload_params {str(off).lower()}",
    )

    if plan.ram_efficient_loading is not None:
        cfg["fsdp_cpu_ram_efficient_loading"] = plan.ram_efficient_loading
        plan.note(
            "mapped",
            "zero3_init_flag",
            f"{str(plan.ram_efficient_loading).lower()} → fsdp_cpu_ram_efficient_loading",
        )
        if plan.ram_efficient_loading:
            if version == 1:
                cfg["fsdp_sync_module_states"] = True
                plan.note(
                    "changed",
                    "fsdp_sync_module_states",
                    "forced to true: with "
                    "cpu-RAM-efficient loading only rank 0 loads the weights and "
                    "sync_module_states broadcasts them to the other ranks",
                )
            else:
                plan.note(
                    "mapped",
                    "fsdp_sync_module_states",
                    "not written: FSDP2 broadcasts rank 0's weights itself",
                )
    extra = dict(plan.fsdp_extra)
    if version == 1 and "fsdp_sync_module_states" in extra:
        cfg.setdefault("fsdp_sync_module_states", extra["fsdp_sync_module_states"])
    if plan.full_state_dict is not None:
        plan.note(
            "mapped",
            "zero3_save_16bit_model",
            f"{str(plan.full_state_dict).lower()} → fsdp_state_dict_type "
            + ("FULL_STATE_DICT" if plan.full_state_dict else "SHARDED_STATE_DICT"),
        )
        cfg["fsdp_state_dict_type"] = (
            "FULL_STATE_DICT" if plan.full_state_dict else "SHARDED_STATE_DICT"
        )
    if "fsdp_auto_wrap_policy" not in extra:
        plan.note(
            "changed",
            "fsdp_auto_wrap_policy",
            "TRANSFORMER_BASED_WRAP (FSDP needs a "
            "wrap policy, DeepSpeed none); accelerate finds the block classes of "
            "transformers models, else set fsdp_transformer_layer_cls_to_wrap",
        )
    cfg["fsdp_auto_wrap_policy"] = extra.pop("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    v1_only = (
        "fsdp_backward_prefetch",
        "fsdp_forward_prefetch",
        "fsdp_use_orig_params",
        "fsdp_sync_module_states",
    )
    for key, value in extra.items():
        if version == 2 and key in v1_only:
            plan.note("not-mapped", key, f"{value!r}: FSDP1-only setting, not written for FSDP2")
            continue
        if key == "fsdp_activation_checkpointing_offload" and version != 2:
            continue
        cfg.setdefault(key, value)

    if plan.grad_accum is not None or plan.grad_clip is not None:
        plan.note(
            "not-mapped",
            "gradient_accumulation_steps/gradient_clipping",
            f"{plan.grad_accum!r}/{plan.grad_clip!r}: an FSDP accelerate config has no "
            "such keys; pass Accelerator(gradient_accumulation_steps=...) and call "
            "accelerator.clip_grad_norm_(..., max_norm) in the training script",
        )
    config: dict[str, Any] = {**plan.top, "distributed_type": "FSDP", "fsdp_config": cfg}
    if mesh:
        config["parallelism_config"] = mesh
    config.setdefault("compute_environment", "LOCAL_MACHINE")
    if plan.mixed_precision is not None:
        config["mixed_precision"] = plan.mixed_precision
    return config


def _fsdp2_mesh(plan: Plan) -> dict[str, int] | None:
    """FSDP2's replicate × shard mesh for NO_SHARD / HYBRID_SHARD, if the counts are known."""
    procs, nodes = plan.top.get("num_processes"), plan.top.get("num_machines")
    if not isinstance(procs, int) or procs < 2:
        return None
    if plan.sharding == "NO_SHARD":
        replicate, shard = procs, 1
    else:
        shard = plan.hpz_partition_size or 0
        if not shard and isinstance(nodes, int) and nodes > 1 and procs % nodes == 0:
            shard = procs // nodes
        if shard < 2 or procs % shard or procs == shard:
            return None
        replicate = procs // shard
    return dp_mesh(replicate, shard)
