"""Writes that are never seen half done: temp file → (fsync) → rename → (fsync dir).

The one place shardctl writes a file atomically. `durable` adds the fsyncs that
make the result survive a power loss, not only a crash of the writer; markers and
records skip them (cheap, and a lost one is re-derived), manifests use them.
Folders (checkpoints, converted checkpoints, consolidated models) are published
by `shardctl.orchestrator.storage`, with the fsync helpers below.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

from .errors import ShardctlError, StorageError


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


# ------------------------------------------------------------- full or read-only disks

# Write failures that say nothing is wrong with the data, only with where it goes.
_WHY_UNWRITABLE = {
    errno.ENOSPC: "is full (ENOSPC: no space left on the device)",
    errno.EDQUOT: "is over its disk quota (EDQUOT)",
    errno.EFBIG: "refused a file that large (EFBIG: the file size limit, `ulimit -f`, "
    "or the file system's largest file)",
    errno.EROFS: "is read-only (EROFS)",
    errno.EACCES: "is not writable by this user (EACCES)",
    errno.EPERM: "is not writable by this user (EPERM)",
}
# Below this many free bytes a write that failed without an errno (torch's zip writer
# reports ENOSPC as "unexpected pos ...") is put down to a full file system.
LOW_SPACE_BYTES = 4 << 20


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of `path` (its
    nearest existing parent), or None when that cannot be asked."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _size(n: int) -> str:
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{size:.1f} {unit} ({n} bytes)"
        size /= 1024
    return f"{n} bytes"  # pragma: no cover - the loop always returns


# A C++ source location torch puts before its message ("[enforce fail at x.cc:603] .").
_CPP_WHERE = re.compile(r"\[enforce fail at [^\]]*\]\s*\.?\s*")


def one_line(exc: BaseException, limit: int = 200) -> str:
    """What `exc` says, as one line for a person: its first line, without torch's C++
    source location (a status line is not the place for a traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return _CPP_WHERE.sub("", lines[0] if lines else "")[:limit]


def storage_error(
    exc: BaseException,
    where: str | Path,
    *,
    what: str,
    needed: int | None = None,
    aftermath: str = "",
) -> StorageError | None:
    """A `StorageError` that names `where` when `exc` is a full, over-quota, read-only
    or size-limited file system, else None (the caller re-raises `exc` as it is).

    `what` says what was being written ("the consolidated model"); `needed` is the
    size it needs (None: unknown); `aftermath` says what was cleaned up and kept. A
    failure without an errno counts as a full disk only when `where` has less than
    `LOW_SPACE_BYTES` (or less than `needed`) free right after it.
    """
    if isinstance(exc, ShardctlError) and not isinstance(exc.__cause__, OSError):
        return None  # shardctl's own refusals already say what is wrong
    if isinstance(exc, ShardctlError):
        exc = exc.__cause__  # type: ignore[assignment]
    code = exc.errno if isinstance(exc, OSError) else None
    free = free_bytes(where)
    if code in _WHY_UNWRITABLE:
        why = _WHY_UNWRITABLE[code]
    elif code is None and free is not None and free < max(LOW_SPACE_BYTES, needed or 0):
        why = f"is full (the write failed with {type(exc).__name__}: {one_line(exc)})"
    else:
        return None
    room = ""
    if code not in (errno.EROFS, errno.EACCES, errno.EPERM) and free is not None:
        room = f": {_size(free)} free"
        room += f", about {_size(needed)} needed" if needed else ""
    fix = {
        errno.EROFS: "write somewhere writable",
        errno.EACCES: "write somewhere this user may write",
        errno.EPERM: "write somewhere this user may write",
        errno.EFBIG: "raise the file size limit or write to another file system",
    }.get(code or 0, "free space there or write to a larger file system")
    tail = f"; {aftermath}" if aftermath else ""
    return StorageError(f"cannot write {what}: {where} {why}{room}{tail}. To fix: {fix}")
