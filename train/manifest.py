"""The on-disk checkpoint layout and its manifest; readable without torch.

A checkpoint is the folder `<checkpoint_dir>/step-NNNNNNNN/`. It is written as
`step-NNNNNNNN.tmp/` and becomes visible under its final name through one rename,
after every rank finished writing and rank 0 wrote `manifest.json` into it. So:

- a folder ending in `.tmp`, or without `manifest.json`, is incomplete and is
  never resumed from;
- a complete folder is trusted only after `verify` (every file's size and sha256
  against the manifest) found nothing wrong.

Where the folders live and how one becomes visible (staging, the rename, deletion
through a hidden `.trash-step-NNNNNNNN-*` name so that a half-deleted checkpoint
can never look complete) is the storage's part: `shardctl.orchestrator.storage`.
Which folders are complete checkpoints is answered by the one lister,
`shardctl.orchestrator.checkpoint_list`, on the storage's read side; this module adds
what the format tells (the manifest checked, `verify`, `list_checkpoints`' reasons).

This module has no torch import on purpose: `shardctl checkpoints` lists and
verifies checkpoints on a login node in well under a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..orchestrator.checkpoint_list import (  # noqa: F401 (step_dirname: callers import it here)
    STEP_RE,
    Where,
    complete_checkpoints,
    step_dirname,
    step_entries,
)
from ..orchestrator.durable import write_text_atomic
from ..orchestrator.errors import CheckpointError, CorruptCheckpointError
from ..orchestrator.storage import COMMIT_MARKER

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = COMMIT_MARKER  # the storage publishes a folder; its manifest commits it
# Hashing reads in large blocks: hashlib drops the GIL for them, so a background
# hashing thread does not slow the training thread down.
HASH_BLOCK = 8 << 20


def package_version(name: str) -> str | None:
    """An installed distribution's version for the manifest's "versions" (None: absent)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class CheckpointInfo:
    """One `step-*` folder as `shardctl checkpoints` shows it."""

    step: int
    path: str
    complete: bool
    size_bytes: int
    world_size: int | None
    backend: str | None
    why_incomplete: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------- hashing


def sha256_file(path: str | Path, block: int = HASH_BLOCK) -> str:
    """Streamed sha256 of a file (memory use: one block)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def list_files(root: str | Path) -> list[str]:
    """Every regular file under `root`, as sorted POSIX paths relative to it
    (the manifest itself excluded)."""
    root = Path(root)
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def share_of(sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The files `rank` hashes: largest first to the least-loaded rank, so every
    rank reads about the same number of bytes. Deterministic on every rank."""
    load = [0] * world_size
    owner: dict[str, int] = {}
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        owner[rel] = r
        load[r] += sizes[rel]
    return sorted(rel for rel, r in owner.items() if r == rank)


