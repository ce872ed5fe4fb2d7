"""Read a torch.distributed.checkpoint (FSDP) folder as a list of SourceTensors.

`.metadata` lists, for every state-dict key, the full shape, dtype and the chunks each
rank saved; `storage_data` says in which `.distcp` file, at which byte offset, each
chunk's `torch.save` stream lies. From that (and the zip directory of each stream) we
know where every byte of every full tensor is without loading anything — so no process
group and no `dcp.load` is needed. FSDP shards along dim 0, so a full tensor is the
concatenation of its chunks' bytes ordered by row offset; chunks split along other
dims (tensor parallel, custom placements) are assembled in memory instead.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...orchestrator.errors import CheckpointError
from .io import Chunk, Segment, SourceTensor, segments_of_ref
from .torchzip import TensorRef, load_refs, torch_global

MODEL_KEY = "model"


@dataclass
class _Tensor:
    shape: tuple[int, ...]
    dtype: str
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]  # (offsets, sizes)


@dataclass
class _Storage:
    relative_path: str
    offset: int
    length: int
    transforms: list[str]


@dataclass
class _Metadata:
    tensors: dict[str, _Tensor]  # flattened DCP key → tensor (non-tensor entries left out)
    storage: dict[tuple[str, tuple[int, ...]], _Storage]  # (key, chunk offsets) → bytes
    planner_data: dict[str, Any]


class _Record:
    """A stand-in for DCP's metadata classes: keeps whatever state the pickle gives."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        obj = super().__new__(cls)
        obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            self.__dict__.update(state[0] or {})  # (dict, slots)
            self.__dict__.update(state[1])
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state


