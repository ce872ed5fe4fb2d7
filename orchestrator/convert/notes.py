"""The caveats of a conversion: the precision difference, and why a setting has no twin.

Texts only (and the one function that adds the precision notes), so the wording a
user reads lives in one place.
"""

from __future__ import annotations

from .plan import Plan, Target

PRECISION_NOTE = (
    "precision differs between the backends: FSDP keeps parameters and runs the optimizer "
    "in the dtype the model was loaded in unless mixed precision upcasts them, while "
    "DeepSpeed always creates fp32 master weights and steps the optimizer in fp32. A model "
    "loaded in bf16 therefore trains in pure bf16 under FSDP with mixed_precision 'no', but "
    "with fp32 masters (more memory, different numerics) under DeepSpeed. To train the same "
    "way on both: load the model in fp32 (torch_dtype=torch.float32) and use mixed_precision "
    "bf16 (shardctl: strategy.precision bf16-mixed)."
)


NO_TWIN_IN_DEEPSPEED = {
    "fsdp_backward_prefetch": "no DeepSpeed twin; ZeRO-3 prefetches by itself "
    "(tune stage3_prefetch_bucket_size / stage3_max_reuse_distance in a DeepSpeed JSON)",
    "fsdp_forward_prefetch": "no DeepSpeed twin; ZeRO-3 prefetches by itself",
    "fsdp_auto_wrap_policy": "no DeepSpeed twin; DeepSpeed partitions parameters without "
    "wrapping units",
    "fsdp_transformer_layer_cls_to_wrap": "no DeepSpeed twin; DeepSpeed needs no wrap classes",
    "fsdp_min_num_params": "no DeepSpeed twin; DeepSpeed needs no wrap policy",
    "fsdp_use_orig_params": "no DeepSpeed twin; DeepSpeed always exposes the original parameters",
    "fsdp_activation_checkpointing": "no key in DeepSpeed's accelerate config; enable "
    "gradient checkpointing in the model instead (model.gradient_checkpointing_enable())",
    "fsdp_activation_checkpointing_offload": "no DeepSpeed twin in accelerate's config",
    "fsdp_ignored_modules": "no DeepSpeed twin; DeepSpeed partitions every parameter",
}


def add_precision_notes(plan: Plan, to: Target) -> None:
    """The precision caveat of every conversion, and the sharper one when mixed precision is off."""
    plan.note("precision", "mixed_precision", PRECISION_NOTE)
    mp = plan.mixed_precision
    if to == "deepspeed" and mp in (None, "no"):
        plan.note(
            "precision",
            "mixed_precision",
            f"{mp!r} under FSDP trains in the load dtype; "
            "under DeepSpeed the optimizer keeps fp32 masters — if the model is loaded in "
            "bf16 this is a different training run",
        )
    if to == "fsdp" and mp in (None, "no"):
        plan.note(
            "precision",
            "mixed_precision",
            f"{mp!r}: DeepSpeed trained with fp32 masters; "
            "under FSDP a model loaded in bf16 would now train in pure bf16 — load it in "
            "fp32 or set mixed_precision bf16",
        )
