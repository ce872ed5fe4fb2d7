"""Writes that are never seen half done: temp file → (fsync) → rename → (fsync dir).

The one place shardctl writes a file atomically. `durable` adds the fsyncs that
make the result survive a power loss, not only a crash of the writer; markers and
records skip them (cheap, and a lost one is re-derived), manifests use them.
Folders (checkpoints, converted checkpoints, consolidated models) are published
by `shardctl.train.storage`, with the fsync helpers below.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(
    path: str | Path, data: bytes, *, durable: bool = True, mode: int | None = None
) -> None:
    """Replace `path` with `data` in one rename; the old content stays until then.

    The temp file is a hidden sibling (same file system, so the rename is atomic);
    it is removed again when writing fails.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            tmp.chmod(mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


def write_text_atomic(
    path: str | Path, text: str, *, durable: bool = True, mode: int | None = None
) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), durable=durable, mode=mode)
