"""`S3Storage`: the checkpoint storage seam (`orchestrator/storage.py`'s
`CheckpointStorage`) on an S3 bucket, with the guarantees a POSIX folder gives.

A save is staged in a local folder (`root/<name>.tmp/`, as the writers need files;
`new_staging` also deletes what an earlier, crashed try of `name` uploaded) and goes up
in two steps: `sync` uploads each rank's files, `publish` uploads whatever is not up
yet and the manifest (`COMMIT_MARKER`) last: its arrival commits the checkpoint,
so a reader (`orchestrator/checkpoint_list.py`, through `exists`/`listdir`/`open`/
`stat`) never takes a torn upload for a checkpoint. The published folder then stays
in `root/<name>` as the local copy readers find by path.

Replacing a complete entry of the same name (a step saved again after a resume): the
new save's files go up beside it, under `<name>.tmp/`, so the old entry stays whole
while they upload; `publish` then deletes the old manifest first, copies the new
objects into place inside the store and commits. S3 has no atomic rename, so between
that first delete and the new manifest no entry of that name is complete (a crash
there costs this name, and resume takes the previous checkpoint), never a mixed one.

Behind training (`behind=True`): `sync` uploads nothing and `publish` returns once the
local copy is in place, the upload and the commit running on in a thread; the next
save waits for it (`new_staging`), and so do `clean_stale` and a `delete` or `discard`
of that name. Its failure is raised by `wait`, which a rank calls before it exits:
the checkpoint it was for is then not committed, and the previous one is still the
newest complete checkpoint (a node lost mid-upload costs that checkpoint, never a
corrupt one).

A manifest that records how long the save took (`save_s`) records how long its upload
took too (`upload_s`): it is added just before the manifest goes up.

`delete` removes the manifest first, then the rest. The staging folder must hold every
file of the save when `publish` runs (a shared file system, as today); a save staged
on each node's own disk needs every rank's `sync` to have run first, and `publish`
then checks the sizes of what is there against the local files it has.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointError
from ..storage import COMMIT_MARKER, STAGING_SUFFIX, EntryStat, PosixStorage
from .client import S3Client
from .url import S3Url

# Where `fetch` downloads an entry before it takes the entry's local name.
FETCH_SUFFIX = ".fetch"


class S3Storage:
    """`CheckpointStorage` whose entries live under `url` (an `s3://BUCKET/PREFIX`),
    staged and mirrored in the local folder `root`.

    `staging_marker` and `fence` mean what they mean for `PosixStorage`: a file made in
    every staging folder (never uploaded), and a check called before a save is staged,
    before `publish` changes anything and just before the manifest goes up.
    """

    def __init__(
        self,
        url: S3Url,
        root: str | Path,
        *,
        client: S3Client | None = None,
        staging_marker: str | None = None,
        fence: Callable[[str], None] | None = None,
        behind: bool = False,
    ) -> None:
        self.url = url
        self.root = Path(root)
        self.client = client or S3Client()
        self.staging_marker = staging_marker
        self.fence = fence
        # The local side (staging folders, the published copy) is a POSIX storage
        # without fsync: the store holds the durable copy.
        self._local = PosixStorage(self.root, durable=False, staging_marker=staging_marker)
        self.behind = behind
        self._upload: _Upload | None = None

    # -- the write side ----------------------------------------------------------------

    def staging_path(self, name: str) -> Path:
        return self._local.staging_path(name)

    def new_staging(self, name: str) -> Path:
        """The local staging folder, and in the store no upload of an earlier try of
        `name` left (so every object `publish` finds is this save's)."""
        self.wait()  # the next save waits only for an upload still running
        if self.fence is not None:
            self.fence(name)
        staged = self._local.new_staging(name)
        self.client.delete_prefix(self._beside(name))
        if not self._committed(name):
            self.client.delete_prefix(self._entry(name))
        return staged

    def sync(self, staged: Path, files: Iterable[str]) -> None:
        """Upload these files of the staged save (each rank its share); behind training,
        `publish` uploads them all instead."""
        if self.behind:
            return
        target = self._upload_prefix(_entry_name(staged))
        for rel in files:
            if rel != self.staging_marker:
                self.client.put_file(staged / rel, target.child(rel))

    def publish(self, name: str, *, replace: bool = False) -> Path:
        staged, entry = self.staging_path(name), self._entry(name)
        files = self._local_files(staged)
        if COMMIT_MARKER not in files:
            raise CheckpointError(f"{staged} holds no {COMMIT_MARKER}: nothing to publish")
        if self.fence is not None:
            self.fence(name)
        committed = self._committed(name)
        if committed and not replace:
            raise CheckpointError(f"{entry} already exists; nothing was replaced")
        if not self.behind:
            self._commit(name, staged, files, committed)
            return self._local.publish(name, replace=True)
        self.wait()
        final = self._local.publish(name, replace=True)
        self._upload = _Upload(name, lambda: self._commit(name, final, files, committed))
        return final

    def wait(self) -> None:
        """Until the upload running behind training (`behind=True`) has ended; its
        failure is raised here, once (the checkpoint it was for is not committed)."""
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.join()

    def _wait_for(self, name: str) -> None:
        if self._upload is not None and self._upload.name == name:
            self.wait()

    def _commit(self, name: str, source: Path, files: dict[str, int], committed: bool) -> None:
        """Upload what `sync` did not, then the manifest: `files` (sizes by relative
        path) are read from `source`. A complete entry of that name stays whole while
        the new files go up beside it; it is uncommitted only to be replaced."""
        started = time.perf_counter()
        entry, beside = self._entry(name), self._beside(name)
        old = {_relative(o.url, entry) for o in self.client.list(entry).objects}
        if committed:
            there = {_relative(o.url, beside): o.size for o in self.client.list(beside).objects}
            for rel, size in files.items():
                if rel != COMMIT_MARKER and there.get(rel) != size:
                    self.client.put_file(source / rel, beside.child(rel))
            # The old entry stops being complete before any of its objects changes.
            self.client.delete([entry.child(COMMIT_MARKER)])
            uploaded = self._move_in(beside, entry, files)
        else:
            # `new_staging` emptied `<name>/`: what is there, `sync` uploaded.
            uploaded = {_relative(o.url, entry): o.size for o in self.client.list(entry).objects}
        for rel, size in files.items():
            if rel != COMMIT_MARKER and uploaded.get(rel) != size:
                self.client.put_file(source / rel, entry.child(rel))
        # The replaced entry's objects that this save does not hold.
        self.client.delete(entry.child(rel) for rel in old if rel not in files)
        _record_upload_time(source / COMMIT_MARKER, time.perf_counter() - started)
        if self.fence is not None:  # last, just before the commit
            self.fence(name)
        self.client.put_file(source / COMMIT_MARKER, entry.child(COMMIT_MARKER))
        self.client.delete_prefix(beside)

    def _move_in(self, beside: S3Url, entry: S3Url, local: dict[str, int]) -> dict[str, int]:
        """Copy the objects uploaded beside the entry into it (inside the store); their
        sizes by name."""
        moved = {}
        for info in self.client.list(beside).objects:
            rel = _relative(info.url, beside)
            if rel in local:
                self.client.copy(info.url, entry.child(rel))
                moved[rel] = info.size
        return moved

    def delete(self, name: str) -> None:
        """Uncommit (the manifest first), then the rest, then the local copy."""
        self._wait_for(name)
        entry = self._entry(name)
        self.client.delete([entry.child(COMMIT_MARKER)])
        self.client.delete_prefix(entry)
        if (self.root / name).exists():
            self._local.delete(name)

    def discard(self, name: str) -> None:
        """Abandon a staged save: its local folder and what it uploaded."""
        self._wait_for(name)
        self._local.discard(name)
        self.client.delete_prefix(self._beside(name))
        if not self._committed(name):
            self.client.delete_prefix(self._entry(name))

    def clean_stale(self, ours: Callable[[str], bool]) -> list[str]:
        """The local leftovers, and in the store every `<name>.tmp/` and every `<name>/`
        without a manifest whose name `ours` accepts (uploads of crashed saves)."""
        self.wait()  # an upload running behind is no crashed save's
        removed = self._local.clean_stale(ours)
        for folder in self.client.list(self.url, folders=True).folders:
            name = _relative(folder, self.url)
            staged = name.endswith(STAGING_SUFFIX) and ours(name[: -len(STAGING_SUFFIX)])
            torn = ours(name) and not self._committed(name)
            if staged or torn:
                self.client.delete_prefix(folder)
                removed.append(f"{self.url.child(name)}")
        return removed

    def fetch(self, name: str) -> Path:
        """The complete entry `name` in `root/<name>`, where readers find its files by
        path (resume, `consolidate`, `convert` on another machine than the writer's):
        downloaded unless a local copy with every object's size is there already; the
        manifest comes down last, so a fetch cut short never looks complete."""
        entry, final = self._entry(name), self.root / name
        if not self._committed(name):
            raise CheckpointError(f"{entry} is not a complete checkpoint (no {COMMIT_MARKER})")
        sizes = {_relative(o.url, entry): o.size for o in self.client.list(entry).objects}
        if all(_has_size(final / rel, size) for rel, size in sizes.items()):
            return final
        partial = self.root / f"{name}{FETCH_SUFFIX}"
        shutil.rmtree(partial, ignore_errors=True)
        for rel in sorted(sizes, key=lambda rel: rel == COMMIT_MARKER):
            (partial / rel).parent.mkdir(parents=True, exist_ok=True)
            self.client.get_file(entry.child(rel), partial / rel)
        shutil.rmtree(final, ignore_errors=True)  # an incomplete local copy, never the store's
        partial.rename(final)
        return final

    # -- the read side: what is in the store ---------------------------------------------

    def exists(self, rel: str) -> bool:
        target = self._at(rel)
        if rel and self.client.exists(target):
            return True
        listing = self.client.list(target, folders=True)
        return bool(listing.objects or listing.folders)

    def listdir(self, prefix: str = "") -> list[str]:
        folder = self._at(prefix)
        listing = self.client.list(folder, folders=True)
        names = {_relative(o.url, folder) for o in listing.objects}
        names.update(_relative(f, folder) for f in listing.folders)
        return sorted(names)

    def open(self, rel: str) -> BinaryIO:
        target = self._at(rel)
        if self.client.head(target) is None:
            raise FileNotFoundError(f"no object {target}")
        return self.client.open(target)

    def stat(self, rel: str) -> EntryStat:
        found = self.client.head(self._at(rel))
        if found is None:
            raise FileNotFoundError(f"no object {self._at(rel)}")
        return EntryStat(size=found.size, mtime=found.mtime)

    # -- names ---------------------------------------------------------------------------

    def _entry(self, name: str) -> S3Url:
        return self.url.child(name)

    def _beside(self, name: str) -> S3Url:
        """Where a save that replaces a complete `name` uploads its files meanwhile."""
        return self.url.child(f"{name}{STAGING_SUFFIX}")

    def _committed(self, name: str) -> bool:
        return self.client.exists(self._entry(name).child(COMMIT_MARKER))

    def _upload_prefix(self, name: str) -> S3Url:
        """Straight into `<name>/`, unless a complete `name` is there (this save will
        replace it): then beside it, so it stays whole until `publish`."""
        return self._beside(name) if self._committed(name) else self._entry(name)

    def _at(self, rel: str) -> S3Url:
        parts = [part for part in rel.split("/") if part]
        if rel.startswith("/") or ".." in parts:
            raise ValueError(f"storage key {rel!r} is not a path below the root")
        return self.url.child(*parts)

    def _local_files(self, staged: Path) -> dict[str, int]:
        """The staged save's files (relative POSIX paths) and sizes, the marker left out."""
        return {
            path.relative_to(staged).as_posix(): path.stat().st_size
            for path in sorted(staged.rglob("*"))
            if path.is_file() and path.relative_to(staged).as_posix() != self.staging_marker
        }


class _Upload:
    """One upload running behind training, in a thread of its own (not a daemon: a rank
    that ends without `wait` still finishes it before the interpreter exits)."""

    def __init__(self, name: str, run: Callable[[], None]) -> None:
        self.name = name
        self._run = run
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"s3-upload-{name}")
        self._thread.start()

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as error:  # handed to the thread that waits
            self._error = error

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _record_upload_time(manifest: Path, seconds: float) -> None:
    """`upload_s` (the data objects' upload, in seconds) added to the manifest before it
    goes up, beside the writer's `save_s`; a manifest without `save_s` (a converter's
    output, which times nothing) is left as it is."""
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except ValueError:
        return
    if not isinstance(data, dict) or "save_s" not in data:
        return
    data["upload_s"] = round(seconds, 3)
    partial = manifest.with_name(f"{manifest.name}.partial")
    partial.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(partial, manifest)  # a reader of the local copy sees one or the other


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _entry_name(staged: Path) -> str:
    if not staged.name.endswith(STAGING_SUFFIX):
        raise ValueError(f"{staged} is not a staging folder (*{STAGING_SUFFIX})")
    return staged.name[: -len(STAGING_SUFFIX)]


def _relative(url: S3Url, below: S3Url) -> str:
    """`url`'s key below the folder `below` ("run/step-1/a" below "run" → "step-1/a")."""
    return url.key[len(below.folder_key) :]
