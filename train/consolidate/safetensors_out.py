"""Streaming safetensors output: shard plan, headers up front, data tensor by tensor.

The safetensors format is an 8-byte little-endian header length, a JSON header
(dtype, shape, [begin, end) byte offsets of every tensor) and the raw bytes. Shapes and
dtypes are all known from the checkpoint's metadata before any data is read, so each
shard's header is written first and the tensors are then appended one at a time: no
shard (let alone the model) is ever held in memory.

Sharding follows transformers' convention: greedy, a new shard when the next tensor
would push the current one over the limit (a tensor larger than the limit gets a shard
of its own), files `model-00001-of-00003.safetensors` plus
`model.safetensors.index.json`; a single `model.safetensors` when everything fits.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .io import ITEMSIZE, OutFile, SourceTensor, TensorCopier

SAFETENSORS_DTYPE = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL",
}  # fmt: skip
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class Shard:
    file: str
    tensors: list[SourceTensor]


def out_nbytes(t: SourceTensor, dtype: str) -> int:
    return t.numel * ITEMSIZE[t.out_dtype(dtype)]


def plan_shards(tensors: list[SourceTensor], dtype: str, max_shard_bytes: int) -> list[Shard]:
    groups: list[list[SourceTensor]] = [[]]
    size = 0
    for t in tensors:
        n = out_nbytes(t, dtype)
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    if len(groups) == 1:
        return [Shard(SINGLE_FILE, groups[0])]
    total = len(groups)
    return [Shard(f"model-{i:05d}-of-{total:05d}.safetensors", g) for i, g in enumerate(groups, 1)]


def header_bytes(tensors: list[SourceTensor], dtype: str) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        n = out_nbytes(t, dtype)
        header[t.name] = {
            "dtype": SAFETENSORS_DTYPE[t.out_dtype(dtype)],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces so the data starts 8-byte aligned (what safetensors itself does).
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_shards(
    shards: list[Shard],
    out_dir: Path,
    dtype: str,
    on_bytes: Callable[[int], None] | None = None,
    on_tensor: Callable[[str], None] | None = None,
    durable: bool = True,
) -> list[Path]:
    """Write every shard (and the index when there are several); returns the files.

    `durable` fsyncs each shard before returning (so a power loss right after the
    rename cannot leave a complete-looking folder of empty files)."""
    copier = TensorCopier(on_bytes)
    written: list[Path] = []
    try:
        for shard in shards:
            path = out_dir / shard.file
            out = OutFile(path)
            try:
                out.write(header_bytes(shard.tensors, dtype))
                for t in shard.tensors:
                    n = copier.write(out, t, dtype)
                    if n != out_nbytes(t, dtype):  # a bug, never the user's input
                        raise RuntimeError(f"{t.name}: wrote {n} bytes")
                    if on_tensor:
                        on_tensor(t.name)
            except BaseException:
                out.close(durable=False)
                raise
            out.close(durable)
            written.append(path)
    finally:
        copier.close()
    if len(shards) > 1:
        weight_map = {t.name: s.file for s in shards for t in s.tensors}
        index = {
            "metadata": {
                "total_size": sum(out_nbytes(t, dtype) for s in shards for t in s.tensors)
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out_dir / INDEX_FILE)
    return written
