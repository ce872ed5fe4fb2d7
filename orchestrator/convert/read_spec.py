"""Reading a shardctl job spec into a `Plan`, through exactly what `shardctl render` writes.

Nothing of the spec is mapped a second time here: ZeRO stage, hpZ partition,
offload, accumulation and clipping are read from `dsconfig.deepspeed_config(spec)`,
the process layout from `accelerate_config.accelerate_config(spec)`, and mixed
precision from `accelerate_config.mixed_precision` (which renders `auto` for the
spec's device). Only settings those files do not carry (wrap classes, prefetch,
activation checkpointing) are taken from the spec itself.
"""

from __future__ import annotations

from typing import Any

from ..errors import SpecError
from ..precision import AUTO, rendered_precision
from .mapping import strategy_of_zero
from .plan import Plan, Target

# The top-level accelerate keys a converted job spec carries: the process layout and
# the rendezvous. What else render writes (debug, gpu_ids, cpu affinity, downcast)
# are accelerate's defaults, left out as `accelerate config` would leave them.
SPEC_TOP_KEYS = (
    "compute_environment",
    "machine_rank",
    "main_training_function",
    "num_machines",
    "num_processes",
    "rdzv_backend",
    "same_network",
    "use_cpu",
)


def plan_from_spec(
    data: dict[str, Any], to: Target, source: str | None
) -> tuple[Plan, dict[str, Any] | None]:
    """The plan of a job spec, and the `strategy` section that runs it on `to` (if any)."""
    # pydantic (and the render modules) only when the input is a job spec; still no torch.
    from ..accelerate_config import accelerate_config, mixed_precision
    from ..dsconfig import deepspeed_config
    from ..spec import parse_spec

    spec = parse_spec(data, source)
    s, device = spec.strategy, spec.resources.device
    rendered = accelerate_config(spec)
    ds = deepspeed_config(spec)  # valid for either backend: ZeRO stage is derived for FSDP too
    zero = ds["zero_optimization"]

    plan = Plan()
    plan.top = {key: rendered[key] for key in SPEC_TOP_KEYS}
    plan.zero_stage = zero["stage"]
    plan.hpz_partition_size = zero.get("zero_hpz_partition_size")
    # The spec names its strategy (hybrid_shard stays hybrid even where hpZ has a
    # single process per node to partition over); ZeRO-1 has no FSDP name of its own.
    plan.sharding = s.sharding.upper() if s.sharding else strategy_of_zero(plan.zero_stage, None)
    plan.offload_param = zero.get("offload_param", {}).get("device", "none")
    plan.offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none")
    plan.mixed_precision = mixed_precision(spec)
    plan.grad_accum = ds["gradient_accumulation_steps"]
    # Clipping 0 means none; the accelerate config then leaves it to the script ('auto').
    plan.grad_clip = ds["gradient_clipping"] or None
    plan.fsdp_version = 2  # shardctl trains with FSDP2
    plan.fsdp_extra["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
    if isinstance(s.wrap, list):
        plan.fsdp_extra["fsdp_transformer_layer_cls_to_wrap"] = ",".join(s.wrap)
    if s.activation_checkpointing:
        plan.fsdp_extra["fsdp_activation_checkpointing"] = True

    if s.precision == "bf16-pure":
        plan.note(
            "precision",
            "strategy.precision",
            "'bf16-pure' has no accelerate mixed_precision value: it is mixed_precision 'no' "
            "with the model loaded in bf16 (FSDP only)",
        )
    if s.precision == AUTO:
        plan.note(
            "precision",
            "strategy.precision",
            f"'auto' is decided on each node from its hardware; a config file cannot, so "
            f"it says {plan.mixed_precision!r}: auto rendered as "
            f"{rendered_precision(s.precision, device)} for resources.device {device}",
        )
    plan.note(
        "mapped",
        "strategy",
        f"{s.backend} sharding {s.sharding} / zero_stage "
        f"{s.zero_stage} → {plan.sharding} / zero_stage {plan.zero_stage}",
    )
    if to == "deepspeed":
        for name, value in (
            ("strategy.wrap", s.wrap),
            ("strategy.backward_prefetch", s.backward_prefetch),
            ("strategy.forward_prefetch", s.forward_prefetch),
        ):
            plan.note("not-mapped", name, f"{value!r}: FSDP-only, no DeepSpeed twin")
        if s.activation_checkpointing:
            plan.note(
                "not-mapped",
                "strategy.activation_checkpointing",
                "no key in DeepSpeed's accelerate config; shardctl's own loop "
                "still checkpoints activations with either backend",
            )
    return plan, _spec_strategy(data, spec, to, plan)


def _spec_strategy(
    data: dict[str, Any], spec: Any, to: Target, plan: Plan
) -> dict[str, Any] | None:
    """The `strategy` section that runs the same job on the other backend, if valid."""
    from ..spec import parse_spec

    s = spec.strategy
    new: dict[str, Any] = {
        "backend": to,
        "offload": s.offload,
        "precision": s.precision,
        "activation_checkpointing": s.activation_checkpointing,
    }
    if to == "deepspeed":
        new["zero_stage"] = s.zero_stage
        if s.precision == "bf16-pure":
            new["precision"] = "bf16-mixed"
            plan.note(
                "changed",
                "strategy.precision",
                "'bf16-pure' cannot run on DeepSpeed "
                "(it always keeps fp32 master weights); the spec uses bf16-mixed",
            )
    else:
        if s.zero_stage == 1:
            new["sharding"] = "shard_grad_op"
            plan.note(
                "changed",
                "strategy.zero_stage",
                "1 (optimizer-state sharding only) "
                "has no FSDP mode; shard_grad_op also shards gradients",
            )
        else:
            new["sharding"] = s.sharding
        new.update(
            wrap=s.wrap, backward_prefetch=s.backward_prefetch, forward_prefetch=s.forward_prefetch
        )
    candidate = {**data, "strategy": new}
    if spec.launcher == "deepspeed" and to == "fsdp":
        candidate["launcher"] = "torchrun"
        plan.note("changed", "launcher", "'deepspeed' cannot start FSDP; the spec uses torchrun")
    try:
        parse_spec(candidate)
    except SpecError as exc:
        plan.note(
            "changed",
            "strategy",
            f"no valid {to} strategy for this spec: " + "; ".join(exc.problems),
        )
        return None
    return new
