"""Write `torch.save` records without torch, hashing the file as it is written.

A `torch.save` record is an uncompressed zip (see `consolidate/torchzip.py`): a
`data.pkl` naming the storages, one `data/<key>` entry of raw bytes per storage, and
a few small version entries. DCP puts one such record per state-dict item into its
`.distcp` file. Writing the records directly lets the tensor bytes go from the
source checkpoint to the output in blocks, without building a tensor, and lets the
output's sha256 (for the manifest) be computed on the second core while the first
one copies — one pass over the data instead of copy, then re-read to hash.

`save_file` writes a whole `torch.save` file of any size (DeepSpeed's ZeRO state files:
several storages, ZIP64 from 4 GiB on, as torch writes it); a DCP record stays a
plain zip (DCP's reader is handed only the record's bytes) and a record that would
need ZIP64 is left to torch (`TooLarge`).
"""

from __future__ import annotations

import hashlib
import os
import queue
import secrets
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...orchestrator.errors import CheckpointError
from ..consolidate.io import ITEMSIZE, Segment
from .pickle_out import Global, Pairs, PersistentId, Reduce, dumps

BLOCK_BYTES = 16 * 2**20  # one read/write/hash unit: bounds the memory of a copy
ZIP32_LIMIT = 2**32 - 1
_ZIP64_MARK = 0xFFFFFFFF  # a 32-bit zip field whose value is in the ZIP64 extra field

STORAGE_CLASS = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage",
}  # fmt: skip

_DESCRIPTOR_FLAG = 0x08  # sizes and CRC follow the data (streamed entries)
_ALIGN = 64  # torch.save starts every entry's data on a 64-byte boundary


class TooLarge(Exception):
    """A record needs ZIP64 (an entry of 4 GiB or more): left to torch.save."""


