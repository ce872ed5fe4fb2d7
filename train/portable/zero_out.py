"""Write a `PortableState` as DeepSpeed's own ZeRO 1/2/3 checkpoint files, directly.

One process, no process group, no engine: the files an engine of the target stage,
world size and precision would save (`engine.save_checkpoint`) are written record by
record, every tensor's bytes streamed from the source checkpoint into its place in
the output in blocks (`torchsave_out.save_file`). Memory stays flat in the model size;
the engine way (`ds_out.py`) held the whole fp32 state in N rank processes.

What is written, per DeepSpeed's `engine.py` / `stage_1_and_2.py` / `stage3.py` (the
layout arithmetic is `zero_layout.py`):

- the model states: ZeRO 1/2 one `mp_rank_00_model_states.pt` with the whole module
  state dict (the low-precision copy of the masters: fp32, or bf16 under bf16-mixed);
  ZeRO 3 one `zero_pp_rank_R_mp_rank_00_model_states.pt` per rank, whose parameters
  are empty (the weights live in the optimizer partitions) — plus the buffers, the
  parameter shapes per flat group, the tied names (`shared_params`, rank 0), the
  engine's counters and config;
- per rank `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`: the rank's flat fp32
  masters per flat group and the torch AdamW state over them (moments and step), with
  DeepSpeed's bookkeeping (paddings, partition counts, the parameters' fragments);
- beside them, as `save_checkpoint` does: `latest` and DeepSpeed's recovery scripts.

`tests/test_ds_direct.py` compares every file, key by key, with what the engine writes
from the same state, and resumes training from both.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import stat
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...orchestrator.errors import CheckpointError
from ..consolidate.io import ITEMSIZE, Segment, SourceTensor
from .pickle_out import Global, NewObj, Reduce
from .state import MOMENTS, PortableState, row_major_segments
from .torchsave_out import BLOCK_BYTES, Stored, cast_blocks, read_blocks, save_file
from .zero_layout import (
    SUB_GROUP_SIZE,
    Piece,
    zero3_per_rank,
    zero3_pieces,
    zero3_sub_groups,
    zero12_slice,
)

TAG = "deepspeed"  # the sub-folder the DeepSpeed backend reads (backends/deepspeed.py)
# DeepSpeed versions whose files this writer was compared against, key by key; another
# version is written through its engine (`ds_out.py`), whose layout is its own.
CHECKED_VERSIONS = ("0.19.",)
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")

_ORDERED = Global("collections", "OrderedDict")
_STAGE = Global("deepspeed.runtime.zero.config", "ZeroStageEnum")
_FRAGMENT = Global("deepspeed.utils.tensor_fragment", "fragment_address")
# What a ZeRO optimizer without fp16 keeps (bf16 and fp32 alike): a static scale of 1.
_LOSS_SCALER = NewObj(
    Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    {"cur_scale": 1.0, "dynamic": False},
)
_GRADIENT_CLIPPING = 1.0  # DeepSpeed's default; the engine that wrote the files had it


def deepspeed_version() -> str | None:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def unsupported(state: PortableState, version: str | None) -> str | None:
    """Why the direct writer cannot write `state` for DeepSpeed `version` (None: it can)."""
    if version is None:
        return "the deepspeed package is not installed (the files name its version)"
    if not version.startswith(CHECKED_VERSIONS):
        return (
            f"DeepSpeed {version}: the direct writer knows the ZeRO file layout of "
            f"{', '.join(v + 'x' for v in CHECKED_VERSIONS)}"
        )
    for g, names in enumerate(state.groups):
        if not names:
            return f"optimizer param group {g} has no parameters"
    empty = [n for n in state.names if state.master[n].numel == 0]
    if empty:
        return f"parameter {empty[0]} has no elements (DeepSpeed keeps those with the frozen ones)"
    for g, hyper in enumerate(state.hyper):
        for key, value in hyper.items():
            if not _plain(value):
                return f"param group {g}'s {key} is a {type(value).__name__}"
    return None


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    return isinstance(value, dict) and all(_plain(k) and _plain(v) for k, v in value.items())


@dataclass(frozen=True)
class Target:
    """The engine the files are for: ZeRO stage, world size, precision, its config."""

    stage: int
    world_size: int
    precision: str  # fp32 | bf16-mixed
    step: int
    config: dict[str, Any]
    version: str
    sub_group_size: int = SUB_GROUP_SIZE

    @property
    def bit16(self) -> str:
        """The dtype of the module's own weights."""
        return "bfloat16" if self.precision == "bf16-mixed" else "float32"


