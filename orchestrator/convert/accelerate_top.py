"""The top-level keys both accelerate flavours share (process counts, rendezvous, precision)."""

from __future__ import annotations

from typing import Any

from .checks import (
    MAX_NODES,
    MAX_PORT,
    MAX_PROCESSES,
    Origin,
    as_choice,
    bounded_int,
    check_keys,
)
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
    numbers = _bounded_numbers(data, origin)
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
        plan.top[key] = numbers.get(key, value)


# The counts and the port accelerate launches with, and the range each may take (`None`
# is accelerate's "not set" for every one of them but num_machines).
_TOP_RANGES = {
    "num_processes": (1, MAX_PROCESSES),
    "num_machines": (1, MAX_NODES),
    "machine_rank": (0, MAX_NODES - 1),
    "main_process_port": (1, MAX_PORT),
}


def _bounded_numbers(data: dict[str, Any], origin: Origin) -> dict[str, int]:
    """The top-level numbers, each checked against its range (and machine_rank against
    num_machines), and parallelism_config's sizes; one line names any that is not."""
    numbers = {
        key: bounded_int(data[key], key, origin, *span)
        for key, span in _TOP_RANGES.items()
        if data.get(key) is not None
    }
    rank, machines = numbers.get("machine_rank"), numbers.get("num_machines", 1)
    if rank is not None and rank >= machines:
        origin.fail(
            f"machine_rank {rank} is not valid with num_machines {machines}; "
            f"accepted: 0..{machines - 1}"
        )
    mesh = data.get("parallelism_config")
    if mesh is not None and not isinstance(mesh, dict):
        origin.fail(
            f"parallelism_config {mesh!r} is not valid; accepted: a mapping of "
            "parallelism_config_*_size keys"
        )
    for key, size in (mesh or {}).items():
        if str(key).endswith("_size") and size is not None:
            bounded_int(size, f"parallelism_config.{key}", origin, 1, MAX_PROCESSES)
    return numbers
