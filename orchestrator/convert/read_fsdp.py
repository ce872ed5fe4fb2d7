"""Reading an FSDP accelerate config (FSDP1 or FSDP2 key style) into a `Plan`.

Settings without a DeepSpeed twin are validated too, kept in `Plan.fsdp_extra` for
a conversion back, and named in the report.
"""

from __future__ import annotations

from typing import Any

from .accelerate_top import read_top
from .checks import Origin, as_bool, as_choice, as_int, check_keys, optional_bool
from .mapping import (
    FSDP_KEYS,
    FSDP_STRATEGIES,
    PREFETCH,
    STATE_DICT_TYPES,
    STRATEGY_TO_ZERO,
    WRAP_POLICIES,
)
from .notes import NO_TWIN_IN_DEEPSPEED
from .plan import Plan


def plan_from_fsdp(data: dict[str, Any], origin: Origin) -> Plan:
    plan = Plan()
    read_top(plan, data, origin, skip=("fsdp_config", "deepspeed_config"))
    raw = data.get("fsdp_config") or {}
    if not isinstance(raw, dict):
        origin.fail(f"fsdp_config must be a mapping, got {type(raw).__name__}")
    # `accelerate launch` accepts keys with or without the fsdp_ prefix.
    cfg = {(k if str(k).startswith("fsdp") else f"fsdp_{k}"): v for k, v in raw.items()}
    check_keys(cfg, FSDP_KEYS, "fsdp_config", origin)

    version = as_int(cfg.get("fsdp_version", 1), "fsdp_config.fsdp_version", origin, (1, 2))
    plan.fsdp_version = version
    plan.sharding, mesh_shard = _fsdp_sharding(cfg, version, data, origin)
    plan.zero_stage = STRATEGY_TO_ZERO[plan.sharding]
    if plan.sharding == "HYBRID_SHARD":
        # hpZ's partition is one node: FSDP2 says it as the mesh's shard dimension;
        # FSDP1 leaves it to the launch, so it is the processes per machine.
        nodes, procs = plan.top.get("num_machines"), plan.top.get("num_processes")
        if mesh_shard is not None:
            plan.hpz_partition_size = mesh_shard
        elif isinstance(nodes, int) and isinstance(procs, int) and nodes > 1 and procs % nodes == 0:
            plan.hpz_partition_size = procs // nodes
    sharding_keys = [
        k for k in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward") if k in cfg
    ]
    plan.note(
        "mapped",
        "fsdp_config." + ("/".join(sharding_keys) or "fsdp_sharding_strategy (default)"),
        f"{plan.sharding} → zero_stage {plan.zero_stage}",
    )
    plan.note(
        "not-mapped",
        "fsdp_config.fsdp_version",
        f"{version}: DeepSpeed has no such choice; to get the same key style back, convert "
        f"with --fsdp-version {version}",
    )

    if as_bool(cfg.get("fsdp_offload_params", False), "fsdp_config.fsdp_offload_params", origin):
        plan.offload_param = plan.offload_optimizer = "cpu"
    plan.ram_efficient_loading = optional_bool(
        cfg, "fsdp_cpu_ram_efficient_loading", "fsdp_config", origin, plan.ram_efficient_loading
    )
    if "fsdp_state_dict_type" in cfg:
        sdt = as_choice(
            cfg["fsdp_state_dict_type"],
            "fsdp_config.fsdp_state_dict_type",
            origin,
            STATE_DICT_TYPES,
        )
        plan.full_state_dict = sdt == "FULL_STATE_DICT"
        if sdt == "LOCAL_STATE_DICT":
            plan.note(
                "changed",
                "fsdp_config.fsdp_state_dict_type",
                "LOCAL_STATE_DICT has no DeepSpeed twin; treated as SHARDED_STATE_DICT "
                "(zero3_save_16bit_model false)",
            )

    # Settings without a DeepSpeed twin: validated, kept for the way back, reported.
    checks: dict[str, tuple[str, ...] | type] = {
        "fsdp_backward_prefetch": PREFETCH,
        "fsdp_backward_prefetch_policy": PREFETCH,
        "fsdp_auto_wrap_policy": WRAP_POLICIES,
        "fsdp_forward_prefetch": bool,
        "fsdp_use_orig_params": bool,
        "fsdp_sync_module_states": bool,
        "fsdp_activation_checkpointing": bool,
        "fsdp_activation_checkpointing_offload": bool,
        "fsdp_transformer_layer_cls_to_wrap": str,
        "fsdp_min_num_params": int,
        "fsdp_ignored_modules": str,
    }
    for key, kind in checks.items():
        if key not in cfg:
            continue
        where = f"fsdp_config.{key}"
        value = cfg[key]
        if kind is bool:
            value = as_bool(value, where, origin)
        elif kind is int:
            value = as_int(value, where, origin)
        elif isinstance(kind, tuple):
            value = as_choice(value, where, origin, kind)
        else:
            value = str(value)
        if key == "fsdp_backward_prefetch_policy":  # the pre-1.0 name
            plan.note("changed", where, "old key name, read as fsdp_backward_prefetch")
            key = "fsdp_backward_prefetch"
        plan.fsdp_extra[key] = value
        if key == "fsdp_sync_module_states":
            plan.note(
                "not-mapped",
                where,
                f"{value!r}: no DeepSpeed twin; with zero3_init_flag "
                "DeepSpeed partitions the weights as they are created",
            )
            continue
        plan.note("not-mapped", where, f"{value!r}: {NO_TWIN_IN_DEEPSPEED[key]}")
    return plan