class HashedFile:
    """A new file written front to back; sha256 computed by a helper thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.pos = 0
        self._sha = hashlib.sha256()
        self._blocks: queue.Queue[Any] = queue.Queue(maxsize=4)
        self._thread = threading.Thread(target=self._hash, daemon=True, name="shardctl-sha256")
        self._thread.start()

    def _hash(self) -> None:
        while (block := self._blocks.get()) is not None:
            self._sha.update(block)  # hashlib releases the GIL on large blocks

    def write(self, data: bytes | bytearray) -> None:
        """`data` must not be changed afterwards: the hashing thread may still read it."""
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        self.pos += len(data)
        self._blocks.put(data)

    def close(self) -> str:
        """Close the file; its sha256 (hex)."""
        self._blocks.put(None)
        self._thread.join()
        os.close(self.fd)
        return self._sha.hexdigest()

    def abort(self) -> None:
        self._blocks.put(None)
        self._thread.join()
        os.close(self.fd)


class _Archive:
    """One zip archive written at the file's current position; offsets are relative to
    its start, as a reader handed only this record's bytes (DCP's reader) sees them.

    `zip64=False` (a DCP record) refuses what would need ZIP64 (`TooLarge`); `zip64=True`
    (a whole file) gives an entry of 4 GiB or more, or one that starts past 4 GiB, ZIP64
    sizes and offset, and ends with the ZIP64 end records torch.save always writes."""

    def __init__(self, out: HashedFile, prefix: str = "archive", *, zip64: bool = False) -> None:
        self.out = out
        self.base = out.pos
        self.prefix = prefix
        self.zip64 = zip64
        self.serial = secrets.randbits(128)
        self.entries: list[tuple[bytes, int, int, int, int]] = []  # name, flag, crc, size, at

    def entry(self, name: str, data: bytes) -> None:
        self._write(name, [data], len(data), zlib.crc32(data))

    def streamed(self, name: str, blocks: Iterable[bytes | bytearray], size: int) -> None:
        self._write(name, blocks, size, None)

    def _write(self, name: str, blocks: Iterable[Any], size: int, crc: int | None) -> None:
        at = self.out.pos - self.base
        if not self.zip64 and (size + 2**20 >= ZIP32_LIMIT or at >= ZIP32_LIMIT):
            raise TooLarge(name)
        wide = size >= ZIP32_LIMIT  # the sizes go to the ZIP64 extra field
        raw = f"{self.prefix}/{name}".encode()
        flag = 0 if crc is not None else _DESCRIPTOR_FLAG
        known = crc if crc is not None else 0
        sizes = _ZIP64_MARK if wide else size if crc is not None else 0
        zip64 = struct.pack("<HHQQ", 0x0001, 16, size, size) if wide else b""
        pad = -(at + 30 + len(raw) + len(zip64) + 4) % _ALIGN
        extra = zip64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB": padding, as torch's
        header = struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 45 if wide else 20, flag, 0, 0, 0, known, sizes, sizes,
            len(raw), len(extra),
        )  # fmt: skip
        self.out.write(header + raw + extra)
        running, written = 0, 0
        for block in blocks:
            running = zlib.crc32(block, running)
            written += len(block)
            self.out.write(block)
        if written != size:
            raise CheckpointError(f"{name}: wrote {written} bytes, expected {size}")
        if crc is None:
            crc = running
            fmt = "<IIQQ" if wide else "<IIII"
            self.out.write(struct.pack(fmt, 0x08074B50, crc, size, size))
        self.entries.append((raw, flag, crc, size, at))

    def close(self) -> tuple[int, int]:
        """Write the central directory; the record's (offset, length) in the file."""
        start = self.out.pos - self.base
        directory = bytearray()
        for raw, flag, crc, size, at in self.entries:
            # ZIP64 extra field: the values whose 32-bit fields overflow, in this order.
            wide = [size, size] if size >= ZIP32_LIMIT else []
            wide += [at] if at >= ZIP32_LIMIT else []
            extra = struct.pack(f"<HH{len(wide)}Q", 0x0001, 8 * len(wide), *wide) if wide else b""
            version = 45 if wide else 20
            directory += struct.pack(
                "<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, flag, 0, 0, 0, crc,
                min(size, _ZIP64_MARK), min(size, _ZIP64_MARK), len(raw), len(extra), 0, 0, 0,
                0, min(at, _ZIP64_MARK),
            )  # fmt: skip
            directory += raw + extra
        n, length = len(self.entries), len(directory)
        if self.zip64:  # the ZIP64 end record and its locator, always (as torch.save)
            end64 = start + length
            directory += struct.pack(
                "<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, length, start
            )
            directory += struct.pack("<IIQI", 0x07064B50, 0, end64, 1)
        directory += struct.pack(
            "<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
            min(length, _ZIP64_MARK), min(start, _ZIP64_MARK), 0,
        )  # fmt: skip
        self.out.write(bytes(directory))
        return self.base, self.out.pos - self.base

    def trailer_entries(self) -> None:
        """The small entries torch.save writes beside `data.pkl` and the storages."""
        self.entry("version", b"3\n")
        self.entry(".data/serialization_id", str(self.serial).zfill(40)[:40].encode())


def _header(archive: _Archive) -> None:
    archive.entry(".format_version", b"1")
    archive.entry(".storage_alignment", b"64")
    archive.entry("byteorder", b"little")


def object_record(out: HashedFile, obj: Any) -> tuple[int, int]:
    """`torch.save(obj)` for plain Python values (DCP's non-tensor items)."""
    archive = _Archive(out)
    archive.entry("data.pkl", dumps(obj))
    _header(archive)
    archive.trailer_entries()
    return archive.close()


def tensor_record(
    out: HashedFile, dtype: str, shape: tuple[int, ...], blocks: Iterable[Any]
) -> tuple[int, int]:
    """`torch.save(tensor)` of a contiguous CPU tensor whose bytes `blocks` yields."""
    archive = _Archive(out)
    archive.entry("data.pkl", dumps(_rebuild(dtype, shape, "0", False)))
    _header(archive)
    archive.streamed("data/0", blocks, _numel(shape) * ITEMSIZE[dtype])
    archive.trailer_entries()
    return archive.close()


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel


