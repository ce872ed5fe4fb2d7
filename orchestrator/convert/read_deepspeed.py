"""Reading a DeepSpeed accelerate config (inline keys or a deepspeed_config_file) into a `Plan`.

The DeepSpeed JSON it may point at is read here too; errors about that file name
the file itself and say "invalid DeepSpeed JSON config".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .accelerate_top import read_top
from .checks import (
    DEEPSPEED_JSON,
    Origin,
    as_choice,
    as_int,
    auto_or,
    check_keys,
    optional_bool,
)
from .mapping import (
    DEEPSPEED_KEYS,
    DS_JSON_READ,
    DS_KEYS_FILE_OWNS,
    OFFLOAD_DEVICES,
    strategy_of_zero,
)
from .plan import Plan


def plan_from_deepspeed(data: dict[str, Any], origin: Origin, base_dir: Path | None) -> Plan:
    plan = Plan()
    read_top(plan, data, origin, skip=("fsdp_config", "deepspeed_config"))
    cfg = data.get("deepspeed_config") or {}
    if not isinstance(cfg, dict):
        origin.fail(f"deepspeed_config must be a mapping, got {type(cfg).__name__}")
    check_keys(cfg, DEEPSPEED_KEYS, "deepspeed_config", origin)

    if cfg.get("deepspeed_config_file"):
        clash = [k for k in DS_KEYS_FILE_OWNS if k in cfg]
        if data.get("mixed_precision") is not None:
            clash.append(f"mixed_precision {data['mixed_precision']!r} (top level)")
        if clash:
            origin.fail(
                f"deepspeed_config has both deepspeed_config_file and {', '.join(clash)}; "
                "accelerate refuses that pair: put these settings in the DeepSpeed JSON"
            )
        path = _find_ds_json(cfg["deepspeed_config_file"], origin, base_dir)
        read_ds_json(plan, _load_json(path), Origin(str(path), DEEPSPEED_JSON))
    else:
        plan.zero_stage = as_int(
            cfg.get("zero_stage", 2), "deepspeed_config.zero_stage", origin, (0, 1, 2, 3)
        )
        plan.offload_optimizer = _offload_device(
            cfg.get("offload_optimizer_device", "none"),
            "deepspeed_config.offload_optimizer_device",
            origin,
        )
        plan.offload_param = _offload_device(
            cfg.get("offload_param_device", "none"), "deepspeed_config.offload_param_device", origin
        )
        plan.full_state_dict = optional_bool(
            cfg, "zero3_save_16bit_model", "deepspeed_config", origin, plan.full_state_dict
        )
        plan.grad_accum = auto_or(
            cfg.get("gradient_accumulation_steps"),
            "deepspeed_config.gradient_accumulation_steps",
            origin,
            int,
        )
        plan.grad_clip = auto_or(
            cfg.get("gradient_clipping"), "deepspeed_config.gradient_clipping", origin, float
        )
    plan.ram_efficient_loading = optional_bool(
        cfg, "zero3_init_flag", "deepspeed_config", origin, plan.ram_efficient_loading
    )
    for key in sorted(cfg):
        if key.startswith("deepspeed_") and key != "deepspeed_config_file":
            plan.note(
                "not-mapped",
                f"deepspeed_config.{key}",
                f"{cfg[key]!r}: DeepSpeed-only launcher setting, no FSDP twin",
            )
        if "nvme_path" in key:
            plan.note(
                "not-mapped",
                f"deepspeed_config.{key}",
                f"{cfg[key]!r}: FSDP cannot offload to NVMe",
            )

    plan.sharding = strategy_of_zero(plan.zero_stage, plan.hpz_partition_size)
    plan.note("mapped", "zero_stage", f"{plan.zero_stage} → {plan.sharding}")
    return plan


def _find_ds_json(name: Any, origin: Origin, base_dir: Path | None) -> Path:
    # accelerate resolves the path from the working directory; a config usually sits
    # beside its JSON, so that folder is tried first.
    path = Path(str(name))
    candidates = [path] if path.is_absolute() or base_dir is None else [base_dir / path, path]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        origin.fail(
            f"deepspeed_config.deepspeed_config_file {str(name)!r} does not exist "
            f"(looked in: {', '.join(map(str, candidates))})"
        )
    return found


def _load_json(path: Path) -> dict[str, Any]:
    origin = Origin(str(path), DEEPSPEED_JSON)
    try:
        ds = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        origin.fail(f"not readable JSON: {exc}")
    if not isinstance(ds, dict):
        origin.fail(f"the top level must be a JSON object, got {type(ds).__name__}")
    return ds


def read_ds_json(plan: Plan, ds: dict[str, Any], origin: Origin) -> None:
    """Fill `plan` from a DeepSpeed JSON config; every key not read is reported."""
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        origin.fail(f"zero_optimization must be an object, got {type(zero).__name__}")
    plan.zero_stage = as_int(zero.get("stage", 0), "zero_optimization.stage", origin, (0, 1, 2, 3))
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key) or {}
        if not isinstance(section, dict):
            origin.fail(f"zero_optimization.{key} must be an object, got {type(section).__name__}")
        device = _offload_device(
            section.get("device", "none"), f"zero_optimization.{key}.device", origin
        )
        setattr(plan, key, device)
    plan.full_state_dict = optional_bool(
        zero,
        "stage3_gather_16bit_weights_on_model_save",
        "zero_optimization",
        origin,
        plan.full_state_dict,
    )
    if "zero_hpz_partition_size" in zero:
        plan.hpz_partition_size = as_int(
            zero["zero_hpz_partition_size"], "zero_optimization.zero_hpz_partition_size", origin
        )
    plan.grad_accum = auto_or(
        ds.get("gradient_accumulation_steps"), "gradient_accumulation_steps", origin, int
    )
    plan.grad_clip = auto_or(ds.get("gradient_clipping"), "gradient_clipping", origin, float)
    bf16 = (ds.get("bf16") or {}).get("enabled")
    fp16 = (ds.get("fp16") or {}).get("enabled")
    if bf16 is True:
        plan.mixed_precision = "bf16"
    elif fp16 is True:
        plan.mixed_precision = "fp16"
    elif bf16 is False and fp16 in (False, None):
        plan.mixed_precision = "no"
    elif "auto" in (bf16, fp16):
        plan.note(
            "changed",
            "bf16/fp16.enabled",
            "'auto' in the DeepSpeed JSON: mixed "
            "precision comes from accelerate launch --mixed_precision; left unset",
        )
    for dotted in _leaf_keys(ds):
        if dotted in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            plan.note(
                "not-mapped",
                dotted,
                f"{ds[dotted]!r}: an FSDP accelerate config has no "
                "batch size; the training script's dataloader sets it",
            )
        elif dotted not in DS_JSON_READ:
            plan.note("not-mapped", dotted, "DeepSpeed-only setting, no FSDP twin")


def _leaf_keys(obj: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in obj.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.extend(_leaf_keys(value, dotted + "."))
        else:
            out.append(dotted)
    return out


def _offload_device(value: Any, where: str, origin: Origin) -> str:
    """Where DeepSpeed offloads (`none`, `cpu`, `nvme`), in either file's spelling."""
    return as_choice(value, where, origin, OFFLOAD_DEVICES, upper=False)
