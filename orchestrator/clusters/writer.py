"""Writing a rendered folder without ever overwriting a file the user wrote.

`shardctl render --out .` once replaced a user's commented `job.yaml` with the
rendered copy. Now every folder shardctl renders into carries a list of what it
wrote (`.shardctl-rendered`, file name → sha256). A file already in the folder
is replaced only when that list names it and its content is still what
shardctl wrote; anything else (a file of the user's, or a rendered file the user
edited since) stops the write before a single byte changes, naming the file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..durable import write_text_atomic
from ..errors import ShardctlError, UsageError

LEDGER = ".shardctl-rendered"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _ledger(folder: Path) -> dict[str, str]:
    try:
        data = json.loads((folder / LEDGER).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items()}


def foreign_files(files: dict[str, str], folder: Path) -> list[Path]:
    """Files in `folder` that writing `files` would replace but shardctl did not write."""
    ledger = _ledger(folder)
    foreign: list[Path] = []
    for name in files:
        path = folder / name
        if not path.exists() and not path.is_symlink():
            continue
        if path.is_symlink() or not path.is_file():
            foreign.append(path)
            continue
        try:
            current = _sha256(path.read_bytes())
        except OSError:
            foreign.append(path)
            continue
        if ledger.get(name) != current:
            foreign.append(path)
    return foreign


def write_rendered(files: dict[str, str], folder: Path) -> list[tuple[Path, int]]:
    """Write `files` into `folder` (created as needed); shell scripts become executable.

    Returns (path, bytes) per file. Raises UsageError, before writing anything, when
    a file in the way was not written by shardctl.
    """
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{str(folder)!r} is a file, not a folder; choose another --out")
    foreign = foreign_files(files, folder) if folder.is_dir() else []
    if foreign:
        names = ", ".join(str(p) for p in foreign)
        raise UsageError(
            f"not overwriting {names}: shardctl did not write "
            f"{'it' if len(foreign) == 1 else 'them'} (or it was edited since); "
            "render into another folder (--out), or move the file away first"
        )
    written: list[tuple[Path, int]] = []
    ledger = _ledger(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            data = content.encode("utf-8")
            mode = 0o755 if name.endswith(".sh") else 0o644
            write_text_atomic(path, content, durable=False, mode=mode)
            ledger[name] = _sha256(data)
            written.append((path, len(data)))
        write_text_atomic(
            folder / LEDGER, json.dumps(ledger, indent=1, sort_keys=True) + "\n", durable=False
        )
    except NotADirectoryError as exc:
        raise UsageError(f"{str(folder)!r}: {exc.strerror} ({exc.filename})") from None
    except OSError as exc:
        raise ShardctlError(f"cannot write the rendered files to {str(folder)!r}: {exc}") from None
    return written
