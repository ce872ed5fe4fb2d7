"""Read an unsharded save (the Trainer's or accelerate's `model.safetensors`, or its
sharded `model-0000i-of-0000n.safetensors` + index; accelerate's FSDP
`pytorch_model_fsdp.bin`) as SourceTensors: every tensor is one byte range of its file,
given by the safetensors header or the torch.save zip's records, so the copy stays
streamed."""

from __future__ import annotations

from pathlib import Path

from ...orchestrator.errors import CheckpointError
from .io import ITEMSIZE, Segment, SourceTensor
from .torchzip import TensorRef, load_refs

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


def torch_save_tensors(path: Path) -> list[SourceTensor]:
    """The tensors of a torch.save'd state dict (name → tensor), located without reading
    their data; loaded as a weights-only load would (no arbitrary objects)."""
    state = load_refs(path, trusted=False)
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{path}: not a state dict of tensors (a torch.save'd dict)")
    out: list[SourceTensor] = []
    for name, ref in state.items():
        if not isinstance(ref, TensorRef):
            raise CheckpointError(f"{path}: entry {name!r} is not a tensor")
        if not ref.contiguous:
            raise CheckpointError(f"{path}: tensor {name!r} is stored with gaps (a view)")
        segment = Segment(ref.path, ref.offset, ref.numel, ref.dtype)
        out.append(SourceTensor(str(name), ref.shape, ref.dtype, segments=[segment]))
    return out
