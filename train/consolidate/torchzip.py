"""Find where the tensors of a `torch.save` file lie, without reading their data.

A `torch.save` file is an uncompressed zip: `<archive>/data.pkl` holds the object tree,
each storage is one record `<archive>/data/<key>` of raw little-endian bytes. Both
DCP's `.distcp` items (one `torch.save` stream per item, at a byte offset inside the
file) and DeepSpeed's `*_states.pt` files use it. Unpickling `data.pkl` with the tensor
rebuild functions replaced by `TensorRef` gives the object tree with every tensor
turned into (file, byte offset, dtype, shape, strides) — so the consolidator can copy
exactly the bytes it needs, one tensor at a time, instead of loading (or mmap-ing, which
counts every touched page in the RSS) whole shards.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ...orchestrator.errors import CheckpointError

# Storage classes as pickled by torch.save → element dtype name, item size.
_STORAGE_DTYPES: dict[str, tuple[str, int]] = {
    "DoubleStorage": ("float64", 8),
    "FloatStorage": ("float32", 4),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
    "UntypedStorage": ("uint8", 1),
}


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: str
    itemsize: int
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor inside a file: `numel` elements of `dtype` starting at `offset` (bytes)."""

    path: Path
    storage_offset_bytes: int  # file offset of element 0 of the storage
    storage_numel: int
    dtype: str
    itemsize: int
    storage_offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def offset(self) -> int:
        """File offset of the tensor's first element (meaningful when contiguous)."""
        return self.storage_offset_bytes + self.storage_offset * self.itemsize


class _Window(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start + length) of an open file."""

    def __init__(self, f: io.BufferedReader, start: int, length: int) -> None:
        self._f, self._start, self._len, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._len - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buf)[:n])
        self._pos += got or 0
        return got or 0


class Opaque:
    """Stands in for a class of a trusted pickle that is not needed to find the tensors.

    DeepSpeed's state files pickle DeepSpeed objects (ZeroStageEnum, LossScaler ...);
    importing DeepSpeed only to rebuild them costs seconds, so they become Opaque
    objects that keep their arguments (`int()` of an enum member gives its value).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __int__(self) -> int:
        return int(self.args[0])

    def __repr__(self) -> str:
        return f"Opaque{self.args!r}"


class TorchName(str):
    """A torch global (dtype, layout, memory format) kept by name: `str()` gives
    "torch.float32" like the real object, and torch need not be imported to read it."""

    def __str__(self) -> str:
        return f"torch.{str.__str__(self)}"

    def __repr__(self) -> str:
        return str(self)


_TORCH_NAMES = {
    "float32", "float", "float64", "double", "float16", "half", "bfloat16", "int64", "long",
    "int32", "int", "int16", "short", "int8", "uint8", "bool", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "strided", "sparse_coo", "contiguous_format",
    "channels_last", "preserve_format",
}  # fmt: skip


def torch_global(module: str, name: str) -> Any:
    """Light stand-ins for the torch globals checkpoints pickle (None when not one):
    importing torch costs seconds and the copy does not need it."""
    if module != "torch":
        return None
    if name == "Size":
        return lambda dims=(): tuple(int(d) for d in dims)
    if name == "device":
        return lambda *args: TorchName(":".join(str(a) for a in args))
    if name in _TORCH_NAMES:
        return TorchName(name)
    return None


class _RefUnpickler(pickle.Unpickler):
    """Unpickles data.pkl, turning every tensor into a TensorRef (no data is read)."""

    # What a weights-only checkpoint (DCP) may contain besides tensors.
    _SAFE: ClassVar[set[tuple[str, str]]] = {
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def __init__(self, data: bytes, path: Path, records: dict[str, int], trusted: bool) -> None:
        super().__init__(io.BytesIO(data))
        self._path, self._records, self._trusted = path, records, trusted

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        dtype, itemsize = _STORAGE_DTYPES[storage_type]
        return StorageRef(str(key), dtype, itemsize, int(numel))

    def _tensor(self, storage: StorageRef, storage_offset: int, size, stride, *_: Any):
        if storage.key not in self._records:
            raise pickle.UnpicklingError(f"storage record data/{storage.key} is missing")
        shape = tuple(int(s) for s in size)
        strides = tuple(int(s) for s in stride)
        if (
            math.prod(shape)
            and int(storage_offset)
            + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
            >= storage.numel
        ):
            raise pickle.UnpicklingError(f"tensor of shape {shape} overruns its storage")
        return TensorRef(
            path=self._path,
            storage_offset_bytes=self._records[storage.key],
            storage_numel=storage.numel,
            dtype=storage.dtype,
            itemsize=storage.itemsize,
            storage_offset=int(storage_offset),
            shape=shape,
            stride=strides,
        )

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return self._tensor
        if module == "torch._utils" and name in (
            "_rebuild_parameter",
            "_rebuild_parameter_with_state",
        ):
            return lambda data, *_: data
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return lambda func, _new_type, args, _state: func(*args)
        if (module, name) in (("torch", "Tensor"), ("torch.nn.parameter", "Parameter")):
            return TorchName(name)  # the tensor subclass to rebuild: a plain tensor here
        if module == "torch" and name in _STORAGE_DTYPES:
            return name  # persistent_load maps the name to a dtype
        light = torch_global(module, name)
        if light is not None:
            return light
        if (module, name) in self._SAFE:
            return super().find_class(module, name)
        if self._trusted:
            if module.split(".")[0] == "deepspeed":
                return type(name, (Opaque,), {})
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                return type(name, (Opaque,), {})
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in a weights-only checkpoint item"
        )


def _data_records(zf: zipfile.ZipFile, raw: io.RawIOBase) -> tuple[str, dict[str, int]]:
    """The archive prefix and, per storage key, the offset of its raw bytes in `raw`."""
    pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        raise ValueError("no data.pkl record: not a torch.save zip")
    prefix = pkl[0][: -len("data.pkl")]
    records: dict[str, int] = {}
    for info in zf.infolist():
        if not info.filename.startswith(prefix + "data/"):
            continue
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"record {info.filename} is compressed")
        raw.seek(info.header_offset)
        header = raw.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise ValueError(f"bad local header for {info.filename}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        records[info.filename[len(prefix) + len("data/") :]] = (
            info.header_offset + 30 + name_len + extra_len
        )
    byteorder = prefix + "byteorder"
    if byteorder in zf.namelist() and zf.read(byteorder) != b"little":
        raise ValueError("big-endian checkpoints are not supported")
    return pkl[0], records


def load_refs(path: Path, start: int = 0, length: int | None = None, *, trusted: bool) -> Any:
    """The object saved by torch.save at [start, start+length) of `path`, tensors as TensorRef.

    `trusted=False` allows only what a weights-only load allows (DCP items); DeepSpeed's
    state files pickle arbitrary objects and need `trusted=True`, exactly like
    `torch.load(weights_only=False)` — only consolidate checkpoints you trust.
    """
    try:
        with path.open("rb") as f:
            if length is None:
                length = f.seek(0, io.SEEK_END) - start
            window = _Window(f, start, length)
            with zipfile.ZipFile(window) as zf:
                pkl_name, records = _data_records(zf, window)
                data = zf.read(pkl_name)
            absolute = {k: start + off for k, off in records.items()}
            return _RefUnpickler(data, path, absolute, trusted).load()
    except (
        OSError,
        ValueError,
        KeyError,
        EOFError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        struct.error,
    ) as exc:
        where = f" (bytes {start}..{start + (length or 0)})" if start else ""
        raise CheckpointError(f"{path}{where} is corrupt or not a torch.save file: {exc}") from exc
