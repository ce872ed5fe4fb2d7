"""Write a `PortableState` as the DCP folder an FSDP run resumes from.

The state dict has the exact nesting FSDP's own save produces (`{"model": {fqn:
tensor}, "optim": {"state": {fqn: {exp_avg, exp_avg_sq, step}}, "param_groups":
[...]}}`), flattened to the same keys, so a run loads it with its usual
`set_model_state_dict`/`set_optimizer_state_dict` on any world size.

The direct writer (`write_dcp`) needs no torch: `.metadata` and the records are
written as DCP writes them (`pickle_out`, `torchsave_out`), the tensor bytes go
from the source files to the output in blocks, and the output is hashed while it
is written. Only a precision change (torch rounds) or a record of 4 GiB or more
(ZIP64) imports torch; the latter is left to DCP itself (`write_dcp_with_torch`:
placeholders on the meta device, each tensor read when the writer asks for it).
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from pathlib import Path
from typing import Any

from ..consolidate.io import SourceTensor, _torch_dtype
from .pickle_out import Global, NewObj, Pairs, Reduce, dumps
from .state import MOMENTS, PortableState, materialize, row_major_segments
from .torchsave_out import (
    HashedFile,
    TooLarge,
    cast_blocks,
    object_record,
    read_blocks,
    tensor_record,
)

DATA_FILE = "__0_0.distcp"
METADATA_FILE = ".metadata"
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint's CURRENT_DCP_VERSION (tested)
_MD = "torch.distributed.checkpoint.metadata"


def _items(
    state: PortableState, model_key: str | None = "model", optim_key: str | None = "optim"
) -> list[tuple[str, tuple, Any]]:
    """(flat key, its path in the nested state dict, a SourceTensor / step / value).
    A key of None leaves that part out (accelerate keeps model and optimizer in two
    DCP folders: `{"model": ...}` and `{"optimizer": ...}`)."""
    items: list[tuple[str, tuple, Any]] = []
    o = optim_key
    for i, (hyper, names) in enumerate(zip(state.hyper, state.groups, strict=True)):
        if o is None:
            break
        for key, value in {**hyper, "params": list(names)}.items():
            items.append((f"{o}.param_groups.{i}.{key}", (o, "param_groups", i, key), value))
    if model_key is not None:
        for name, src in [*state.master.items(), *state.buffers.items()]:
            items.append((f"{model_key}.{name}", (model_key, name), src))
    for name in state.names if o is not None else []:
        for kind in MOMENTS:
            src = state.moments[kind][name]
            items.append((f"{o}.state.{name}.{kind}", (o, "state", name, kind), src))
        # Adam keeps its step as a float32 scalar tensor per parameter.
        items.append((f"{o}.state.{name}.step", (o, "state", name, "step"), state.steps[name]))
    return items


def _tensor_md(dtype: str, shape: tuple[int, ...]) -> NewObj:
    size = Reduce(Global("torch", "Size"), (tuple(shape),))
    properties = NewObj(
        Global(_MD, "TensorProperties"),
        (
            Global("torch", dtype),
            Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",)),
            False,
            Reduce(Global(_MD, "_MEM_FORMAT_ENCODING"), (0,)),  # contiguous
            False,
        ),
    )
    zeros = Reduce(Global("torch", "Size"), ((0,) * len(shape),))
    chunk = NewObj(Global(_MD, "ChunkStorageMetadata"), {"offsets": zeros, "sizes": size})
    return NewObj(
        Global(_MD, "TensorStorageMetadata"),
        {"properties": properties, "size": size, "chunks": [chunk]},
    )


def write_dcp(
    state: PortableState,
    out_dir: Path,
    dtype: str | None = None,
    model_key: str | None = "model",
    optim_key: str | None = "optim",
) -> dict[str, str]:
    """`out_dir` (created) gets `.metadata` and one `.distcp` file; returns their sha256
    by name. Floating tensors are written as `dtype` when given, else as stored.
    `model_key`/`optim_key`: the top-level keys of the two parts (None: left out)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    items = _items(state, model_key, optim_key)
    if all(_plain(v) for _key, _path, v in items if not isinstance(v, SourceTensor)):
        try:
            return _write_direct(items, out_dir, dtype, optim_key)
        except TooLarge:  # a record needs ZIP64
            for name in (DATA_FILE, METADATA_FILE):
                (out_dir / name).unlink(missing_ok=True)
    write_dcp_with_torch(state, out_dir, dtype, model_key, optim_key)
    return {}


