"""Write `torch.save` records without torch, hashing the file as it is written.

A `torch.save` record is an uncompressed zip (see `consolidate/torchzip.py`): a
`data.pkl` naming the storages, one `data/<key>` entry of raw bytes per storage, and
a few small version entries. DCP puts one such record per state-dict item into its
`.distcp` file. Writing the records directly lets the tensor bytes go from the
source checkpoint to the output in blocks, without building a tensor, and lets the
output's sha256 (for the manifest) be computed on the second core while the first
one copies — one pass over the data instead of copy, then re-read to hash.
"""

from __future__ import annotations

import hashlib
import os
import queue
import secrets
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ...orchestrator.errors import CheckpointError
from ..consolidate.io import ITEMSIZE, Segment
from .pickle_out import Global, PersistentId, Reduce, dumps

BLOCK_BYTES = 16 * 2**20  # one read/write/hash unit: bounds the memory of a copy
ZIP32_LIMIT = 2**32 - 1

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
    its start, as a reader handed only this record's bytes (DCP's reader) sees them."""

    def __init__(self, out: HashedFile) -> None:
        self.out = out
        self.base = out.pos
        self.serial = secrets.randbits(128)
        self.entries: list[tuple[bytes, int, int, int, int]] = []  # name, flag, crc, size, at

    def entry(self, name: str, data: bytes) -> None:
        self._write(name, [data], len(data), zlib.crc32(data))

    def streamed(self, name: str, blocks: Iterable[bytes | bytearray], size: int) -> None:
        self._write(name, blocks, size, None)

    def _write(self, name: str, blocks: Iterable[Any], size: int, crc: int | None) -> None:
        if size + 2**20 >= ZIP32_LIMIT or self.out.pos - self.base >= ZIP32_LIMIT:
            raise TooLarge(name)
        raw = f"archive/{name}".encode()
        at = self.out.pos - self.base
        pad = -(at + 30 + len(raw) + 4) % _ALIGN
        extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB": padding, as torch's
        flag = 0 if crc is not None else _DESCRIPTOR_FLAG
        known = crc if crc is not None else 0
        sizes = size if crc is not None else 0
        header = struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 20, flag, 0, 0, 0, known, sizes, sizes,
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
            self.out.write(struct.pack("<IIII", 0x08074B50, crc, size, size))
        self.entries.append((raw, flag, crc, size, at))

    def close(self) -> tuple[int, int]:
        """Write the central directory; the record's (offset, length) in the file."""
        start = self.out.pos - self.base
        directory = bytearray()
        for raw, flag, crc, size, at in self.entries:
            directory += struct.pack(
                "<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, flag, 0, 0, 0, crc, size, size,
                len(raw), 0, 0, 0, 0, 0, at,
            )  # fmt: skip
            directory += raw
        n = len(self.entries)
        directory += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(directory), start, 0)
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
    numel = 1
    for n in shape:
        numel *= n
    stride: list[int] = []
    step = 1
    for n in reversed(shape):
        stride.insert(0, step)
        step *= max(n, 1)
    storage = PersistentId(("storage", Global("torch", STORAGE_CLASS[dtype]), "0", "cpu", numel))
    rebuild = Reduce(
        Global("torch._utils", "_rebuild_tensor_v2"),
        (storage, 0, tuple(shape), tuple(stride), False, Reduce(_ORDERED_DICT, ())),
    )
    archive = _Archive(out)
    archive.entry("data.pkl", dumps(rebuild))
    _header(archive)
    archive.streamed("data/0", blocks, numel * ITEMSIZE[dtype])
    archive.trailer_entries()
    return archive.close()


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
