"""Where a checkpoint's files live, how a finished one becomes visible, and how
readers find what is there: the storage seam, torch-free.

Two seams meet at a checkpoint: the *format* (which files, the manifest with
their sizes and sha256: `train/manifest.py`, the backends' `StateIO`, the
converters) and the *storage* (this module): a temporary place to write a save
into, durable writes, one atomic publish, deleting, and the read side every
lister and reader goes through. Every folder shardctl publishes goes through
`CheckpointStorage.publish`: the checkpoints of `CheckpointManager`, the output
of `convert` (`train/portable`) and of `consolidate` (`train/consolidate`). Which
published entries are complete checkpoints is decided in one place, on the read
side only: `orchestrator/checkpoint_list.py`.

The protocol, and what an object store (S3, GCS, ...) would do for each step.
Writers (DCP, DeepSpeed, the safetensors writer) write local files, so a save is
always staged in a local folder; the manifest is written into that folder last,
by `manifest.write_manifest`, and it is the commit marker (`COMMIT_MARKER`): a
published entry without it is never complete.

Each method: what POSIX (`PosixStorage`) does / what an object store would do.

Write side:

- `staging_path(name)`: `<root>/<name>.tmp/`, beside the final place (the same file
  system, so the rename is atomic) / a local scratch folder.
- `new_staging(name)`: removes a leftover of a crashed save there and creates the
  folder / the same, locally.
- `sync(staged, files)`: fsync of those files / upload them (each rank its share).
- `publish(name)`: fsync of every folder, one rename to `<root>/<name>` (a
  `RENAME_EXCHANGE` swap where it replaces one), fsync of `<root>` / upload what is
  not uploaded yet under the prefix `<name>/`, then the manifest, last: its arrival
  commits the checkpoint (a reader lists only prefixes with a manifest).
- `delete(name)`: one rename to a hidden trash name (a half-deleted folder can
  never look complete), then the recursive delete / delete the manifest first
  (uncommit), then the rest.
- `discard(name)`, `clean_stale(ours)`: remove staging folders and trash left by
  crashes / remove the local scratch and the objects of prefixes without manifest.

Read side (keys are POSIX paths relative to the root, `"step-00000010/manifest.json"`;
`""` is the root itself):

- `exists(rel)`: the file or folder is there / a HeadObject on the key, or for a
  "folder" a list of one key under `rel/`.
- `listdir(prefix)`: the names one level below `prefix`, files and folders alike,
  sorted; `[]` where nothing is / ListObjectsV2 with `Prefix=<prefix>/` and
  `Delimiter="/"`: the common prefixes and the keys, their last part only.
- `open(rel)`: a binary stream of the file, `FileNotFoundError` when absent /
  GetObject's body.
- `stat(rel)`: its size and when it was last written (`EntryStat`) / HeadObject's
  `ContentLength` and `LastModified`.

A storage whose `listdir` also shows the staging and trash names of its own write
side is fine: the lister takes only final `step-NNNNNNNN` names holding the commit
marker (`.tmp` and `.trash-*` never match).

`root` stays a local path where readers find published entries (a mount or a
local mirror for an object store): resume, `verify` and the converters read the
checkpoint's own files by path; what is listed and whether it is complete is
asked through the read side.

This module has no torch import and imports only `durable` and `errors` (and, inside
`checkpoint_storage`, `s3` for an `s3://` location: `S3Storage`, the same seam on a
bucket): the CLI, `attempts` (the no-progress rule), the watchdog and the ranks all
use it. `checkpoint_storage(location)` is the one place a location becomes a storage.
`shardctl.train.storage` re-exports it for callers written before it moved here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Protocol, runtime_checkable

from .durable import fsync_dir, fsync_file
from .errors import CheckpointError, UsageError

# The file whose presence makes a published folder complete. `manifest.py` owns
# its contents (and calls it MANIFEST); the storage only knows its name.
COMMIT_MARKER = "manifest.json"
STAGING_SUFFIX = ".tmp"
TRASH_PREFIX = ".trash-"


@dataclass(frozen=True)
class EntryStat:
    """What the read side tells of one stored file."""

    size: int
    mtime: float  # when it was last written, seconds since the epoch


@runtime_checkable
class CheckpointStorage(Protocol):
    """A place that holds named, complete folders of files (see the module docstring)."""

    root: Path

    def staging_path(self, name: str) -> Path:
        """The local folder where the save of `name` is written (no side effect)."""
        ...

    def new_staging(self, name: str) -> Path:
        """An empty `staging_path(name)`, any leftover of an earlier attempt removed."""
        ...

    def sync(self, staged: Path, files: Iterable[str]) -> None:
        """Make these files (paths relative to `staged`) durable."""
        ...

    def publish(self, name: str, *, replace: bool = False) -> Path:
        """Make the staged `name` visible, complete, at once; return where readers find it.
        `replace`: an existing `name` is swapped for the new one, else it is refused."""
        ...

    def delete(self, name: str) -> None:
        """Remove a published entry; it stops being complete before anything else goes."""
        ...

    def discard(self, name: str) -> None:
        """Abandon the staged save of `name`."""
        ...

    def clean_stale(self, ours: Callable[[str], bool]) -> list[str]:
        """Remove what crashed saves (staging of a name `ours` accepts) and deletions
        left behind; return the names removed."""
        ...

    # The read side: `rel` is a POSIX path relative to `root` ("" is the root).

    def exists(self, rel: str) -> bool:
        """Whether a file or a folder is stored at `rel`."""
        ...

    def listdir(self, prefix: str = "") -> list[str]:
        """The names one level below `prefix` (files and folders), sorted; [] when
        nothing is there."""
        ...

    def open(self, rel: str) -> BinaryIO:
        """A binary stream of the file at `rel`; `FileNotFoundError` when absent."""
        ...

    def stat(self, rel: str) -> EntryStat:
        """Size and write time of the file at `rel`; `FileNotFoundError` when absent."""
        ...


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class PosixStorage:
    """`CheckpointStorage` on a POSIX file system (local disk, NFS, Lustre, GPFS).

    `durable=False` skips every fsync (a crash of the writer still never shows a
    partial folder; a power loss might). `staging_marker` names a file written into
    every staging folder: a leftover staging folder without it was not made by
    shardctl and is refused instead of deleted; the marker is removed at publish.
    `fence(name)`, when given, is called before a save is staged and just before the
    publishing rename; it raises to refuse (`shardctl.orchestrator.fence`: a rank of
    an attempt that is no longer current). A refused publish leaves the staging
    folder as it is: it may be the current attempt's save of the same name.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        durable: bool = True,
        staging_marker: str | None = None,
        fence: Callable[[str], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.durable = durable
        self.staging_marker = staging_marker
        self.fence = fence

    def staging_path(self, name: str) -> Path:
        return self.root / f"{name}{STAGING_SUFFIX}"

    def new_staging(self, name: str) -> Path:
        if self.fence is not None:  # a stale writer must not remove the current one's
            self.fence(name)
        staged = self.staging_path(name)
        if staged.exists():
            if self.staging_marker is not None and not (staged / self.staging_marker).exists():
                raise UsageError(
                    f"{staged} exists and was not made by shardctl; move it away first"
                )
            shutil.rmtree(staged)  # our own leftover from an interrupted save
        staged.mkdir(parents=True)
        if self.staging_marker is not None:
            (staged / self.staging_marker).write_text(f"pid {os.getpid()}\n")
        return staged

    def sync(self, staged: Path, files: Iterable[str]) -> None:
        if self.durable:
            for rel in files:
                fsync_file(staged / rel)

    def publish(self, name: str, *, replace: bool = False) -> Path:
        staged, final = self.staging_path(name), self.root / name
        if self.staging_marker is not None:
            (staged / self.staging_marker).unlink(missing_ok=True)
        if self.durable:  # every entry of every folder on disk before the rename
            for folder, _dirs, _files in os.walk(staged):
                fsync_dir(folder)
        if self.fence is not None:  # last, just before the rename
            self.fence(name)
        if not os.path.lexists(final):
            os.rename(staged, final)
            self._sync_root()
            return final
        if not replace:
            raise CheckpointError(f"{final} already exists; nothing was replaced")
        if _rename_exchange(staged, final):
            # `final` now holds the new entry, `staged` the replaced one, which goes
            # the way of a deletion (a crash leaves trash, not a staging folder).
            self._sync_root()
            trash = self._trash_name(name)
            os.rename(staged, trash)
            _remove(trash)
            return final
        # File systems without RENAME_EXCHANGE: the old entry moves aside first, so
        # it is gone only once the new one is in its place.
        aside = self._trash_name(name)
        os.rename(final, aside)
        os.rename(staged, final)
        self._sync_root()
        _remove(aside)
        return final

    def delete(self, name: str) -> None:
        # One rename makes it invisible (the listing skips trash); the slow part after.
        trash = self._trash_name(name)
        os.rename(self.root / name, trash)
        _remove(trash)

    def discard(self, name: str) -> None:
        shutil.rmtree(self.staging_path(name), ignore_errors=True)

    def clean_stale(self, ours: Callable[[str], bool]) -> list[str]:
        removed = []
        for entry in self.root.iterdir():
            staged = entry.name.endswith(STAGING_SUFFIX) and ours(
                entry.name[: -len(STAGING_SUFFIX)]
            )
            if staged or entry.name.startswith(TRASH_PREFIX):
                _remove(entry)
                removed.append(entry.name)
        return removed

    def exists(self, rel: str) -> bool:
        return self._path(rel).exists()

    def listdir(self, prefix: str = "") -> list[str]:
        try:
            return sorted(entry.name for entry in self._path(prefix).iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def open(self, rel: str) -> BinaryIO:
        return open(self._path(rel), "rb")  # the caller closes it

    def stat(self, rel: str) -> EntryStat:
        found = self._path(rel).stat()
        return EntryStat(size=found.st_size, mtime=found.st_mtime)

    def _path(self, rel: str) -> Path:
        # Keys come from listings and fixed names; one climbing out of the root is a bug.
        parts = PurePosixPath(rel).parts
        if rel.startswith("/") or ".." in parts:
            raise ValueError(f"storage key {rel!r} is not a path below the root")
        return self.root.joinpath(*parts)

    def _trash_name(self, name: str) -> Path:
        return self.root / f"{TRASH_PREFIX}{name}-{os.getpid()}-{time.monotonic_ns()}"

    def _sync_root(self) -> None:
        if self.durable:
            fsync_dir(self.root)


# Below the run dir (shared by a run's nodes where its checkpoints would be: local,
# Slurm), the local side of an object-store location: staging, the published copy.
S3_CACHE_DIR = "s3-cache"


def is_object_url(location: object) -> bool:
    """Whether `location` names an object store (`s3://...`, even a malformed one, which
    `checkpoint_storage` then refuses in one line) rather than a local path."""
    from .s3.url import is_s3_url  # torch- and boto3-free

    return is_s3_url(location)


def local_root(location: str, run_dir: str | Path | None = None, node: int | None = None) -> Path:
    """Where the files of the object-store `location` are staged and mirrored locally:
    `<run_dir>/s3-cache/<bucket>/<prefix>` for a run (`<run_dir>/s3-cache/node-N/...`
    for node N of a run on more than one node: no node reads another's), else a folder
    of this user's under the temporary directory (the CLI reading a bucket)."""
    from .s3.url import parse_s3_url

    url = parse_s3_url(location)
    if run_dir:
        base = Path(run_dir) / S3_CACHE_DIR
        if node is not None:
            base = base / f"node-{node}"
    else:
        import tempfile

        base = Path(tempfile.gettempdir()) / f"shardctl-s3-{os.getuid()}"
    return base.joinpath(url.bucket, *url.prefix.split("/")) if url.prefix else base / url.bucket


def checkpoint_storage(
    location: str | Path,
    *,
    run_dir: str | Path | None = None,
    fence: Callable[[str], None] | None = None,
    behind: bool = False,
    durable: bool = True,
    node: int = 0,
    nodes: int = 1,
) -> CheckpointStorage:
    """The storage of the checkpoints at `location`: `PosixStorage` for a folder,
    `S3Storage` for `s3://BUCKET/PREFIX` (staged in `local_root(location, run_dir)`,
    uploaded behind training when `behind`; on more than one node, each node `node`
    stages in its own folder and uploads its own ranks' files). A malformed URL is
    `ObjectUrlError`."""
    if not is_object_url(location):
        return PosixStorage(location, durable=durable, fence=fence)
    from .s3.storage import S3Storage
    from .s3.url import parse_s3_url

    url = parse_s3_url(str(location))
    root = local_root(str(location), run_dir, node if nodes > 1 else None)
    return S3Storage(url, root, fence=fence, behind=behind, node=node, nodes=nodes)