class _MetadataUnpickler(pickle.Unpickler):
    """Reads `.metadata` without importing torch.distributed.checkpoint (seconds of
    imports) and without running arbitrary code: DCP's own classes become `_Record`s;
    besides them only torch dtypes/layouts, torch.Size and paths are allowed."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint"):
            return type(name, (_Record,), {})
        light = torch_global(module, name)
        if light is not None:
            return light
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda text: text
        if (module, name) in (("pathlib", "PosixPath"), ("pathlib", "WindowsPath")):
            return lambda *parts: "/".join(str(p) for p in parts)
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def _from_records(md: Any) -> _Metadata:
    tensors: dict[str, _Tensor] = {}
    for key, item in md.state_dict_metadata.items():
        if type(item).__name__ != "TensorStorageMetadata":
            continue
        props = item.properties
        dtype = props.dtype if hasattr(props, "dtype") else props._state[0]
        tensors[key] = _Tensor(
            shape=tuple(int(s) for s in item.size),
            dtype=str(dtype).removeprefix("torch."),
            chunks=[
                (tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                for c in item.chunks
            ],
        )
    storage = {
        (index.fqn, tuple(int(o) for o in getattr(index, "offset", None) or ())): _Storage(
            info.relative_path,
            int(info.offset),
            int(info.length),
            list(getattr(info, "transform_descriptors", None) or []),
        )
        for index, info in (md.storage_data or {}).items()
    }
    planner = md.planner_data if isinstance(getattr(md, "planner_data", None), dict) else {}
    return _Metadata(tensors, storage, planner)


def read_metadata(dcp_dir: Path) -> _Metadata:
    path = dcp_dir / ".metadata"
    if not path.is_file():
        raise CheckpointError(f"{dcp_dir} is not a DCP checkpoint: it has no .metadata file")
    try:
        data = path.read_bytes()
        try:
            return _from_records(_MetadataUnpickler(io.BytesIO(data)).load())
        except (pickle.UnpicklingError, AttributeError, TypeError, IndexError, KeyError):
            # A metadata layout this reader does not know: let DCP itself read it.
            from torch.distributed.checkpoint import FileSystemReader

            return _from_records(FileSystemReader(str(dcp_dir)).read_metadata())
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, OSError,
            IndexError, KeyError) as exc:  # fmt: skip
        raise CheckpointError(f"{path} is corrupt: {exc}") from exc


def _fqn(key: str, planner_data: dict[str, Any]) -> tuple[str, str] | None:
    """(top-level key, FQN inside it) for a flattened DCP key, e.g. ('model', 'lm_head.weight')."""
    path = planner_data.get(key)
    if path:
        return str(path[0]), ".".join(str(p) for p in path[1:])
    top, _, rest = key.partition(".")
    return (top, rest) if rest else None


def dcp_tensors(dcp_dir: Path, top_key: str | None = MODEL_KEY) -> list[SourceTensor]:
    """The tensors under DCP top-level key `top_key`, named by their FQN inside it;
    `top_key=None`: every tensor outside the known training state (`STATE_KEYS`), named
    by its whole flattened key."""
    md = read_metadata(dcp_dir)
    tensors: list[SourceTensor] = []
    for key, item in md.tensors.items():
        split = _fqn(key, md.planner_data)
        if top_key is None:
            if key.split(".", 1)[0] in STATE_KEYS:
                continue
        elif split is None or split[0] != top_key:
            continue  # other trainer state (optimizer, ...)
        chunks: list[Chunk] = []
        for offsets, sizes in item.chunks:
            info = md.storage.get((key, offsets))
            if info is None:
                raise CheckpointError(
                    f"{dcp_dir}/.metadata: no storage entry for {key} at offsets {list(offsets)}"
                )
            if info.transforms:
                raise CheckpointError(
                    f"{dcp_dir}: {key} was saved through DCP extensions {info.transforms}; "
                    "only plain DCP checkpoints are supported"
                )
            file = dcp_dir / info.relative_path
            ref = load_refs(file, info.offset, info.length, trusted=False)
            if not isinstance(ref, TensorRef) or ref.shape != sizes:
                raise CheckpointError(
                    f"{file}: the item for {key} at offset {info.offset} does not hold a tensor "
                    f"of shape {list(sizes)}"
                )
            if ref.dtype != item.dtype:
                raise CheckpointError(
                    f"{file}: {key} is stored as {ref.dtype}, the metadata says {item.dtype}"
                )
            chunks.append(Chunk(ref, offsets))
        name = key if top_key is None or split is None else split[1]
        tensors.append(_as_source(name, item.shape, item.dtype, chunks))
    return tensors


# Top-level keys of a training state beside the model's (torchtitan, plain scripts):
# a DCP folder without a "model" key keeps its model's FQNs at the top level with these.
STATE_KEYS = {
    "optim", "optimizer", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler",
    "dataloader", "train_state", "rng", "rng_state", "extra_state", "step", "epoch",
}  # fmt: skip


def dcp_model_tensors(dcp_dir: Path, notes: list[str]) -> list[SourceTensor]:
    """The model tensors of a DCP folder another tool wrote: those under its "model" key
    (accelerate, `dcp.save({"model": ..., "optim": ...})`), else every tensor whose
    top-level key is not a known piece of training state (torchtitan saves the model's
    FQNs at the top level), named by its whole key."""
    tensors = dcp_tensors(dcp_dir, MODEL_KEY)
    if tensors:
        return tensors
    tensors = dcp_tensors(dcp_dir, None)
    tops = sorted({key.split(".", 1)[0] for key in read_metadata(dcp_dir).tensors})
    if not tensors:
        raise CheckpointError(
            f"{dcp_dir}: no model tensors: its top-level keys are {tops}; accepted: a "
            f"'{MODEL_KEY}' key, or the model's own names at the top level"
        )
    notes.append(
        f"no '{MODEL_KEY}' key in {dcp_dir.name}: every tensor outside "
        f"{sorted(STATE_KEYS & set(tops))} was taken as the model, by its whole name"
    )
    return tensors


def _as_source(name: str, shape: tuple[int, ...], dtype: str, chunks: list[Chunk]) -> SourceTensor:
    """Byte segments when the chunks are whole rows tiling dim 0; else chunks to assemble."""
    rows_only = all(
        c.ref.contiguous
        and all(o == 0 for o in c.offsets[1:])
        and tuple(c.ref.shape[1:]) == shape[1:]
        for c in chunks
    )
    if rows_only:
        ordered = sorted(chunks, key=lambda c: c.offsets[0] if c.offsets else 0)
        segments: list[Segment] = []
        row = 0
        for c in ordered:
            start = c.offsets[0] if c.offsets else 0
            if start != row:
                break  # a gap or an overlap: let the general path check coverage
            segments.append(segments_of_ref(c.ref, 0, c.ref.numel))
            row += c.ref.shape[0] if c.ref.shape else 1
        else:
            if row == (shape[0] if shape else 1):
                return SourceTensor(name, shape, dtype, segments=segments)
    return SourceTensor(name, shape, dtype, chunks=chunks)
