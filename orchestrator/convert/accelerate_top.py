"""The top-level keys both accelerate flavours share (process counts, rendezvous, precision)."""

from __future__ import annotations

from typing import Any

from .checks import Origin, as_choice, check_keys
from .mapping import ACCELERATE_TOP_KEYS, MIXED_PRECISION_VALUES
from .plan import Plan


def read_top(plan: Plan, data: dict[str, Any], origin: Origin, skip: tuple[str, ...]) -> None:
    check_keys(data, ACCELERATE_TOP_KEYS, "the accelerate config", origin)
    env = data.get("compute_environment", "LOCAL_MACHINE")
    if env != "LOCAL_MACHINE":
        origin.fail(f"compute_environment {env!r} is not supported; accepted: LOCAL_MACHINE")
    if "mixed_precision" in data and data["mixed_precision"] is not None:
        plan.mixed_precision = as_choice(
            data["mixed_precision"], "mixed_precision", origin, MIXED_PRECISION_VALUES, upper=False
        )
    for key, value in data.items():
        if key in skip or key in ("distributed_type", "mixed_precision"):
            continue
        if key == "parallelism_config" and value:
            extra = {
                k: v
                for k, v in value.items()
                if not k.endswith(("dp_replicate_size", "dp_shard_size"))
            }
            for k, v in extra.items():
                if v not in (1, None):
                    plan.note(
                        "not-mapped",
                        f"parallelism_config.{k}",
                        f"{v!r}: tensor/context parallelism has no ZeRO twin",
                    )
            continue
        plan.top[key] = value