def write_zero(state: PortableState, out: Path, target: Target, tag: str = TAG) -> dict[str, str]:
    """`out/<tag>/` (created) with every file of the target engine's checkpoint, and
    `latest` + the recovery scripts in `out`; returns the sha256 of the written state
    files by path relative to `out`. The tag is the folder the loader asks for: shardctl's
    `deepspeed`, accelerate's `pytorch_model`, the Trainer's `global_stepN`."""
    ds_dir = out / tag
    ds_dir.mkdir(parents=True, exist_ok=False)
    writer = _Writer(state, target)
    hashes: dict[str, str] = {}
    for name, obj in writer.files():
        hashes[f"{tag}/{name}"] = save_file(ds_dir / name, obj)
    (out / "latest").write_text(tag)
    _copy_recovery_scripts(out)
    return hashes


def _copy_recovery_scripts(out: Path) -> None:
    """`save_checkpoint` puts DeepSpeed's `zero_to_fp32.py` beside every checkpoint."""
    spec = importlib.util.find_spec("deepspeed")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        return
    utils = Path(next(iter(spec.submodule_search_locations))) / "utils"
    for script in RECOVERY_SCRIPTS:
        if (utils / script).is_file():
            shutil.copyfile(utils / script, out / script)
            os.chmod(out / script, (out / script).stat().st_mode | stat.S_IEXEC)  # as DeepSpeed


# --------------------------------------------------------------------------- objects


def _ordered(pairs: Iterable[tuple[Any, Any]]) -> Reduce:
    return Reduce(_ORDERED, ([tuple(p) for p in pairs],))


def _size(shape: tuple[int, ...]) -> Reduce:
    return Reduce(Global("torch", "Size"), (tuple(shape),))


