"""Read an unsharded save (the Trainer's or accelerate's `model.safetensors`, or its
sharded `model-0000i-of-0000n.safetensors` + index) as SourceTensors: every tensor is one
byte range of its file, given by the safetensors header, so the copy stays streamed."""

from __future__ import annotations

from pathlib import Path

from ...orchestrator.errors import CheckpointError
from .io import ITEMSIZE, Segment, SourceTensor

# safetensors' dtype names → the names the consolidator uses
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}  # fmt: skip


def safetensors_tensors(folder: Path) -> list[SourceTensor]:
    from ..foreign import read_safetensors_header, safetensors_files

    problems: list[str] = []
    files = safetensors_files(folder, problems)
    if problems:
        raise CheckpointError("; ".join(problems))
    out: list[SourceTensor] = []
    for path in files:
        header, data_start = read_safetensors_header(path)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _DTYPES[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"{path}: header entry {name!r} is malformed ({exc})"
                ) from None
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * ITEMSIZE[dtype]:
                raise CheckpointError(
                    f"{path}: {name} has {end - begin} bytes for shape {list(shape)} {dtype}"
                )
            out.append(
                SourceTensor(
                    name, shape, dtype, segments=[Segment(path, data_start + begin, numel, dtype)]
                )
            )
    return out
