"""Read a DeepSpeed ZeRO 1/2/3 checkpoint as a list of SourceTensors (fp32 master weights).

What training produced are the fp32 masters held by the ZeRO optimizer, partitioned
flat across the data-parallel ranks (`*_optim_states.pt`); the module weights in the
model-states file are their low-precision copies (stage 1/2) or empty (stage 3).

- Stage 1/2: per param group, rank r holds a contiguous slice
  `single_partition_of_fp32_groups[g]`; the concatenation over ranks is the group's flat
  vector, in which the group's params (`param_shapes[g]`, in order) follow each other,
  each followed by its `param_alignment_paddings` entry (when saved).
- Stage 3: every param is split into `ceil(numel / world)` elements per rank, stored at
  the same offset of every rank's flat vector (`fp32_flat_groups`, concatenated over
  groups); the full param is rank 0's piece, rank 1's, ... cut to `numel`.

Only the location of every piece is computed here (the pickles are read with their
tensors as `TensorRef`s, no data); the copy happens one tensor at a time later.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...orchestrator.errors import CheckpointError
from .io import Segment, SourceTensor, segments_of_ref
from .torchzip import TensorRef, load_refs


def _natural(path: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


class _FlatVector:
    """Several stored 1-D tensors seen as one concatenated vector."""

    def __init__(self, parts: list[TensorRef]) -> None:
        self.parts = parts
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + p.numel)

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def segments(self, start: int, numel: int) -> list[Segment]:
        out: list[Segment] = []
        if start + numel > self.numel:
            raise CheckpointError(
                f"{self.parts[0].path}: a parameter needs elements {start}..{start + numel} "
                f"of a flat partition of only {self.numel}"
            )
        for i, part in enumerate(self.parts):
            lo, hi = self.starts[i], self.starts[i + 1]
            a, b = max(start, lo), min(start + numel, hi)
            if a < b:
                out.append(segments_of_ref(part, a - lo, b - a))
        return out


def _load(path: Path) -> Any:
    return load_refs(path, trusted=True)


def _optimizer_partitions(
    ds_dir: Path, optim_files: list[Path]
) -> tuple[list[tuple[Path, dict]], int, int]:
    """Every rank's optimizer state dict, the ZeRO stage and the partition count (checked
    against the number of files)."""
    optim = []
    for f in optim_files:
        sd = _load(f).get("optimizer_state_dict")
        if not isinstance(sd, dict) or not (
            "zero_stage" in sd or "single_partition_of_fp32_groups" in sd
        ):
            raise CheckpointError(f"{f} is not a ZeRO optimizer state file (no fp32 partitions)")
        optim.append((f, sd))
    # bf16 without ZeRO (stage 0) uses DeepSpeed's BF16_Optimizer, which partitions its
    # fp32 masters exactly like stage 1 but records no zero_stage.
    stage = int(optim[0][1].get("zero_stage", 0))
    world = optim[0][1]["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(optim):
        raise CheckpointError(
            f"{ds_dir}: the optimizer was partitioned over {world} ranks but there are "
            f"{len(optim)} *_optim_states.pt files — a rank's file is missing or left over"
        )
    return optim, stage, world


def deepspeed_tensors(ds_dir: Path) -> tuple[list[SourceTensor], dict[str, str], list[str]]:
    """The fp32 master weights (plus buffers and frozen params) as SourceTensors.

    Returns (tensors, shared, notes) where `shared` maps a tied parameter's name to the
    name of the parameter it shares storage with (lm_head.weight → model.embed_tokens.weight).
    """
    optim_files = sorted(ds_dir.glob("*_optim_states.pt"), key=_natural)
    model_files = sorted(ds_dir.glob("*_model_states.pt"), key=_natural)
    if not model_files:
        found = sorted(p.name for p in ds_dir.iterdir()) if ds_dir.is_dir() else "no folder"
        raise CheckpointError(
            f"{ds_dir} is not a DeepSpeed checkpoint: it has no *_model_states.pt file "
            f"(found {found})"
        )
    if not optim_files:
        # No ZeRO optimizer (stage 0 in fp32): the module weights are the trained weights.
        return _module_weights(model_files[0])
    optim, stage, world = _optimizer_partitions(ds_dir, optim_files)
    # Stage 3 writes one model-states file per rank; param shapes are the same in each.
    model_file = model_files[0]
    model = _load(model_file)
    for key in ("module", "param_shapes", "buffer_names"):
        if key not in model:
            raise CheckpointError(f"{model_file} is not a DeepSpeed model-states file (no {key})")

    tensors: list[SourceTensor] = []
    module: dict[str, Any] = model["module"] or {}
    for name in model["buffer_names"] or []:
        ref = module.get(name)
        if isinstance(ref, TensorRef):
            tensors.append(_whole(name, ref, model_file))
    tensors += _frozen(model, model_files, stage, world)
    if stage <= 2:
        tensors += _stage12(model["param_shapes"], optim, world)
    elif stage == 3:
        tensors += _stage3(model["param_shapes"], optim)
    else:
        raise CheckpointError(f"{optim_files[0]}: unknown ZeRO stage {stage}")
    shared = {str(k): str(v) for k, v in (model.get("shared_params") or {}).items()}
    return tensors, shared, []


def _module_weights(model_file: Path) -> tuple[list[SourceTensor], dict[str, str], list[str]]:
    model = _load(model_file)
    module = model.get("module") if isinstance(model, dict) else None
    if not isinstance(module, dict):
        raise CheckpointError(f"{model_file} is not a DeepSpeed model-states file (no module)")
    tensors = [_whole(str(k), v, model_file) for k, v in module.items() if isinstance(v, TensorRef)]
    shared = {str(k): str(v) for k, v in (model.get("shared_params") or {}).items()}
    for alias in shared:  # the module state dict holds tied weights under both names
        tensors = [t for t in tensors if t.name != alias]
    notes = []
    optimizer = model.get("optimizer")
    if isinstance(optimizer, dict) and "fp32_groups" in optimizer:
        # Without ZeRO, DeepSpeed's bf16/fp16 optimizer keeps its fp32 masters as bare
        # lists in optimizer order, with no names to map them back reliably.
        dtypes = sorted({t.dtype for t in tensors})
        notes.append(
            f"DeepSpeed without ZeRO (stage 0) stores its fp32 master weights unnamed; "
            f"the module weights ({', '.join(dtypes)}) were written instead"
        )
    return tensors, shared, notes


def _whole(name: str, ref: TensorRef, file: Path) -> SourceTensor:
    if ref.contiguous:
        return SourceTensor(
            name, ref.shape, ref.dtype, segments=[segments_of_ref(ref, 0, ref.numel)]
        )
    raise CheckpointError(f"{file}: {name} is stored non-contiguously")


def _frozen(model: dict, model_files: list[Path], stage: int, world: int) -> list[SourceTensor]:
    shapes = model.get("frozen_param_shapes") or {}
    if not shapes:
        return []
    out = []
    if stage <= 2:
        fragments = model.get("frozen_param_fragments") or {}
        for name, shape in shapes.items():
            ref = fragments[name]
            out.append(
                SourceTensor(
                    name, tuple(shape), ref.dtype, [segments_of_ref(ref, 0, math.prod(shape))]
                )
            )
        return out
    per_rank = [_load(f).get("frozen_param_fragments") or {} for f in model_files[:world]]
    for name, shape in shapes.items():
        numel, segs, got = math.prod(shape), [], 0
        for frags in per_rank:
            ref = frags[name]
            take = min(ref.numel, numel - got)
            if take > 0:
                segs.append(segments_of_ref(ref, 0, take))
                got += take
        out.append(SourceTensor(name, tuple(shape), segs[0].dtype, segs))
    return out


def _stage12(
    param_shapes: list[dict], optim: list[tuple[Path, dict]], world: int, state: str = "fp32"
) -> list[SourceTensor]:
    key = "single_partition_of_fp32_groups"
    per_rank = []
    for f, sd in optim:
        if key not in sd:
            raise CheckpointError(f"{f}: no {key} (not a ZeRO-1/2 optimizer state)")
        per_rank.append(
            sd[key] if state == "fp32" else _moments(f, sd, "base_optimizer_state", state)
        )
    paddings = optim[0][1].get("param_alignment_paddings")
    tensors = []
    for g, shapes in enumerate(param_shapes):
        # The group's flat vector is the concatenation of every rank's partition.
        flat = _FlatVector([per_rank[r][g] for r in range(world)])
        offset = 0
        group_pad = paddings[g] if paddings is not None else None
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            segs = flat.segments(offset, numel)
            tensors.append(
                SourceTensor(name, tuple(shape), segs[0].dtype if segs else "float32", segs)
            )
            offset += numel + (group_pad[i] if group_pad is not None else 0)
        # DeepSpeed pads each group to a multiple of 2 * world_size elements.
        align = 2 * world
        if math.ceil(offset / align) * align != math.ceil(flat.numel / align) * align:
            raise CheckpointError(
                f"{optim[0][0]}: parameter group {g} holds {flat.numel} elements but its "
                f"parameters need {offset} — the checkpoint does not match its param_shapes"
            )
    return tensors


def _stage3(
    param_shapes: list[dict], optim: list[tuple[Path, dict]], state: str = "fp32"
) -> list[SourceTensor]:
    key = "fp32_flat_groups"
    ranks = []
    for f, sd in optim:
        if key not in sd:
            raise CheckpointError(f"{f}: no {key} (not a ZeRO-3 optimizer state)")
        parts = sd[key] if state == "fp32" else _moments(f, sd, "optimizer_state_dict", state)
        ranks.append(_FlatVector(list(parts)))
    world = len(ranks)
    offset = 0
    tensors = []
    merged = {name: shape for shapes in param_shapes for name, shape in shapes.items()}
    for name, shape in merged.items():
        numel = math.prod(shape)
        per_rank = math.ceil(numel / world)
        segs: list[Segment] = []
        left = numel
        for flat in ranks:
            take = min(per_rank, left)
            if take > 0:
                segs += flat.segments(offset, take)
            left -= take
        tensors.append(SourceTensor(name, tuple(shape), segs[0].dtype if segs else "float32", segs))
        offset += per_rank
    if offset != ranks[0].numel:
        raise CheckpointError(
            f"{optim[0][0]}: the flat partition holds {ranks[0].numel} elements per rank but "
            f"the parameters need {offset} — the checkpoint does not match its param_shapes"
        )
    return tensors


def _moments(f: Path, sd: dict, where: str, state: str) -> list[TensorRef]:
    """One optimizer state (exp_avg, exp_avg_sq) of every flat group of a rank's file:
    the base optimizer holds it per flat partition, laid out exactly like the masters."""
    inner = sd.get(where)
    per_group = inner.get("state") if isinstance(inner, dict) else None
    if not isinstance(per_group, dict) or not per_group:
        raise CheckpointError(
            f"{f}: no optimizer state ({where}.state is empty: saved before the first step?)"
        )
    out = []
    for g in sorted(per_group):
        ref = per_group[g].get(state) if isinstance(per_group[g], dict) else None
        if not isinstance(ref, TensorRef):
            known = sorted(per_group[g]) if isinstance(per_group[g], dict) else []
            raise CheckpointError(
                f"{f}: flat group {g} has no {state!r} (its optimizer state holds {known}); "
                "only Adam/AdamW state (exp_avg, exp_avg_sq, step) can be converted"
            )
        out.append(ref)
    return out


@dataclass
class ZeroOptimizerState:
    """A ZeRO 1/2/3 checkpoint's full per-parameter training state, as SourceTensors."""

    stage: int
    world_size: int
    groups: list[list[str]]  # parameter names of every optimizer param group, in order
    hyper: list[dict[str, Any]]  # every group's hyperparameters (lr, betas, weight_decay ...)
    steps: dict[str, float]  # Adam's step count of every parameter
    master: dict[str, SourceTensor]  # fp32 masters
    exp_avg: dict[str, SourceTensor]
    exp_avg_sq: dict[str, SourceTensor]
    buffers: list[SourceTensor]
    shared: dict[str, str]  # a tied parameter's second name → the name its data is saved as


