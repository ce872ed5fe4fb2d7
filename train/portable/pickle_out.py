"""Write pickles that name torch's classes without importing torch.

DCP's `.metadata` and every `torch.save` record are pickles whose objects are torch
classes (`torch.Size`, `TensorStorageMetadata`, `_rebuild_tensor_v2` ...). Building
them with the real classes means importing torch (seconds); here a pickle is
written opcode by opcode (protocol 2, no memo) from plain values plus `Global`,
`Reduce`, `NewObj` and `PersistentId` markers, and the reader's own unpickler
builds the real objects. The output is checked against torch's in the tests.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Global:
    """A module-level name, e.g. Global("torch", "Size")."""

    module: str
    name: str


@dataclass(frozen=True)
class Reduce:
    """`func(*args)` at load time."""

    func: Any
    args: tuple[Any, ...]


@dataclass(frozen=True)
class NewObj:
    """`cls.__new__(cls)`, then its state set (a dict goes to `__dict__`, anything else to
    `__setstate__`); `state=None` sets nothing."""

    cls: Global
    state: Any = None


@dataclass(frozen=True)
class Pairs:
    """A dict given as (key, value) pairs, for keys that are objects (`NewObj`)."""

    items: tuple[tuple[Any, Any], ...]


@dataclass(frozen=True)
class PersistentId:
    """A reference resolved by the unpickler's `persistent_load` (torch.save's storages)."""

    value: tuple[Any, ...]


def dumps(obj: Any) -> bytes:
    out = bytearray(b"\x80\x02")  # PROTO 2
    _emit(obj, out)
    out += b"."  # STOP
    return bytes(out)


def _emit(obj: Any, out: bytearray) -> None:
    if obj is None:
        out += b"N"
    elif obj is True:
        out += b"\x88"
    elif obj is False:
        out += b"\x89"
    elif isinstance(obj, int):
        _int(obj, out)
    elif isinstance(obj, float):
        out += b"G" + struct.pack(">d", obj)
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        out += b"X" + struct.pack("<I", len(data)) + data
    elif isinstance(obj, tuple):
        if not obj:
            out += b")"
            return
        out += b"("
        for item in obj:
            _emit(item, out)
        out += b"t"
    elif isinstance(obj, list):
        out += b"]"
        if obj:
            out += b"("
            for item in obj:
                _emit(item, out)
            out += b"e"  # APPENDS
    elif isinstance(obj, dict):
        out += b"}"
        if obj:
            out += b"("
            for key, value in obj.items():
                _emit(key, out)
                _emit(value, out)
            out += b"u"  # SETITEMS
    elif isinstance(obj, Pairs):
        out += b"}"
        if obj.items:
            out += b"("
            for key, value in obj.items:
                _emit(key, out)
                _emit(value, out)
            out += b"u"
    elif isinstance(obj, Global):
        out += b"c" + obj.module.encode() + b"\n" + obj.name.encode() + b"\n"
    elif isinstance(obj, Reduce):
        _emit(obj.func, out)
        _emit(tuple(obj.args), out)
        out += b"R"
    elif isinstance(obj, NewObj):
        _emit(obj.cls, out)
        out += b")\x81"  # an empty args tuple, NEWOBJ
        if obj.state is not None:
            _emit(obj.state, out)
            out += b"b"  # BUILD
    elif isinstance(obj, PersistentId):
        _emit(obj.value, out)
        out += b"Q"  # BINPERSID
    else:
        raise TypeError(f"cannot write {type(obj).__name__} {obj!r} into a torch-free pickle")


def _int(value: int, out: bytearray) -> None:
    if 0 <= value < 256:
        out += b"K" + bytes([value])
    elif 0 <= value < 65536:
        out += b"M" + struct.pack("<H", value)
    elif -(2**31) <= value < 2**31:
        out += b"J" + struct.pack("<i", value)
    else:
        data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        out += b"\x8a" + bytes([len(data)]) + data  # LONG1
