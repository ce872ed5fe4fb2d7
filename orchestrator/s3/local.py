"""The commands' side of checkpoints in a bucket: what `shardctl checkpoints s3://...`
shows, read through the storage's read side only, and the local copy that readers of
files by path (`consolidate`, `convert`) are given.

A checkpoint is brought down whole by `S3Storage.fetch` (the manifest last) into a
local mirror of the bucket's prefix (`orchestrator/storage.py`'s `local_root`: the
user's folder under the temporary directory for a command), and its files are then
checked against the manifest's sha256 as they are read, as for any local checkpoint.
A download streams to disk: memory stays bounded whatever the checkpoint's size.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from ..checkpoint_list import STEP_RE, newest_complete, step_entries
from ..errors import CheckpointError
from ..storage import COMMIT_MARKER, checkpoint_storage
from .storage import S3Storage

# Bytes read at a time while hashing an object (memory stays bounded).
HASH_BLOCK = 8 << 20


def s3_storage(location: str) -> S3Storage:
    """The `S3Storage` of `location`, mirrored in this user's local cache folder."""
    storage = checkpoint_storage(location)
    assert isinstance(storage, S3Storage)  # `location` is an s3:// URL: callers check
    return storage


def fetch_checkpoint(location: str) -> Path:
    """The local copy of the checkpoint at `location`: one `.../step-NNNNNNNN`, or the
    newest complete checkpoint of a checkpoint prefix. `CheckpointError` when there is
    none."""
    parent, _, name = location.rstrip("/").rpartition("/")
    if STEP_RE.match(name) and not name.endswith(".tmp") and parent.count("/") >= 2:
        return s3_storage(parent).fetch(name)
    storage = s3_storage(location)
    newest = newest_complete(storage)
    if newest is None:
        raise CheckpointError(
            f"no complete checkpoint in {location} (no step-NNNNNNNN/{COMMIT_MARKER}); "
            "accepted: a checkpoint prefix holding one, or one s3://.../step-NNNNNNNN"
        )
    return storage.fetch(newest.name)


def checkpoint_rows(location: str, check_hashes: bool) -> list[dict[str, Any]]:
    """`shardctl checkpoints`' rows for the `step-*` entries under `location` (or the one
    entry it names), read from the bucket: sizes against the manifest, and with
    `check_hashes` every object's sha256, streamed."""
    parent, _, name = location.rstrip("/").rpartition("/")
    one = bool(STEP_RE.match(name)) and parent.count("/") >= 2
    storage = s3_storage(parent if one else location)
    entries = [e for e in step_entries(storage) if not one or e.name == name]
    return [_row(storage, e.step, e.name, e.staged, check_hashes) for e in entries]


def _row(storage: S3Storage, step: int, name: str, staged: bool, hashes: bool) -> dict[str, Any]:
    entry = storage.url.child(name)
    sizes = {
        info.url.key[len(entry.folder_key) :]: info.size
        for info in storage.client.list(entry).objects
    }
    manifest: dict[str, Any] = {}
    problems: list[str] = []
    if staged:
        status = "incomplete"
        problems = ["still being written, or left by a save that crashed (.tmp)"]
    elif COMMIT_MARKER not in sizes:
        status = "incomplete"
        problems = [f"{entry}: no {COMMIT_MARKER} (its upload never finished)"]
    else:
        manifest, problems = _check(storage, name, sizes, hashes)
        status = "corrupt" if problems else ("verified" if hashes else "complete")
    return {
        "step": step,
        "path": str(entry),
        "complete": status in ("complete", "verified"),
        "size_bytes": sum(sizes.values()),
        "world_size": manifest.get("world_size"),
        "backend": manifest.get("backend"),
        "why_incomplete": problems[0] if problems and status == "incomplete" else None,
        "format": "shardctl",
        "status": status,
        "problems": problems,
    }


def _check(
    storage: S3Storage, name: str, sizes: dict[str, int], hashes: bool
) -> tuple[dict[str, Any], list[str]]:
    """The manifest of a committed entry and what does not match it."""
    entry = storage.url.child(name)
    try:
        with storage.open(f"{name}/{COMMIT_MARKER}") as stream:
            manifest = json.loads(stream.read())
        files = manifest["files"]
        wanted = {rel: (int(f["size"]), str(f["sha256"])) for rel, f in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return {}, [f"{entry}/{COMMIT_MARKER}: unreadable manifest ({exc})"]
    problems = []
    for rel, (size, digest) in sorted(wanted.items()):
        found = sizes.get(rel)
        if found is None:
            problems.append(f"{entry}/{rel}: missing (manifest expects {size} bytes)")
        elif found != size:
            problems.append(f"{entry}/{rel}: size {found} bytes, manifest expects {size}")
        elif hashes and _sha256(storage, f"{name}/{rel}") != digest:
            problems.append(f"{entry}/{rel}: sha256 differs from the manifest's")
    return manifest, problems


def _sha256(storage: S3Storage, rel: str) -> str:
    digest = hashlib.sha256()
    with storage.open(rel) as stream:
        while chunk := stream.read(HASH_BLOCK):
            digest.update(chunk)
    return digest.hexdigest()


def split_entry(location: str) -> tuple[S3Storage, str]:
    """The storage of the prefix above `location` and the entry name `location` ends in
    (`s3://b/ckpt/ds8` → the storage of `s3://b/ckpt`, "ds8"); a bucket's top names no
    entry."""
    parent, _, name = location.rstrip("/").rpartition("/")
    if parent.count("/") < 2 or not name:
        raise CheckpointError(
            f"{location} names no folder below the bucket; accepted: s3://BUCKET/NAME or "
            "s3://BUCKET/PREFIX/NAME"
        )
    return s3_storage(parent), name


def refuse_existing(location: str) -> None:
    """`CheckpointError` when a complete entry is at `location` already (an output is
    never replaced); checked before any work, and again by the publish."""
    storage, name = split_entry(location)
    if storage.exists(f"{name}/{COMMIT_MARKER}"):
        raise CheckpointError(f"{location} already exists; a new output is never put over it")


def publish_folder(folder: Path, location: str) -> str:
    """Upload the complete local `folder` (it holds its manifest) as the entry at
    `location`, the manifest last (it commits it); `folder` is moved into the storage's
    local mirror. Returns `location`."""
    storage, name = split_entry(location)
    if not (folder / COMMIT_MARKER).is_file():
        raise CheckpointError(
            f"{folder} holds no {COMMIT_MARKER}: only a shardctl-layout checkpoint can be "
            f"published to {location}; write it to a local folder instead"
        )
    staged = storage.new_staging(name)
    staged.rmdir()
    shutil.move(folder, staged)
    storage.publish(name)
    return location


def probe_write(location: str) -> None:
    """Put one small object under `location` and delete it again (`shardctl doctor`);
    `ObjectStoreError` naming what failed."""
    import uuid

    storage = s3_storage(location)
    probe = storage.url.child(f".shardctl-doctor-{uuid.uuid4().hex}")
    storage.client.put_bytes(b"x", probe)
    storage.client.delete([probe])