def deepspeed_optimizer_state(ds_dir: Path) -> ZeroOptimizerState:
    """fp32 masters, Adam moments and step counts of every trainable parameter."""
    optim_files = sorted(ds_dir.glob("*_optim_states.pt"), key=_natural)
    model_files = sorted(ds_dir.glob("*_model_states.pt"), key=_natural)
    if not model_files or not optim_files:
        raise CheckpointError(
            f"{ds_dir} holds no ZeRO optimizer partitions (*_optim_states.pt): only DeepSpeed "
            "ZeRO stage 1, 2 or 3 checkpoints can be converted"
        )
    optim, stage, world = _optimizer_partitions(ds_dir, optim_files)
    if stage not in (1, 2, 3):
        raise CheckpointError(f"{optim_files[0]}: ZeRO stage {stage}; only 1, 2 and 3 convert")
    model = _load(model_files[0])
    if model.get("frozen_param_shapes"):
        raise CheckpointError(
            f"{model_files[0]}: the model has frozen parameters; their conversion is not "
            "supported (they have no optimizer state)"
        )
    shapes: list[dict] = model["param_shapes"]
    inner = optim[0][1]["base_optimizer_state" if stage <= 2 else "optimizer_state_dict"]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
    groups, steps = _groups_and_steps(optim_files[0], shapes, inner)
    per_kind = {}
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        found = _stage12(shapes, optim, world, kind) if stage <= 2 else _stage3(shapes, optim, kind)
        per_kind[kind] = {t.name: t for t in found}
    module: dict[str, Any] = model["module"] or {}
    buffers = [
        _whole(name, module[name], model_files[0])
        for name in model["buffer_names"] or []
        if isinstance(module.get(name), TensorRef)
    ]
    return ZeroOptimizerState(
        stage=stage,
        world_size=world,
        groups=groups,
        hyper=hyper,
        steps=steps,
        master=per_kind["fp32"],
        exp_avg=per_kind["exp_avg"],
        exp_avg_sq=per_kind["exp_avg_sq"],
        buffers=buffers,
        shared={str(k): str(v) for k, v in (model.get("shared_params") or {}).items()},
    )