def _rebuild(dtype: str, shape: tuple[int, ...], key: str, requires_grad: bool) -> Reduce:
    """What torch.save pickles for a contiguous tensor that is all of storage `key`."""
    stride: list[int] = []
    step = 1
    for n in reversed(shape):
        stride.insert(0, step)
        step *= max(n, 1)
    storage = PersistentId(
        ("storage", Global("torch", STORAGE_CLASS[dtype]), key, "cpu", _numel(shape))
    )
    return Reduce(
        Global("torch._utils", "_rebuild_tensor_v2"),
        (storage, 0, tuple(shape), tuple(stride), requires_grad, Reduce(_ORDERED_DICT, ())),
    )


@dataclass(frozen=True)
class Stored:
    """A tensor of a `save_file` object: its dtype and shape, and `blocks`, called once
    while the file is written, giving its bytes in row-major order."""

    dtype: str
    shape: tuple[int, ...]
    blocks: Callable[[], Iterable[bytes | bytearray]]
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * ITEMSIZE[self.dtype]


def save_file(path: Path, obj: Any) -> str:
    """`torch.save(obj, path)` for an object of plain values, `pickle_out` markers and
    `Stored` tensors (each its own storage), written front to back in one pass: the
    tensors' bytes go from their blocks to the file. Returns the file's sha256."""
    storages: list[Stored] = []
    tree = _with_storages(obj, storages)
    out = HashedFile(path)
    try:
        # torch.save names the archive's folder after the file.
        archive = _Archive(out, path.name.rsplit(".", 1)[0], zip64=True)
        archive.entry("data.pkl", dumps(tree))
        _header(archive)
        for key, tensor in enumerate(storages):
            archive.streamed(f"data/{key}", tensor.blocks(), tensor.nbytes)
        archive.trailer_entries()
        archive.close()
    except BaseException:
        out.abort()
        raise
    return out.close()


def _with_storages(obj: Any, storages: list[Stored]) -> Any:
    """`obj` with every `Stored` replaced by its pickled rebuild; keys in pickling order."""
    if isinstance(obj, Stored):
        storages.append(obj)
        return _rebuild(obj.dtype, obj.shape, str(len(storages) - 1), obj.requires_grad)
    if isinstance(obj, dict):
        return {k: _with_storages(v, storages) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_with_storages(v, storages) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_with_storages(v, storages) for v in obj)
    if isinstance(obj, Pairs):
        return Pairs(tuple((k, _with_storages(v, storages)) for k, v in obj.items))
    if isinstance(obj, Reduce):
        return Reduce(obj.func, _with_storages(obj.args, storages))
    return obj


_ORDERED_DICT = Global("collections", "OrderedDict")


def read_blocks(segments: list[Segment]) -> Iterator[bytearray]:
    """The bytes of `segments`, in order, as fresh blocks of at most BLOCK_BYTES."""
    for seg in segments:
        with seg.path.open("rb", buffering=0) as f:
            at, left = seg.offset, seg.nbytes
            while left:
                block = bytearray(min(left, BLOCK_BYTES))
                got = os.preadv(f.fileno(), [block], at)
                if got != len(block):
                    raise CheckpointError(
                        f"{seg.path} is truncated: wanted {len(block)} bytes at offset {at}, "
                        f"got {got}"
                    )
                yield block
                at += got
                left -= got


def cast_blocks(segments: list[Segment], src: str, dst: str) -> Iterator[bytes]:
    """The bytes of `segments` (dtype `src`) converted to `dst`, block by block (torch
    does the rounding: it is only needed when the precision changes)."""
    import torch

    elems = BLOCK_BYTES // ITEMSIZE[src]
    for seg in segments:
        done = 0
        while done < seg.numel:
            n = min(elems, seg.numel - done)
            part = Segment(seg.path, seg.offset + done * ITEMSIZE[src], n, src)
            raw = next(read_blocks([part]))  # one block: n elements fit in BLOCK_BYTES
            tensor = torch.frombuffer(raw, dtype=getattr(torch, src)).to(getattr(torch, dst))
            yield tensor.view(torch.uint8).numpy().tobytes()
            done += n
