"""Where the bytes of one full tensor lie in a sharded checkpoint, and how to copy them.

Both readers (DCP and DeepSpeed) describe every output tensor as a `SourceTensor`:
either `segments` — byte ranges whose concatenation is the tensor in row-major order
(FSDP's dim-0 shards, DeepSpeed's flat partitions) — which are copied file to file in
bounded blocks (no full-tensor buffer at all); or `chunks` — pieces split along other
dimensions — which are assembled in one buffer of the tensor's size. Either way the
memory used is bounded by the largest tensor, never by the model.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...orchestrator.errors import CheckpointError
from .torchzip import TensorRef

# Largest block converted at once (elements): bounds the extra memory of a dtype cast.
BLOCK_ELEMS = 8 * 2**20

ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip
FLOATING = {"float64", "float32", "float16", "bfloat16"}


@dataclass(frozen=True)
class Segment:
    """`numel` contiguous elements of `dtype` at byte `offset` of `path`."""

    path: Path
    offset: int
    numel: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Chunk:
    """A stored piece of a tensor that starts at `offsets` of the full tensor."""

    ref: TensorRef
    offsets: tuple[int, ...]


@dataclass
class SourceTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    segments: list[Segment] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def out_dtype(self, wanted: str) -> str:
        """Floating tensors take the requested dtype; integer buffers keep theirs."""
        return wanted if self.dtype in FLOATING else self.dtype


def segments_of_ref(ref: TensorRef, start: int, numel: int) -> Segment:
    """Elements [start, start + numel) of a contiguous stored tensor, as a Segment."""
    if not ref.contiguous:
        raise CheckpointError(f"{ref.path}: expected a contiguous stored tensor")
    if start < 0 or start + numel > ref.numel:
        raise CheckpointError(
            f"{ref.path}: elements {start}..{start + numel} are outside the stored tensor "
            f"of {ref.numel} elements"
        )
    return Segment(ref.path, ref.offset + start * ref.itemsize, numel, ref.dtype)


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def read_ref(ref: TensorRef) -> Any:
    """Read one stored tensor (exactly its storage extent) into a new CPU tensor."""
    import torch

    if ref.numel == 0:
        return torch.empty(ref.shape, dtype=_torch_dtype(ref.dtype))
    extent = 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True))
    buf = torch.empty(extent * ref.itemsize, dtype=torch.uint8)
    _read_exact(ref.path, ref.offset, buf.numpy())
    flat = buf.view(_torch_dtype(ref.dtype))
    return flat.as_strided(ref.shape, ref.stride)


_SCALAR_FORMAT = {
    "float64": "<d", "float32": "<f", "float16": "<e", "int64": "<q", "int32": "<i",
    "int16": "<h", "int8": "<b", "uint8": "<B", "bool": "<?",
}  # fmt: skip


def read_scalar(ref: TensorRef) -> float:
    """The value of a one-element stored tensor (a step count), read without torch."""
    if ref.numel != 1:
        raise CheckpointError(f"{ref.path}: expected one element, found shape {ref.shape}")
    raw = bytearray(ref.itemsize)
    _read_exact(ref.path, ref.offset, raw)
    if ref.dtype == "bfloat16":  # the high half of a float32
        return struct.unpack("<f", b"\x00\x00" + bytes(raw))[0]
    return float(struct.unpack(_SCALAR_FORMAT[ref.dtype], raw)[0])


def assemble_chunks(src: SourceTensor, on_bytes: Callable[[int], None] | None = None) -> Any:
    """The full tensor (shaped, in its stored dtype) from its chunks, each read and
    copied into place, then freed; `on_bytes` hears the bytes read per chunk."""
    import torch

    full = torch.empty(src.shape, dtype=_torch_dtype(src.dtype))
    covered = 0
    for chunk in src.chunks:
        piece = read_ref(chunk.ref)
        view = full
        for dim, (start, size) in enumerate(zip(chunk.offsets, piece.shape, strict=True)):
            view = view.narrow(dim, start, size)
        view.copy_(piece)
        covered += piece.numel()
        if on_bytes is not None:
            on_bytes(piece.numel() * chunk.ref.itemsize)
        del piece
    if covered != src.numel:
        raise CheckpointError(
            f"{src.name}: the stored chunks cover {covered} of {src.numel} elements"
        )
    return full


def _read_exact(path: Path, offset: int, out: Any) -> None:
    with path.open("rb") as f:
        f.seek(offset)
        got = f.readinto(out)
    if got != len(out):
        raise CheckpointError(
            f"{path} is truncated: wanted {len(out)} bytes at offset {offset}, got {got}"
        )


class OutFile:
    """An unbuffered output file: the in-kernel copies and our writes share one offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def tell(self) -> int:
        return os.lseek(self.fd, 0, os.SEEK_CUR)

    def close(self, durable: bool = True) -> None:
        try:
            if durable:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


