"""Writing a `Plan` as a DeepSpeed accelerate config (inline keys, or pointing at a JSON).

Every setting whose meaning changes on the way (hybrid sharding, offload below
ZeRO-3, RAM-efficient loading below ZeRO-3) gets a "changed" note saying how.
"""

from __future__ import annotations

from typing import Any

from .plan import Plan


def to_deepspeed(plan: Plan, json_path: str | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The DeepSpeed accelerate config of `plan`, plus the DeepSpeed JSON with `json_path`."""
    stage = plan.zero_stage
    if plan.sharding == "HYBRID_SHARD":
        plan.note(
            "changed",
            "HYBRID_SHARD",
            "maps to ZeRO-3 with ZeRO++ hierarchical partitioning (hpZ: parameters sharded "
            "inside a node, replicated across nodes); accelerate's inline deepspeed_config "
            "cannot express hpZ"
            + (
                f", so the DeepSpeed JSON sets zero_hpz_partition_size {plan.hpz_partition_size}"
                if json_path and plan.hpz_partition_size
                else " — without a DeepSpeed JSON (--ds-json) with zero_hpz_partition_size = "
                "GPUs per node, ZeRO-3 shards across all nodes (more inter-node traffic); "
                "hpZ also keeps a secondary parameter copy per node, and ZeRO++'s other parts "
                "(qwZ, qgZ) are not enabled"
            ),
        )
    if plan.sharding == "HYBRID_SHARD_ZERO2":
        plan.note(
            "changed",
            "HYBRID_SHARD_ZERO2",
            "maps to ZeRO-2 across all ranks: DeepSpeed has no per-node replication for stage 2",
        )

    off_param, off_opt = plan.offload_param, plan.offload_optimizer
    fsdp_offload = plan.offload_param != "none" and plan.offload_optimizer != "none"
    if off_param != "none" and stage != 3:
        plan.note(
            "changed",
            "offload",
            f"DeepSpeed offloads parameters only at ZeRO-3 (here zero_stage {stage}); "
            + ("only the optimizer state goes to CPU" if stage else "nothing is offloaded"),
        )
        off_param = "none"
    if off_opt != "none" and stage == 0:
        off_opt = "none"
    plan.note(
        "mapped",
        "fsdp_offload_params",
        f"{str(fsdp_offload).lower()} → offload_param_device {off_param}, "
        f"offload_optimizer_device {off_opt}"
        + (" (FSDP's offload is all-or-nothing)" if fsdp_offload and stage == 3 else ""),
    )

    init = plan.ram_efficient_loading
    if init is not None:
        if init and stage != 3:
            plan.note(
                "changed",
                "fsdp_cpu_ram_efficient_loading",
                "true has a DeepSpeed twin "
                f"(zero3_init_flag) only at ZeRO-3; zero_stage {stage} loads the full "
                "model on every rank",
            )
            init = False
        else:
            plan.note("mapped", "fsdp_cpu_ram_efficient_loading", f"{init} → zero3_init_flag")

    ga = plan.grad_accum if plan.grad_accum is not None else "auto"
    clip = plan.grad_clip if plan.grad_clip is not None else "auto"
    if plan.grad_accum is None or plan.grad_clip is None:
        plan.note(
            "mapped",
            "gradient_accumulation_steps/gradient_clipping",
            "not in an FSDP accelerate config; set to 'auto' so DeepSpeed takes them "
            "from Accelerator(gradient_accumulation_steps=...) and clip_grad_norm_",
        )

    if plan.full_state_dict is not None:
        plan.note(
            "mapped",
            "fsdp_state_dict_type",
            f"{'FULL_STATE_DICT' if plan.full_state_dict else 'SHARDED_STATE_DICT'} → "
            f"zero3_save_16bit_model {str(plan.full_state_dict).lower()}"
            + (
                " (a 16-bit copy; FSDP's full state dict keeps the training dtype)"
                if plan.full_state_dict
                else ""
            )
            + (
                ""
                if stage == 3
                else f"; below ZeRO-3 (here {stage}) the saved model is whole anyway"
            ),
        )

    config: dict[str, Any] = {**plan.top, "distributed_type": "DEEPSPEED"}
    config.setdefault("compute_environment", "LOCAL_MACHINE")
    ds_json = None
    if json_path:
        zero: dict[str, Any] = {"stage": stage}
        if off_opt != "none":
            zero["offload_optimizer"] = {"device": off_opt}
        if off_param != "none":
            zero["offload_param"] = {"device": off_param}
        if plan.full_state_dict is not None:
            zero["stage3_gather_16bit_weights_on_model_save"] = plan.full_state_dict
        if plan.sharding == "HYBRID_SHARD" and plan.hpz_partition_size:
            zero["zero_hpz_partition_size"] = plan.hpz_partition_size
        ds_json = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": ga,
            "gradient_clipping": clip,
            "zero_optimization": zero,
        }
        mp = plan.mixed_precision
        if mp is not None:
            ds_json["bf16"] = {"enabled": mp in ("bf16", "fp8")}
            ds_json["fp16"] = {"enabled": mp == "fp16"}
        ds: dict[str, Any] = {"deepspeed_config_file": json_path}
        if init is not None:
            ds["zero3_init_flag"] = init
        # accelerate refuses mixed_precision next to a deepspeed_config_file: it is in the JSON.
        config.pop("mixed_precision", None)
    else:
        ds = {
            "zero_stage": stage,
            "offload_optimizer_device": off_opt,
            "offload_param_device": off_param,
            "gradient_accumulation_steps": ga,
            "gradient_clipping": clip,
        }
        if init is not None:
            ds["zero3_init_flag"] = init
        if plan.full_state_dict is not None:
            ds["zero3_save_16bit_model"] = plan.full_state_dict
        if plan.mixed_precision is not None:
            config["mixed_precision"] = plan.mixed_precision
    config["deepspeed_config"] = ds
    return config, ds_json
