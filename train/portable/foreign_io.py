"""Convert a checkpoint another tool wrote (`train/foreign.py`) between FSDP and
DeepSpeed, laid out for the tool that will load it.

The state moves through the same `PortableState` as shardctl's own conversions (model
weights, Adam's moments and step counts, one tensor in memory at a time); only where it
is read from and where it is written to differ:

- `accelerate`: FSDP as `pytorch_model_fsdp_0/` {"model"} + `optimizer_0/` {"optimizer"}
  (what `accelerator.load_state` reads); DeepSpeed as `latest` + `pytorch_model/` (the
  tag accelerate asks the engine for).
- `trainer`: the same FSDP folders inside `checkpoint-N/`; DeepSpeed as `latest` +
  `global_stepN/`.
- `plain`: FSDP as one DCP folder {"model", "optim"}; DeepSpeed as `latest` +
  `global_stepN/` (DeepSpeed's own tag).

The tool's own files beside the state (accelerate's `random_states_*.pkl`,
`scheduler.bin`; the Trainer's `trainer_state.json`, `scheduler.pt`, `rng_state*.pth`,
`training_args.bin`, `config.json`) are carried when the output keeps the source's tool;
whatever is not carried is named in the report's notes.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from ...orchestrator.errors import CheckpointError, UsageError
from ..foreign import FSDP_MODEL_DIR, FSDP_OPTIM_DIR, ForeignCheckpoint

LAYOUTS = ("source", "accelerate", "trainer", "plain", "shardctl")
ACCELERATE_DS_TAG = "pytorch_model"  # accelerator.load_state asks the engine for this tag
# DeepSpeed's recovery scripts: written anew beside a DeepSpeed output, never carried.
_RECOVERY = ("zero_to_fp32.py", "zero_to_torch.py")


def layout_of(found: ForeignCheckpoint, layout: str) -> str:
    """`source` → the layout of the tool that wrote `found`."""
    if layout not in LAYOUTS:
        raise UsageError(f"--layout {layout!r}; accepted: {', '.join(LAYOUTS)}")
    if layout != "source":
        return layout
    tool = found.format.split("+")[0]
    return tool if tool in ("accelerate", "trainer") else "plain"


def read_foreign_state(found: ForeignCheckpoint) -> Any:
    """The portable view of a sharded checkpoint another tool wrote."""
    from .state import _from_deepspeed, from_dcp

    if found.backend == "deepspeed":
        return _from_deepspeed(found.model, {})
    if found.backend != "fsdp":
        raise UsageError(
            f"{found.path} is an unsharded save ({found.format}: {found.model.name}); it "
            "loads on any backend as it is (from_pretrained, or `shardctl consolidate` for a "
            "model folder); convert takes a DeepSpeed or FSDP checkpoint"
        )
    world = found.world_size or 1
    if found.optimizer is not None:  # accelerate / the Trainer: optimizer_0/ {"optimizer"}
        return from_dcp(found.model, world, found.optimizer, "optimizer")
    return from_dcp(found.model, world, None, _optim_key(found.model))


def _optim_key(dcp_dir: Path) -> str:
    """A plain script names its optimizer entry itself: "optim" or "optimizer"."""
    from ..consolidate.dcp import read_metadata

    tops = {key.split(".", 1)[0] for key in read_metadata(dcp_dir).tensors}
    for key in ("optim", "optimizer"):
        if key in tops:
            return key
    raise CheckpointError(
        f"{dcp_dir}: no optimizer state (top-level keys {sorted(tops)}; accepted: 'optim' or "
        "'optimizer' holding get_optimizer_state_dict's layout): a checkpoint converts with "
        "its optimizer, or not at all"
    )


def convert_foreign(
    found: ForeignCheckpoint,
    to: str,
    out: Path,
    *,
    layout: str = "source",
    world_size: int | None = None,
    zero_stage: int | None = None,
    precision: str | None = None,
) -> Any:
    """Write `found` for backend `to` at `out` (a new folder), in `layout`."""
    from ..storage import PosixStorage
    from . import ConvertReport, _check_out, published

    t0 = time.perf_counter()
    target = layout_of(found, layout)
    if to == found.backend == "fsdp" and target == layout_of(found, "source"):
        raise UsageError(
            f"{found.path} is already an FSDP checkpoint ({found.format}); it loads on any "
            "world size as it is. To switch backend: --to deepspeed; for the built-in loop's "
            "checkpoint.resume: --layout shardctl"
        )
    _check_out(out, found.path)
    state = read_foreign_state(found)
    notes: list[str] = []
    step = found.step if found.step is not None else 0
    if found.step is None:
        notes.append(f"{found.format} records no step here: DeepSpeed's tag and files say 0")
    storage = PosixStorage(out.parent)
    with published(storage, out, found.path, state.nbytes) as tmp:
        if to == "fsdp":
            ws, stage, prec = state.world_size, None, "fp32"
            _write_fsdp(state, tmp, target)
        else:
            ws, stage, prec = _deepspeed_target(
                found, state, world_size, zero_stage, precision, notes
            )
            _write_deepspeed(state, tmp, target, step, ws, stage, prec)
        notes += _carry(found, tmp, target, to)
        if target == "shardctl":
            _write_manifest(found, tmp, to, step, ws, stage, prec)
            notes.append(
                "no trainer state (data position, RNG) in another tool's checkpoint: the "
                "built-in loop resumes the model and optimizer at its step, the data from "
                "its start"
            )
        storage.sync(tmp, [str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()])
    return ConvertReport.finished(
        out, to, ws, state, t0, source=str(found.path), step=step,
        source_backend=f"{found.backend} ({found.format})", zero_stage=stage, precision=prec,
        notes=notes, writer="direct" if to == "deepspeed" else None, layout=target,
    )  # fmt: skip


def _deepspeed_target(
    found: ForeignCheckpoint,
    state: Any,
    world_size: int | None,
    zero_stage: int | None,
    precision: str | None,
    notes: list[str],
) -> tuple[int, int, str]:
    """World size, ZeRO stage and precision of the DeepSpeed output, each from the
    option, else from the source, else a stated default."""
    if world_size is None:
        if found.backend != "deepspeed" or not found.world_size:
            raise UsageError(
                "--world-size is required: the number of ranks that will resume it (an FSDP "
                "checkpoint loads on any number of ranks, a DeepSpeed one on exactly one)"
            )
        world_size = found.world_size
        notes.append(f"for {world_size} ranks, as the source was saved (--world-size to change)")
    stage = zero_stage or state.zero_stage
    if stage is None:
        stage = 3
        notes.append("ZeRO-3, DeepSpeed's default for a sharded model (--zero-stage to change)")
    if precision is None:
        precision = _source_precision(found) or "fp32"
        if found.backend == "fsdp":
            notes.append(
                f"written for a {precision} DeepSpeed config (an FSDP checkpoint records no "
                "precision; --precision bf16-mixed for a bf16 config)"
            )
    if precision not in ("fp32", "bf16-mixed"):
        raise UsageError(f"--precision {precision!r}; accepted for DeepSpeed: fp32, bf16-mixed")
    return world_size, int(stage), precision


def _source_precision(found: ForeignCheckpoint) -> str | None:
    """bf16-mixed when the source is a DeepSpeed checkpoint saved under a bf16 config."""
    if found.backend != "deepspeed":
        return None
    bf16 = any(p.name.startswith("bf16_") for p in found.model.glob("*_optim_states.pt"))
    return "bf16-mixed" if bf16 else "fp32"


def _write_manifest(
    found: ForeignCheckpoint, tmp: Path, to: str, step: int, world: int, stage: int | None,
    precision: str,
) -> None:  # fmt: skip
    """shardctl's layout: the manifest that commits the folder, every file hashed."""
    import json

    from ...orchestrator.spec import SHARDING_TO_ZERO, ZERO_TO_SHARDING
    from ..manifest import FORMAT_VERSION, describe_files, list_files, package_version
    from ..manifest import write_manifest as commit

    hf_config = None
    if found.hf_config is not None:
        try:
            hf_config = json.loads(found.hf_config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            hf_config = None
    sharding = ZERO_TO_SHARDING[int(stage or 3)]
    commit(
        tmp,
        {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": world,
            "backend": to,
            "sharding": sharding,
            "zero_stage": stage if to == "deepspeed" else SHARDING_TO_ZERO[sharding],
            "precision": precision,
            "model": {"hf_config": hf_config} if isinstance(hf_config, dict) else None,
            "versions": {
                "torch": package_version("torch"), "shardctl": package_version("shardctl"),
            },
            "converted_from": {"path": str(found.path), "format": found.format,
                               "backend": found.backend, "world_size": found.world_size},
            "files": describe_files(tmp, list_files(tmp)),
        },
    )  # fmt: skip


def _write_fsdp(state: Any, tmp: Path, layout: str) -> None:
    from .dcp_out import write_dcp

    if layout == "shardctl":
        write_dcp(state, tmp / "dcp", "float32")
        return
    if layout == "plain":
        write_dcp(state, tmp, "float32")
        return
    # accelerate's load_fsdp_model / load_fsdp_optimizer: two DCP folders, two keys.
    write_dcp(state, tmp / FSDP_MODEL_DIR, "float32", "model", None)
    write_dcp(state, tmp / FSDP_OPTIM_DIR, "float32", None, "optimizer")


def _write_deepspeed(
    state: Any, tmp: Path, layout: str, step: int, world: int, stage: int, precision: str
) -> None:
    from .ds_out import deepspeed_config
    from .zero_layout import SUB_GROUP_SIZE
    from .zero_out import Target, deepspeed_version, unsupported, write_zero

    version = deepspeed_version()
    reason = unsupported(state, version)
    if reason is not None or version is None:
        raise CheckpointError(f"cannot write DeepSpeed's files for this checkpoint: {reason}")
    from .zero_out import TAG as SHARDCTL_TAG

    tags = {"accelerate": ACCELERATE_DS_TAG, "shardctl": SHARDCTL_TAG}
    tag = tags.get(layout, f"global_step{step}")
    config = deepspeed_config(stage, precision)
    target = Target(stage, world, precision, step, config, version, SUB_GROUP_SIZE)
    write_zero(state, tmp, target, tag)


def _carry(found: ForeignCheckpoint, tmp: Path, layout: str, to: str) -> list[str]:
    """Copy the tool's own files beside the state when the output keeps its layout;
    return notes naming what was not carried."""
    notes: list[str] = []
    if found.backend == "deepspeed":
        notes.append(
            "DeepSpeed's engine counters and any engine-held lr scheduler live in its "
            "model-states file and are not carried (accelerate and the Trainer keep the step "
            "and scheduler in their own files)"
        )
    source_tool = layout_of(found, "source")
    own = _own_files(found)
    if layout != source_tool or source_tool == "plain":
        if own:
            notes.append(
                f"not carried ({source_tool} layout → {layout}): "
                + ", ".join(sorted(p.name for p in own))
            )
        return notes
    for path in own:
        if path.is_dir():
            shutil.copytree(path, tmp / path.name)
        else:
            shutil.copy2(path, tmp / path.name)
    if own:
        notes.append("carried: " + ", ".join(sorted(p.name for p in own)))
    return notes


def _own_files(found: ForeignCheckpoint) -> list[Path]:
    """Everything in the source folder that is not the model/optimizer state itself."""
    state = {found.model.resolve()}
    if found.optimizer is not None:
        state.add(found.optimizer.resolve())
    out = []
    for path in sorted(found.path.iterdir()):
        if path.resolve() in state or path.name in ("latest", *_RECOVERY):
            continue
        if path.is_dir() and (any(path.glob("*_model_states.pt")) or (path / ".metadata").exists()):
            continue  # another tag or DCP folder of the same checkpoint
        if path.name == ".metadata" or path.suffix == ".distcp":
            continue
        out.append(path)
    return out