class TensorCopier:
    """Writes SourceTensors into an open output file, with reusable bounded buffers."""

    def __init__(self, on_bytes: Callable[[int], None] | None = None) -> None:
        self._on_bytes = on_bytes or (lambda n: None)
        self._bufs: dict[str, Any] = {}
        self._fds: dict[Path, int] = {}
        self._copy_file_range = hasattr(os, "copy_file_range")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._bufs.clear()

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def _buf(self, kind: str, nbytes: int) -> Any:
        import torch

        buf = self._bufs.get(kind)
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[kind] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def write(self, out: OutFile, src: SourceTensor, wanted: str) -> int:
        """Append `src` converted to its output dtype to `out`; returns the bytes written."""
        dtype = src.out_dtype(wanted)
        if src.segments:
            if sum(s.numel for s in src.segments) != src.numel:
                raise CheckpointError(
                    f"{src.name}: the stored pieces hold {sum(s.numel for s in src.segments)} "
                    f"elements, the tensor of shape {list(src.shape)} needs {src.numel}"
                )
            total = 0
            for seg in src.segments:
                if seg.dtype == dtype:
                    total += self._copy_raw(out, seg)
                else:
                    total += self._copy_cast(out, seg, dtype)
            return total
        return self._write_assembled(out, src, dtype)

    def _copy_raw(self, out: OutFile, seg: Segment) -> int:
        src_fd, dst_fd = self._fd(seg.path), out.fd
        done, want = 0, seg.nbytes
        if self._copy_file_range:
            try:
                while done < want:
                    # In-kernel copy: the data never enters this process's memory.
                    n = os.copy_file_range(
                        src_fd, dst_fd, min(want - done, 1 << 28), seg.offset + done
                    )
                    if n == 0:
                        self._truncated(seg, done)
                    done += n
                    self._on_bytes(n)
                return want
            except OSError:
                # Some filesystems refuse (EXDEV, EINVAL): go on with read/write from
                # `done`; the output position moved exactly by what was copied.
                self._copy_file_range = False
        block = self._buf("raw", min(want - done, BLOCK_ELEMS * 4)).numpy()
        while done < want:
            n = min(len(block), want - done)
            got = os.preadv(src_fd, [memoryview(block)[:n]], seg.offset + done)
            if got == 0:
                self._truncated(seg, done)
            out.write(memoryview(block)[:got])
            done += got
            self._on_bytes(got)
        return want

    def _copy_cast(self, out: OutFile, seg: Segment, dtype: str) -> int:
        src_size, dst_size = ITEMSIZE[seg.dtype], ITEMSIZE[dtype]
        src_fd = self._fd(seg.path)
        done = 0
        while done < seg.numel:
            n = min(BLOCK_ELEMS, seg.numel - done)
            raw = self._buf("src", n * src_size)
            got = os.preadv(src_fd, [memoryview(raw.numpy())], seg.offset + done * src_size)
            if got != n * src_size:
                self._truncated(seg, done * src_size + got)
            dst = self._buf("dst", n * dst_size)
            dst.view(_torch_dtype(dtype)).copy_(raw.view(_torch_dtype(seg.dtype)))
            out.write(dst.numpy())
            done += n
            self._on_bytes(n * src_size)
        return seg.numel * dst_size

    def _write_assembled(self, out: OutFile, src: SourceTensor, dtype: str) -> int:
        import torch

        full = assemble_chunks(src, self._on_bytes)
        data = full if dtype == src.dtype else full.to(_torch_dtype(dtype))
        out.write(data.reshape(-1).view(torch.uint8).numpy())
        return data.numel() * ITEMSIZE[dtype]

    @staticmethod
    def _truncated(seg: Segment, done: int) -> None:
        raise CheckpointError(
            f"{seg.path} is truncated: expected {seg.nbytes} bytes at offset {seg.offset}, "
            f"the file ends after {done}"
        )