def describe_files(
    root: str | Path, rels: Iterable[str], known: dict[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """`{rel: {"size", "sha256"}}` for the given files under `root`; `known` holds the
    sha256 of files hashed while they were written (not read again)."""
    root, known = Path(root), known or {}
    return {
        rel: {
            "size": (root / rel).stat().st_size,
            "sha256": known.get(rel) or sha256_file(root / rel),
        }
        for rel in rels
    }


# -------------------------------------------------------------------- durability


def write_manifest(step_dir: str | Path, data: dict[str, Any]) -> None:
    """Write `manifest.json` into a step folder: whole or not at all, and on disk
    (fsync of the file and the folder) before the folder is published."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    write_text_atomic(Path(step_dir) / MANIFEST, text, durable=True)


# ------------------------------------------------------------------------ reading


def read_manifest(step_dir: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, or `CheckpointError` saying why not."""
    path = Path(step_dir) / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{step_dir}: no {MANIFEST}, so the checkpoint is incomplete (its save never "
            "finished); it cannot be resumed from"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise CheckpointError(f"{path}: not a shardctl manifest (no 'files' mapping)")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {version!r} is not supported; accepted: {FORMAT_VERSION}"
        )
    for rel, entry in data["files"].items():
        _check_entry(path, rel, entry)
    return data


def _check_entry(path: Path, rel: str, entry: Any) -> None:
    # Checked once here so that readers (verify, resume, the CLI) can index an
    # entry without a KeyError escaping from a hand-edited or damaged manifest.
    if not isinstance(entry, dict):
        raise CheckpointError(
            f"{path}: files entry {rel!r} is {type(entry).__name__}, not an object with "
            "'size' and 'sha256'"
        )
    for key, kind in (("size", int), ("sha256", str)):
        value = entry.get(key)
        if value is None:
            raise CheckpointError(f"{path}: files entry {rel!r} has no {key!r}")
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(
                f"{path}: files entry {rel!r} has {key} {value!r}; accepted: {kind.__name__}"
            )


def dir_size(path: Path) -> int:
    """Bytes of every file under `path` (a checkpoint folder, any tool's)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            # A file may vanish while listing (a save or a deletion going on).
            with contextlib.suppress(OSError):
                total += (Path(dirpath) / name).stat().st_size
    return total


def list_checkpoints(checkpoint_dir: str | Path) -> list[CheckpointInfo]:
    """Every `step-*` folder under `checkpoint_dir`, oldest step first.

    `complete` means: final name (no `.tmp`), a readable manifest and every file it
    lists present with its recorded size. Hashes are checked by `verify` only. The
    names come from the one lister (`orchestrator/checkpoint_list.py`).
    """
    root = Path(checkpoint_dir)
    out: list[CheckpointInfo] = []
    for found in step_entries(root):
        entry = root / found.name
        if not entry.is_dir():
            continue
        world_size = backend = None
        why: str | None = None
        if found.staged:
            why = "still being written, or left by a save that crashed (.tmp)"
        else:
            try:
                manifest = read_manifest(entry)
                world_size, backend = manifest.get("world_size"), manifest.get("backend")
                problems = verify(entry, hashes=False, manifest=manifest)
                why = problems[0] if problems else None
            except CheckpointError as exc:
                why = str(exc)
        out.append(
            CheckpointInfo(
                step=found.step,
                path=str(entry),
                complete=why is None,
                size_bytes=dir_size(entry),
                world_size=world_size,
                backend=backend,
                why_incomplete=why,
            )
        )
    return out


def verify(
    path: str | Path,
    *,
    hashes: bool = True,
    files: Iterable[str] | None = None,
    manifest: dict[str, Any] | None = None,
) -> list[str]:
    """Problems of one checkpoint folder against its manifest; empty means OK.

    Each problem names the file, what the manifest expects and what was found.
    `files` limits the check to some of the manifest's files (ranks verify a
    share each); `hashes=False` checks presence and sizes only.
    """
    path = Path(path)
    if manifest is None:
        try:
            manifest = read_manifest(path)
        except CheckpointError as exc:
            return [str(exc)]
    listed: dict[str, dict[str, Any]] = manifest["files"]
    problems: list[str] = []
    for rel in sorted(listed if files is None else files):
        want = listed[rel]
        target = path / rel
        try:
            size = target.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path}/{rel}: missing (manifest expects {want['size']} bytes)")
            continue
        if size != want["size"]:
            problems.append(
                f"{path}/{rel}: size {size} bytes, manifest expects {want['size']} "
                "(truncated or rewritten)"
            )
            continue
        if hashes:
            found = sha256_file(target)
            if found != want["sha256"]:
                problems.append(
                    f"{path}/{rel}: sha256 {found}, manifest expects {want['sha256']} "
                    "(contents altered)"
                )
    return problems


class VerifyAlongside:
    """Every file's sha256 checked against the manifest in background threads, while
    the caller reads the same files to convert or consolidate them.

    The readers touch byte ranges out of order (and consolidation copies them in the
    kernel, never seeing the bytes), so the hashes are not taken from their reads; but
    both run at once over the same files, so the disk is read about once (the page
    cache serves the second reader) and hashlib releases the GIL on large blocks: the
    whole costs about what the slower of the two costs alone. `problems()` waits for
    the thread; call it before anything is published.
    """

    def __init__(self, step_dir: str | Path, manifest: dict[str, Any]) -> None:
        import threading

        self.step_dir, self.manifest = Path(step_dir), manifest
        self._problems: list[list[str]] = []
        self._error: BaseException | None = None
        # sha256 is the slow part (about 3x a copy here): the files are hashed by a few
        # threads at once, each taking the next largest file, so every core hashes.
        groups = _balanced(manifest["files"], min(VERIFY_THREADS, os.cpu_count() or 1))
        self._threads = [
            threading.Thread(target=self._run, args=(g,), daemon=True, name="shardctl-verify")
            for g in groups
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, files: list[str]) -> None:
        try:
            self._problems.append(verify(self.step_dir, manifest=self.manifest, files=files))
        except BaseException as exc:  # re-raised in the caller's thread
            self._error = exc

    def problems(self) -> list[str]:
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise CheckpointError(f"verifying {self.step_dir} failed: {self._error}")
        return sorted(p for found in self._problems for p in found)

    def check(self) -> None:
        """Raise `CorruptCheckpointError` naming every file that does not match."""
        problems = self.problems()
        if problems:
            raise corrupt_error(self.step_dir, problems)


# Threads that hash a checkpoint's files at once (`VerifyAlongside`): more than the
# cores only adds switching.
VERIFY_THREADS = 4


def _balanced(files: dict[str, dict[str, Any]], n: int) -> list[list[str]]:
    """The manifest's files in `n` groups of about equal bytes (largest first, each to
    the lightest group); empty groups are left out."""
    sizes = [0] * max(1, n)
    groups: list[list[str]] = [[] for _ in sizes]
    for rel in sorted(files, key=lambda r: -int(files[r].get("size", 0))):
        lightest = sizes.index(min(sizes))
        sizes[lightest] += int(files[rel].get("size", 0))
        groups[lightest].append(rel)
    return [names for names in groups if names]


def corrupt_error(step_dir: str | Path, problems: list[str]) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {step_dir} failed verification against its manifest (resume would "
        "skip it too); nothing was written:\n  "
        + "\n  ".join(problems)
        + "\n(--no-verify skips the sha256 check, at your own risk)",
        problems,
    )


def complete_candidates(checkpoint_dir: Where) -> list[Path]:
    """Folders that look complete (final name + manifest), newest step first.
    `checkpoint_dir`: a folder (on POSIX storage) or the storage itself."""
    return [c.path for c in complete_checkpoints(checkpoint_dir)]


def latest_complete(checkpoint_dir: str | Path) -> Path | None:
    """Newest complete checkpoint that passes `verify`; older ones are tried when it
    does not, and every rejected one is logged with its problems."""
    for candidate in complete_candidates(checkpoint_dir):
        problems = verify(candidate)
        if not problems:
            return candidate
        log.warning(
            "checkpoint %s is corrupt, trying the previous one:\n  %s",
            candidate,
            "\n  ".join(problems),
        )
    return None


def resolve_checkpoint_dir(path: str | Path) -> tuple[Path, bool]:
    """A run directory, a checkpoint directory or one step folder → (folder, is_one_step)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"{str(p)!r} does not exist; accepted: a run directory, its checkpoints/ folder "
            "or one step-NNNNNNNN folder"
        )
    if not p.is_dir():
        # Listing a file as "no checkpoints" would read as an empty run, not a wrong path.
        raise CheckpointError(
            f"{str(p)!r} is a file, not a folder; accepted: a run directory, its "
            "checkpoints/ folder or one step-NNNNNNNN folder"
        )
    if STEP_RE.match(p.name) or (p / MANIFEST).is_file():
        return p, True
    if (p / "checkpoints").is_dir() and not any(STEP_RE.match(e.name) for e in p.iterdir()):
        return p / "checkpoints", False
    return p, False