def _groups_and_steps(
    path: Path, shapes: list[dict], inner: dict[str, Any]
) -> tuple[list[list[str]], dict[str, float]]:
    """Parameter names per optimizer param group, and Adam's step count per name.

    `param_shapes` and the base optimizer's state are per flat group. Below ZeRO-3 that
    is one per param group; ZeRO-3 cuts each param group into sub-groups of at most
    `sub_group_size` elements, and `param_groups[g]["params"]` lists the sub-groups
    (their state indices) that belong to param group g."""
    param_groups, states = inner["param_groups"], inner["state"]
    owner = {int(i): g for g, group in enumerate(param_groups) for i in group.get("params", [])}
    if sorted(owner) != list(range(len(shapes))) or set(owner) - set(map(int, states)):
        raise CheckpointError(
            f"{path}: the optimizer's param groups list flat groups {sorted(owner)}, but the "
            f"model has {len(shapes)} — the checkpoint does not match itself"
        )
    groups: list[list[str]] = [[] for _ in param_groups]
    steps: dict[str, float] = {}
    for flat, names in enumerate(shapes):
        groups[owner[flat]] += list(names)
        step = _scalar(states[flat]["step"]) if "step" in states[flat] else 0.0
        steps.update(dict.fromkeys(names, step))
    return groups, steps


def _scalar(value: Any) -> float:
    from .io import read_scalar

    return read_scalar(value) if isinstance(value, TensorRef) else float(value)