def _plain(value: Any) -> bool:
    """A value the torch-free pickle writes as torch.save would (param-group entries)."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _write_direct(
    items: list[tuple[str, tuple, Any]], out_dir: Path, dtype: str | None, optim_key: str | None
):
    out = HashedFile(out_dir / DATA_FILE)
    entries: list[tuple[Any, Any]] = []  # (MetadataIndex, _StorageInfo)
    state_md: dict[str, Any] = {}
    try:
        for key, _path, value in items:
            if isinstance(value, SourceTensor):
                target = value.out_dtype(dtype) if dtype else value.dtype
                segs = row_major_segments(value)
                blocks = (
                    read_blocks(segs)
                    if target == value.dtype
                    else cast_blocks(segs, value.dtype, target)
                )
                where = tensor_record(out, target, value.shape, blocks)
                state_md[key] = _tensor_md(target, value.shape)
                offset: Any = Reduce(Global("torch", "Size"), ((0,) * len(value.shape),))
                index = {"fqn": key, "offset": offset, "index": 0}
            elif optim_key is not None and key.startswith(f"{optim_key}.state."):  # a step
                where = tensor_record(out, "float32", (), [struct.pack("<f", float(value))])
                state_md[key] = _tensor_md("float32", ())
                index = {"fqn": key, "offset": Reduce(Global("torch", "Size"), ((),)), "index": 0}
            else:
                where = object_record(out, value)
                state_md[key] = NewObj(Global(_MD, "BytesStorageMetadata"))
                index = {"fqn": key, "index": None}
            info = {"relative_path": DATA_FILE, "offset": where[0], "length": where[1]}
            entries.append(
                (
                    NewObj(Global(_MD, "MetadataIndex"), index),
                    NewObj(Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"), info),
                )
            )
    except BaseException:
        out.abort()
        raise
    digest = out.close()
    metadata = NewObj(
        Global(_MD, "Metadata"),
        {
            "state_dict_metadata": state_md,
            "planner_data": {key: path for key, path, _ in items},
            "storage_data": Pairs(tuple(entries)),
            "storage_meta": None,
            "version": DCP_VERSION,
        },
    )
    raw = dumps(metadata)
    (out_dir / METADATA_FILE).write_bytes(raw)
    return {DATA_FILE: digest, METADATA_FILE: hashlib.sha256(raw).hexdigest()}


def write_dcp_with_torch(
    state: PortableState,
    out_dir: Path,
    dtype: str | None,
    model_key: str | None = "model",
    optim_key: str | None = "optim",
) -> None:
    """The same folder, written by DCP itself (records of 4 GiB or more need ZIP64)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItemType

    sources: dict[str, SourceTensor] = {}

    def placeholder(key: str, src: SourceTensor) -> Any:
        sources[key] = src
        out = src.out_dtype(dtype) if dtype else src.dtype
        return torch.empty(src.shape, dtype=_torch_dtype(out), device="meta")

    m, o = model_key or "model", optim_key or "optim"
    model = {n: placeholder(f"{m}.{n}", t) for n, t in state.master.items()}
    model.update({n: placeholder(f"{m}.{n}", t) for n, t in state.buffers.items()})
    optim_state: dict[str, Any] = {}
    for name in state.names:
        entry = {k: placeholder(f"{o}.state.{name}.{k}", state.moments[k][name]) for k in MOMENTS}
        # Adam keeps its step as a float32 scalar tensor per parameter.
        entry["step"] = torch.tensor(state.steps[name], dtype=torch.float32)
        optim_state[name] = entry
    groups = [
        {**hyper, "params": list(names)}
        for hyper, names in zip(state.hyper, state.groups, strict=True)
    ]
    state_dict: dict[str, Any] = {}
    if model_key is not None:
        state_dict[model_key] = model
    if optim_key is not None:
        state_dict[optim_key] = {"state": optim_state, "param_groups": groups}

    class _ReadOnDemand(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            key = write_item.index.fqn
            if write_item.type == WriteItemType.BYTE_IO or key not in sources:
                return super().resolve_data(write_item)
            wanted = self.lookup_object(write_item.index)
            dst = str(wanted.dtype).removeprefix("torch.")
            return materialize(sources[key], dst)

    out_dir.mkdir(parents=True, exist_ok=True)
    writer = FileSystemWriter(
        str(out_dir), single_file_per_rank=True, sync_files=False, thread_count=1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state_dict, storage_writer=writer, planner=_ReadOnDemand(), no_dist=True)
