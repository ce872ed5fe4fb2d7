"""The one lister of shardctl's checkpoints, torch-free, on the storage's read side.

A checkpoint is the entry `step-NNNNNNNN` of a `CheckpointStorage`. It is staged as
`step-NNNNNNNN.tmp` and published whole; the manifest (`COMMIT_MARKER`), written
last, commits it. So an entry is *complete* here when its name is a final step name
and it holds the commit marker; a `.tmp` entry, trash of a deletion or a folder
without a manifest never is. Whether the files match the manifest (sizes, sha256)
is the format's question (`train/manifest.py`: `verify`, `list_checkpoints`).

Everything that asks "which checkpoints does this run have" asks here: resume and
retention (`manifest.complete_candidates`/`latest_complete`), `precision: auto`,
the no-progress rule (`attempts.newest_checkpoint`), the watchdog's and `doctor`'s
measured save times (`save_times`), `shardctl checkpoints`, `consolidate` and
`convert` (through `manifest.list_checkpoints`). It reads only through `exists`,
`listdir`, `open` and `stat`, so a storage that implements them (an object store)
is listed the same way.

Imports only `storage` (itself only `durable` and `errors`): the orchestrator,
`attempts` and the watchdog import it without `train/` or torch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from .storage import (
    COMMIT_MARKER,
    STAGING_SUFFIX,
    CheckpointStorage,
    PosixStorage,
    checkpoint_storage,
    is_object_url,
)

STEP_RE = re.compile(r"^step-(\d{8})(\.tmp)?$")


def step_dirname(step: int) -> str:
    """The entry name of the checkpoint of `step`."""
    return f"step-{step:08d}"


@dataclass(frozen=True)
class StepEntry:
    """One `step-*` entry of a storage, complete or not."""

    step: int
    name: str
    staged: bool  # a `.tmp` name: a save still being written, or one that crashed


@dataclass(frozen=True)
class CompleteCheckpoint:
    """A committed checkpoint: a final step name holding the commit marker."""

    step: int
    name: str
    storage: CheckpointStorage = field(compare=False, repr=False)

    @property
    def path(self) -> Path:
        """Where readers find its files (the storage's local root)."""
        return self.storage.root / self.name

    def manifest(self) -> dict[str, Any]:
        """The manifest as stored (JSON, not checked: `manifest.read_manifest` checks);
        `OSError` or `ValueError` when it cannot be read."""
        with self.storage.open(f"{self.name}/{COMMIT_MARKER}") as stream:
            data = json.loads(stream.read())
        if not isinstance(data, dict):
            raise ValueError(f"{self.name}/{COMMIT_MARKER} is not a JSON object")
        return data

    def committed_at(self) -> float:
        """When the commit marker was written (seconds since the epoch)."""
        return self.storage.stat(f"{self.name}/{COMMIT_MARKER}").mtime


# A storage, or a checkpoint folder on this machine's file system.
Where: TypeAlias = CheckpointStorage | str | Path


def storage_of(where: Where) -> CheckpointStorage:
    """A storage as given, a checkpoint folder read through `PosixStorage`, or an
    `s3://` URL read through `S3Storage`."""
    if isinstance(where, str) and is_object_url(where):
        return checkpoint_storage(where, durable=False)
    if isinstance(where, (str, Path)):
        return PosixStorage(where, durable=False)  # only read: no fsync needed
    return where


def step_entries(where: Where) -> list[StepEntry]:
    """Every `step-*` entry (final and `.tmp`), oldest step first."""
    found = []
    for name in storage_of(where).listdir(""):
        match = STEP_RE.match(name)
        if match is not None:
            found.append(StepEntry(int(match.group(1)), name, bool(match.group(2))))
    return sorted(found, key=lambda e: (e.step, e.name))


def is_committed(where: Where, name: str) -> bool:
    """Whether the entry `name` was published whole: not a staging name, and it holds
    the commit marker (any name: a step folder, or a folder the user named)."""
    if name.endswith(STAGING_SUFFIX):
        return False
    return storage_of(where).exists(f"{name}/{COMMIT_MARKER}")


def committed_folder(folder: str | Path) -> bool:
    """`is_committed` for one folder given by its path."""
    folder = Path(folder)
    return is_committed(folder.parent, folder.name)


def complete_checkpoints(where: Where) -> list[CompleteCheckpoint]:
    """The complete checkpoints, newest step first (the order resume tries them)."""
    storage = storage_of(where)
    return [
        CompleteCheckpoint(entry.step, entry.name, storage)
        for entry in reversed(step_entries(storage))
        if not entry.staged and is_committed(storage, entry.name)
    ]


def newest_complete(where: Where) -> CompleteCheckpoint | None:
    """The newest complete checkpoint, or None."""
    found = complete_checkpoints(where)
    return found[0] if found else None


def save_times(where: Where | None) -> list[float]:
    """`save_s` of every complete checkpoint's manifest, oldest step first, plus its
    `upload_s` where it has one (a bucket's: a final or preemption save waits for its
    upload too); a manifest that cannot be read or holds no usable number is left out
    (measurements only)."""
    if not where:
        return []
    out: list[float] = []
    try:
        checkpoints = complete_checkpoints(where)
    except OSError:
        return out
    for checkpoint in reversed(checkpoints):
        try:
            manifest = checkpoint.manifest()
            value = float(manifest["save_s"]) + float(manifest.get("upload_s") or 0.0)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if math.isfinite(value) and value > 0:
            out.append(value)
    return out