class _Writer:
    """The objects of every file; tensors as `Stored`, read when their file is written."""

    def __init__(self, state: PortableState, target: Target) -> None:
        self.state, self.t = state, target
        self.hyper = _adamw_groups(state.hyper)
        self.numel = {n: state.master[n].numel for n in state.names}
        self.keys = _state_dict_order(state)  # the module state dict's names, in order
        self._segments: dict[tuple[str, str], list[Segment]] = {}
        # ZeRO-3 flat groups: every param group cut into sub-groups (index → owner group).
        self.sub_groups: list[list[str]] = []
        self.sub_group_of: list[int] = []
        if target.stage == 3:
            for g, names in enumerate(state.groups):
                for sub in zero3_sub_groups(
                    [(n, self.numel[n]) for n in names], target.world_size, target.sub_group_size
                ):
                    self.sub_groups.append([n for n, _ in sub])
                    self.sub_group_of.append(g)

    def files(self) -> Iterator[tuple[str, Any]]:
        t = self.t
        if t.stage == 3:
            for rank in range(t.world_size):
                yield f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", self.model_states(rank)
        else:
            yield "mp_rank_00_model_states.pt", self.model_states(0)
        prefix = "bf16_" if t.precision == "bf16-mixed" else ""
        for rank in range(t.world_size):
            name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            yield name, self.optim_states(rank)

    # --- model states

    def model_states(self, rank: int) -> dict[str, Any]:
        s, t = self.state, self.t
        flat = self.sub_groups if t.stage == 3 else s.groups
        frozen = _ordered([]) if t.stage >= 2 else None  # saved from ZeRO-2 on, empty here
        return {
            "module": _ordered((key, self._module_entry(key)) for key in self.keys),
            "buffer_names": [k for k in self.keys if k in s.buffers],
            "optimizer": None,
            "param_shapes": [
                _ordered((n, _size(s.master[n].shape)) for n in names) for names in flat
            ],
            "frozen_param_shapes": frozen,
            "shared_params": self._shared() if rank == 0 else {},
            "frozen_param_fragments": frozen,
            "lr_scheduler": None,
            "data_sampler": None,
            "random_ltd": None,
            "skipped_steps": 0,
            "global_steps": t.step,
            "global_samples": 0,
            "dp_world_size": t.world_size,
            "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": t.config,
            "ds_version": t.version,
        }

    def _module_entry(self, key: str) -> Stored:
        s, t = self.state, self.t
        if key in s.buffers:  # buffers keep their dtype (DeepSpeed casts parameters only)
            src = s.buffers[key]
            return Stored(src.dtype, src.shape, lambda: self._whole(src, src.dtype))
        src = s.master[s.shared.get(key, key)]
        if t.stage == 3:  # a partitioned parameter saves as an empty tensor
            return Stored(t.bit16, (0,), lambda: [])
        return Stored(t.bit16, src.shape, lambda: self._whole(src, t.bit16))

    def _shared(self) -> dict[str, str]:
        """Tied names as DeepSpeed finds them walking the module: the first name of a
        parameter holds it, every later one is shared."""
        first: dict[str, str] = {}
        shared: dict[str, str] = {}
        for key in self.keys:
            if key in self.state.buffers:
                continue
            param = self.state.shared.get(key, key)
            if param in first:
                shared[key] = first[param]
            else:
                first[param] = key
        return shared

    # --- optimizer states

    def optim_states(self, rank: int) -> dict[str, Any]:
        inner = self._zero3(rank) if self.t.stage == 3 else self._zero12(rank)
        return {
            "optimizer_state_dict": inner,
            "ds_config": self.t.config,
            "ds_version": self.t.version,
        }

    def _adam(self, pieces: list[Piece], numel: int, step: float) -> dict[str, Stored]:
        return {
            "step": Stored("float32", (), lambda: [struct.pack("<f", step)]),
            **{k: Stored("float32", (numel,), self._blocks(pieces, k)) for k in MOMENTS},
        }

    def _zero12(self, rank: int) -> dict[str, Any]:
        s, t = self.state, self.t
        state: dict[int, Any] = {}
        groups, masters, paddings, mappings = [], [], [], []
        for g, names in enumerate(s.groups):
            part = zero12_slice([(n, self.numel[n]) for n in names], t.world_size, rank)
            state[g] = self._adam(part.pieces, part.numel, s.steps[names[0]])
            groups.append({**self.hyper[g], "params": [g]})
            # The masters are saved without the padding, the moments with it.
            real = [p for p in part.pieces if p.name is not None]
            masters.append(
                Stored("float32", (part.numel - part.padding,), self._blocks(real, "master"), True)
            )
            paddings.append(part.padding)
            fragments = [
                (f.name, NewObj(_FRAGMENT, {"numel": f.numel, "start": f.start}))
                for f in part.fragments
            ]
            mappings.append(_ordered(fragments))
        return {
            "loss_scaler": _LOSS_SCALER,
            "dynamic_loss_scale": False,
            "overflow": False,
            "clip_grad": _GRADIENT_CLIPPING,
            "base_optimizer_state": {"state": state, "param_groups": groups},
            "single_partition_of_fp32_groups": masters,
            "zero_stage": Reduce(_STAGE, (t.stage,)),
            "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(names) for names in s.groups],
            "partition_count": [t.world_size] * len(s.groups),
            "ds_version": t.version,
            "param_slice_mappings": mappings,
        }

    def _zero3(self, rank: int) -> dict[str, Any]:
        s, t = self.state, self.t
        order = {key: i for i, key in enumerate(self.keys)}
        state: dict[int, Any] = {}
        flats = []
        members: list[list[int]] = [[] for _ in s.groups]
        for i, names in enumerate(self.sub_groups):
            sizes = [(n, self.numel[n]) for n in names]
            pieces = zero3_pieces(sizes, t.world_size, rank)
            numel = sum(zero3_per_rank(n, t.world_size) for _, n in sizes)
            # Adam's step: that of the sub-group's first parameter in the module's order.
            step = s.steps[min(names, key=lambda n: order.get(n, len(order)))]
            state[i] = self._adam(pieces, numel, step)
            flats.append(Stored("float32", (numel,), self._blocks(pieces, "master"), True))
            members[self.sub_group_of[i]].append(i)
        groups = [{**self.hyper[g], "params": members[g]} for g in range(len(s.groups))]
        return {
            "zero_stage": Reduce(_STAGE, (3,)),
            "loss_scaler": _LOSS_SCALER,
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": t.world_size,
            "optimizer_state_dict": {"state": state, "param_groups": groups},
            "fp32_flat_groups": flats,
        }

    # --- bytes

    def _source(self, kind: str, name: str) -> SourceTensor:
        return self.state.master[name] if kind == "master" else self.state.moments[kind][name]

    def _whole(self, src: SourceTensor, dtype: str) -> Iterator[bytes | bytearray]:
        return _convert(row_major_segments(src), src.dtype, dtype)

    def _blocks(self, pieces: list[Piece], kind: str) -> Callable[[], Iterator[bytes | bytearray]]:
        """The fp32 bytes of `pieces` of tensor `kind` (master, exp_avg, exp_avg_sq)."""

        def blocks() -> Iterator[bytes | bytearray]:
            for piece in pieces:
                if piece.name is None:
                    yield from _zeros(piece.numel * ITEMSIZE["float32"])
                    continue
                src = self._source(kind, piece.name)
                key = (kind, piece.name)
                if key not in self._segments:
                    self._segments = {key: row_major_segments(src)}  # one tensor's at a time
                part = _narrow(self._segments[key], piece.start, piece.numel)
                yield from _convert(part, src.dtype, "float32")

        return blocks


