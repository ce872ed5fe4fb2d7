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

import pickle
from pathlib import Path
from typing import Any

from ..orchestrator.errors import CheckpointError
from .consolidate_io import Chunk, Segment, SourceTensor, segments_of_ref
from .consolidate_torchzip import TensorRef, load_refs

MODEL_KEY = "model"


def read_metadata(dcp_dir: Path) -> Any:
    path = dcp_dir / ".metadata"
    if not path.is_file():
        raise CheckpointError(f"{dcp_dir} is not a DCP checkpoint: it has no .metadata file")
    try:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(str(dcp_dir)).read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, OSError) as exc:
        raise CheckpointError(f"{path} is corrupt: {exc}") from exc


def _fqn(key: str, planner_data: dict[str, Any]) -> tuple[str, str] | None:
    """(top-level key, FQN inside it) for a flattened DCP key, e.g. ('model', 'lm_head.weight')."""
    path = planner_data.get(key)
    if path:
        return str(path[0]), ".".join(str(p) for p in path[1:])
    top, _, rest = key.partition(".")
    return (top, rest) if rest else None


def dcp_tensors(dcp_dir: Path, top_key: str = MODEL_KEY) -> list[SourceTensor]:
    """The tensors under DCP top-level key `top_key`, named by their FQN inside it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    md = read_metadata(dcp_dir)
    planner_data = md.planner_data if isinstance(md.planner_data, dict) else {}
    tensors: list[SourceTensor] = []
    for key, item in md.state_dict_metadata.items():
        split = _fqn(key, planner_data)
        if split is None or split[0] != top_key or not isinstance(item, TensorStorageMetadata):
            continue  # other trainer state, or non-tensor entries (e.g. _extra_state)
        dtype = str(item.properties.dtype).removeprefix("torch.")
        shape = tuple(int(s) for s in item.size)
        chunks: list[Chunk] = []
        for chunk in item.chunks:
            info = md.storage_data.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise CheckpointError(
                    f"{dcp_dir}/.metadata: no storage entry for {key} at offsets "
                    f"{list(chunk.offsets)}"
                )
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{dcp_dir}: {key} was saved through DCP extensions "
                    f"{list(info.transform_descriptors)}; only plain DCP checkpoints are supported"
                )
            file = dcp_dir / info.relative_path
            ref = load_refs(file, info.offset, info.length, trusted=False)
            if not isinstance(ref, TensorRef) or ref.shape != tuple(chunk.sizes):
                raise CheckpointError(
                    f"{file}: the item for {key} at offset {info.offset} does not hold a tensor "
                    f"of shape {list(chunk.sizes)}"
                )
            if ref.dtype != dtype:
                raise CheckpointError(
                    f"{file}: {key} is stored as {ref.dtype}, the metadata says {dtype}"
                )
            chunks.append(Chunk(ref, tuple(int(o) for o in chunk.offsets)))
        tensors.append(_as_source(split[1], shape, dtype, chunks))
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
