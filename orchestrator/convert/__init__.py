"""FSDP ⇄ DeepSpeed: translate an accelerate config (or a job spec) to the other backend.

The mapping follows Accelerate's concept guide "FSDP vs DeepSpeed":

    sharding strategy          ⇄ ZeRO stage       FULL_SHARD↔3  SHARD_GRAD_OP↔2  NO_SHARD↔0
                                                  HYBRID_SHARD↔3 (+ ZeRO++ hpZ in a DeepSpeed JSON)
    fsdp_offload_params        ⇄ offload_param_device / offload_optimizer_device = cpu
    fsdp_cpu_ram_efficient_loading ⇄ zero3_init_flag   (FSDP1 also needs sync_module_states)
    fsdp_state_dict_type FULL  ⇄ zero3_save_16bit_model true (SHARDED ⇄ false)
    mixed_precision, gradient accumulation and clipping are carried over.

Everything without a twin (prefetch, wrap policy, use_orig_params, DeepSpeed-only
JSON keys ...) is reported by name in `Conversion.notes`, never dropped silently,
and so is the precision difference: FSDP keeps parameters in the dtype they were
loaded in unless mixed precision upcasts them; DeepSpeed always keeps fp32 masters.

One module per job:

    source           read a file or stdin, parse it, detect what it is
    read_fsdp        accelerate FSDP config   → Plan
    read_deepspeed   accelerate DeepSpeed config (+ its DeepSpeed JSON) → Plan
    read_spec        job spec → Plan, through the render functions (accelerate_config,
                     dsconfig), never a second mapping
    write_deepspeed  Plan → DeepSpeed accelerate config (+ DeepSpeed JSON)
    write_fsdp       Plan → FSDP accelerate config
    notes            the caveats' wording; output: the bytes the CLI writes
    mapping, checks, plan, accelerate_top: accelerate's vocabulary, value checks,
                     the neutral Plan, the keys both flavours share

The conversion goes through one backend-neutral `Plan`, so FSDP → DeepSpeed → FSDP
gives back every setting that has a twin. Pure functions: no torch, no accelerate;
pydantic only for job-spec input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UsageError
from .checks import ACCELERATE, Origin
from .notes import add_precision_notes
from .output import render_ds_json, render_yaml
from .plan import Conversion, Note, Plan, SourceKind, Target
from .read_deepspeed import plan_from_deepspeed
from .read_fsdp import plan_from_fsdp
from .source import STDIN_NAME, Input, detect, read_path, read_text
from .write_deepspeed import to_deepspeed
from .write_fsdp import to_fsdp

__all__ = [
    "STDIN_NAME",
    "Conversion",
    "Note",
    "Plan",
    "SourceKind",
    "Target",
    "convert_data",
    "convert_file",
    "convert_text",
    "detect",
    "read_plan",
    "render_ds_json",
    "render_yaml",
]


def convert_file(
    path: str | Path,
    to: Target,
    *,
    fsdp_version: int | None = None,
    deepspeed_json_path: str | None = None,
) -> Conversion:
    """Read an accelerate config or a job spec from `path` and convert it to `to`."""
    return _convert(read_path(path), to, fsdp_version, deepspeed_json_path)


def convert_text(
    text: str,
    to: Target,
    *,
    source: str = STDIN_NAME,
    base_dir: Path | None = None,
    fsdp_version: int | None = None,
    deepspeed_json_path: str | None = None,
) -> Conversion:
    """Convert the text of an accelerate config or a job spec (stdin); kind from content."""
    return _convert(read_text(text, source, base_dir), to, fsdp_version, deepspeed_json_path)


def convert_data(
    data: Any,
    to: Target,
    *,
    source: str | None = None,
    base_dir: Path | None = None,
    fsdp_version: int | None = None,
    deepspeed_json_path: str | None = None,
) -> Conversion:
    """Convert already-parsed YAML data (accelerate config or job spec) to `to`."""
    return _convert(Input(data, source, base_dir), to, fsdp_version, deepspeed_json_path)


def read_plan(data: Any, source: str | None = None, base_dir: Path | None = None) -> Plan:
    """The neutral plan of an accelerate config (what a round trip must keep: `mappable`)."""
    origin = Origin(source, ACCELERATE)
    if detect(data, source) == "accelerate-fsdp":
        return plan_from_fsdp(data, origin)
    return plan_from_deepspeed(data, origin, base_dir)


def _convert(
    given: Input, to: Target, fsdp_version: int | None, deepspeed_json_path: str | None
) -> Conversion:
    source = given.source
    where = f"{source}: " if source else ""
    if to not in ("fsdp", "deepspeed"):
        raise UsageError(f"--to {to!r} is not a backend; accepted: fsdp, deepspeed")
    if fsdp_version not in (None, 1, 2):
        raise UsageError(f"fsdp_version {fsdp_version!r} is not an FSDP version; accepted: 1, 2")
    kind = detect(given.data, source)
    if kind == f"accelerate-{to}":
        other = "fsdp" if to == "deepspeed" else "deepspeed"
        raise UsageError(
            f"{where}--to {to}: this is already a {to} accelerate config; accepted: --to {other}"
        )
    spec_strategy = None
    origin = Origin(source, ACCELERATE)  # both accelerate flavours
    if kind == "jobspec":
        from .read_spec import plan_from_spec  # pydantic: only job specs pay for it

        plan, spec_strategy = plan_from_spec(given.data, to, source)
    elif kind == "accelerate-fsdp":
        plan = plan_from_fsdp(given.data, origin)
    else:
        plan = plan_from_deepspeed(given.data, origin, given.base_dir)
    if to == "deepspeed":
        config, ds_json = to_deepspeed(plan, deepspeed_json_path)
    else:
        config, ds_json = to_fsdp(plan, fsdp_version, source), None
    add_precision_notes(plan, to)
    return Conversion(kind, to, config, ds_json, tuple(plan.notes), spec_strategy)