def _convert(segments: list[Segment], src: str, dst: str) -> Iterator[bytes | bytearray]:
    return read_blocks(segments) if src == dst else cast_blocks(segments, src, dst)


def _zeros(nbytes: int) -> Iterator[bytes]:
    while nbytes > 0:
        n = min(nbytes, BLOCK_BYTES)
        yield bytes(n)
        nbytes -= n


def _narrow(segments: list[Segment], start: int, numel: int) -> list[Segment]:
    """Elements [start, start + numel) of the tensor `segments` hold, in order."""
    out: list[Segment] = []
    at = 0
    for seg in segments:
        a, b = max(start, at), min(start + numel, at + seg.numel)
        if a < b:
            size = ITEMSIZE[seg.dtype]
            out.append(Segment(seg.path, seg.offset + (a - at) * size, b - a, seg.dtype))
        at += seg.numel
    if sum(s.numel for s in out) != numel:
        raise CheckpointError(
            f"{segments[0].path if segments else 'a tensor'}: elements {start}..{start + numel} "
            f"are outside the stored {at}"
        )
    return out


def _adamw_groups(hyper: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group's hyperparameters as torch's AdamW keeps them (its defaults filled in,
    in its order): what the engine's optimizer saved."""
    import torch

    groups = [{**h, "params": [torch.zeros(1, requires_grad=True)]} for h in hyper]
    packed = torch.optim.AdamW(groups).state_dict()["param_groups"]
    return [{k: v for k, v in g.items() if k != "params"} for g in packed]


def _state_dict_order(state: PortableState) -> list[str]:
    """The names of the module state dict of the stand-in module the engine way builds
    (`ds_out.stand_in_module`: parameters, then tied names, then buffers, each creating
    the submodules on its path): a module's own parameters, its own buffers, then its
    children's, depth first, in creation order."""

    @dataclass
    class Node:
        params: list[str]
        buffers: list[str]
        children: dict[str, Node]

    root = Node([], [], {})

    def add(name: str, kind: str) -> None:
        node = root
        for part in name.split(".")[:-1]:
            node = node.children.setdefault(part, Node([], [], {}))
        (node.params if kind == "param" else node.buffers).append(name)

    for name in [*state.names, *state.shared]:
        add(name, "param")
    for name in state.buffers:
        add(name, "buffer")

    def walk(node: Node) -> Iterator[str]:
        yield from node.params
        yield from node.buffers
        for child in node.children.values():
            yield from walk(child)

    return list(walk(root))