def _fsdp_sharding(
    cfg: dict[str, Any], version: int, data: dict[str, Any], origin: Origin
) -> tuple[str, int | None]:
    """The FSDP strategy name, and for an FSDP2 hybrid mesh its shard dimension."""
    if version == 2:
        raf = as_bool(
            cfg.get("fsdp_reshard_after_forward", True),
            "fsdp_config.fsdp_reshard_after_forward",
            origin,
        )
        if "fsdp_sharding_strategy" in cfg:
            origin.fail(
                f"fsdp_config.fsdp_sharding_strategy {cfg['fsdp_sharding_strategy']!r} is an "
                "FSDP1 key; with fsdp_version 2 accepted: fsdp_reshard_after_forward true|false",
            )
        pc = data.get("parallelism_config") or {}
        replicate = as_int(
            pc.get("parallelism_config_dp_replicate_size", 1),
            "parallelism_config.parallelism_config_dp_replicate_size",
            origin,
        )
        shard = as_int(
            pc.get("parallelism_config_dp_shard_size", 2),
            "parallelism_config.parallelism_config_dp_shard_size",
            origin,
        )
        if replicate > 1 and shard == 1:
            return "NO_SHARD", None
        if replicate > 1:
            return ("HYBRID_SHARD" if raf else "HYBRID_SHARD_ZERO2"), shard
        return ("FULL_SHARD" if raf else "SHARD_GRAD_OP"), None
    # FSDP1: accelerate 1.15 reads fsdp_sharding_strategy first, then
    # fsdp_reshard_after_forward (which takes the strategy names in FSDP1).
    given = {
        k: _strategy(cfg[k], f"fsdp_config.{k}", origin)
        for k in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward")
        if k in cfg
    }
    if len(set(given.values())) > 1:
        origin.fail(
            "fsdp_config.fsdp_sharding_strategy "
            f"{given['fsdp_sharding_strategy']!r} and fsdp_config.fsdp_reshard_after_forward "
            f"{given['fsdp_reshard_after_forward']!r} disagree; give one strategy",
        )
    return next(iter(given.values()), "FULL_SHARD"), None


def _strategy(value: Any, where: str, origin: Origin) -> str:
    # Older accelerate wrote the strategy as its 1-based number.
    if (isinstance(value, int) and not isinstance(value, bool)) or str(value).isdigit():
        n = int(value)
        if 1 <= n <= len(FSDP_STRATEGIES):
            return FSDP_STRATEGIES[n - 1]
    elif isinstance(value, str) and value.upper() in FSDP_STRATEGIES:
        return value.upper()
    accepted = ", ".join(f"{s} ({i})" for i, s in enumerate(FSDP_STRATEGIES, 1))
    origin.fail(f"{where} {value!r} is not an FSDP sharding strategy; accepted: {accepted}")
