"""The DeepSpeed JSON config of a job: one pure function of the `JobSpec`.

The same dict is rendered to `ds_config.json` and handed to `deepspeed.initialize`
by the training loop, so what a user reads on disk is exactly what ran.

Deliberately absent: `optimizer` and `scheduler` sections. The loop passes a torch
AdamW and its own LR schedule (DeepSpeed's fused/CPU optimizers need op builds
that cost 30-60 s each on a fresh machine), so the config must not declare a
second one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .precision import rendered_precision

if TYPE_CHECKING:  # only for annotations: `shardctl convert` imports this without pydantic
    from .spec import JobSpec

# DeepSpeed's periodic console report duplicates the loop's own metrics; push it
# out of reach instead of spamming every `steps_per_print` steps.
STEPS_PER_PRINT = 1_000_000_000

# fp16 dynamic loss scaling: loss_scale 0 means "dynamic"; start at 2**16, halve on
# overflow (after `hysteresis` overflows), double after `loss_scale_window` good steps.
FP16_DYNAMIC_LOSS_SCALE: dict[str, Any] = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


def deepspeed_config(spec: JobSpec) -> dict[str, Any]:
    """The DeepSpeed config dict for `spec` (valid for any backend, used for deepspeed)."""
    s, t = spec.strategy, spec.train
    config: dict[str, Any] = {}
    if t is not None:
        config.update(
            {
                "train_batch_size": t.micro_batch_size * t.grad_accum * spec.world_size,
                "train_micro_batch_size_per_gpu": t.micro_batch_size,
                "gradient_accumulation_steps": t.grad_accum,
                # 0.0 disables clipping in DeepSpeed, exactly as train.clip 0 does.
                "gradient_clipping": float(t.clip),
            }
        )
    else:
        # Your own script decides batch size, accumulation and clipping: "auto" is
        # what accelerate and the HF Trainer fill in from their own arguments. A plain
        # deepspeed.initialize script replaces them (or passes its own values).
        config.update(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
            }
        )
    config.update(
        {
            "zero_optimization": _zero_section(spec),
            "steps_per_print": STEPS_PER_PRINT,
            "wall_clock_breakdown": False,
        }
    )
    if s.offload != "none":
        # With offload DeepSpeed insists on its own CPU Adam (a compiled op) unless
        # told that the client optimizer is intended.
        config["zero_force_ds_cpu_optimizer"] = False
    # `auto` is decided on the node; the file says what it means for this device
    # (the built-in loop rebuilds this dict from the resolved value, see precision.py).
    precision = rendered_precision(s.precision, spec.resources.device)
    if precision == "bf16-mixed":
        # DeepSpeed's bf16 mode keeps fp32 master weights and optimizer state.
        config["bf16"] = {"enabled": True}
    elif precision == "fp16-mixed":
        config["fp16"] = dict(FP16_DYNAMIC_LOSS_SCALE)
    # fp32: neither section (bf16-pure is rejected for deepspeed by the spec).
    if s.activation_checkpointing:
        # Settings of deepspeed.checkpointing; the loop enables recomputation on the
        # model itself, these keep DeepSpeed from partitioning/offloading activations.
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    return config


def _zero_section(spec: JobSpec) -> dict[str, Any]:
    s, r = spec.strategy, spec.resources
    stage = s.zero_stage
    assert stage is not None  # filled in by spec validation
    zero: dict[str, Any] = {"stage": stage}
    if s.sharding == "hybrid_shard":
        # ZeRO++ hpZ: a secondary copy of the parameters sharded within one node,
        # so forward/backward all-gathers stay on the node — FSDP's HYBRID_SHARD.
        zero["zero_hpz_partition_size"] = r.procs_per_node
    if stage == 3:
        # Consolidation reads the sharded checkpoint; gathering a 16-bit copy on
        # every save would cost a full-model all-gather per checkpoint.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    pin = r.device == "cuda"
    if s.offload in ("optimizer", "params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if s.offload == "params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    return zero
