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

`delete` removes the manifest first, then the rest.

More than one node (`nodes > 1`): no node sees another's staging folder (each stages in
its own `root`, node-local). Every node uploads the files its own ranks wrote: node 0
through `publish` (it also cleans the store in `new_staging` and commits), every other
node through `publish_node`, which ends its upload with a small list object
(`<prefix>/.nodes/node-NNNNN.json`: each file's size and sha256, or the error that
stopped it) and then drops its local copy. Node 0's upload waits for every other
node's list, checks that the lists and its own files cover the manifest's files with
the same size and sha256 and that each object is in the store with that size, deletes
the lists and only then puts the manifest. A node lost before its list went up: no
manifest, that checkpoint never counts (node 0 gives up after `node_wait_s`, or at
once when its own process is ending), and the previous one is the newest complete one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import CheckpointError
from ..storage import COMMIT_MARKER, STAGING_SUFFIX, EntryStat, PosixStorage
from .client import S3Client
from .url import S3Url

# Where `fetch` downloads an entry before it takes the entry's local name.
FETCH_SUFFIX = ".fetch"
# Below an upload's prefix: one object per node (other than node 0) whose upload ended.
NODE_LISTS = ".nodes"
# How long node 0 waits for the other nodes' lists: as long as a checkpoint collective
# may take (`train/checkpoint.CKPT_GROUP_TIMEOUT`); a node silent that long is lost.
NODE_WAIT_S = 1800.0
# Between two looks for the other nodes' lists (a few requests per second at most).
NODE_POLL_S = 0.2


class S3Storage:
    """`CheckpointStorage` whose entries live under `url` (an `s3://BUCKET/PREFIX`),
    staged and mirrored in the local folder `root`.

    `staging_marker` and `fence` mean what they mean for `PosixStorage`: a file made in
    every staging folder (never uploaded), and a check called before a save is staged,
    before `publish` changes anything and just before the manifest goes up (and, on a
    node other than 0, before each of its uploads).

    `node` of `nodes`: which node this storage stages for; `root` is that node's own
    folder. Node 0 publishes; the others `publish_node` (see the module docstring).
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
        node: int = 0,
        nodes: int = 1,
        node_wait_s: float = NODE_WAIT_S,
    ) -> None:
        if not 0 <= node < nodes:
            raise ValueError(f"node {node} of {nodes}: expected 0 <= node < nodes")
        self.url = url
        self.root = Path(root)
        self.client = client or S3Client()
        self.staging_marker = staging_marker
        self.fence = fence
        # The local side (staging folders, the published copy) is a POSIX storage
        # without fsync: the store holds the durable copy.
        self._local = PosixStorage(self.root, durable=False, staging_marker=staging_marker)
        self.behind = behind
        self.node, self.nodes, self.node_wait_s = node, nodes, node_wait_s
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
        if self.node == 0:  # the store is cleaned once, by the node that commits
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
        if self.node != 0:
            raise CheckpointError(f"node {self.node} does not commit {name}: publish_node")
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

    def publish_node(self, name: str, files: dict[str, dict[str, Any]]) -> None:
        """On a node other than 0: upload this node's `files` of the staged save (its
        ranks' files, `{rel: {"size", "sha256"}}` as in the manifest), then its list
        object, which node 0 waits for before it commits; behind training when
        `behind`. The local copy goes once the list is up (node 0 keeps the store's)."""
        if self.node == 0:
            raise CheckpointError(f"node 0 commits {name}: publish, not publish_node")
        self.wait()
        final = self._local.publish(name, replace=True)
        if self.behind:
            self._upload = _Upload(name, lambda: self._upload_node(name, final, files))
        else:
            self._upload_node(name, final, files)

    def _upload_node(self, name: str, source: Path, files: dict[str, dict[str, Any]]) -> None:
        # Into `<name>/`, or beside a complete `name` this save replaces: node 0 has not
        # touched the old entry yet (it waits for this very list), so every node agrees.
        target = self._upload_prefix(name)
        listed = target.child(NODE_LISTS, _list_name(self.node))
        try:
            for rel in sorted(files):
                if self.fence is not None:
                    self.fence(name)
                self.client.put_file(source / rel, target.child(rel))
            self._put_json({"node": self.node, "files": files}, listed)
        except BaseException as error:
            # Tell node 0 at once rather than let it wait `node_wait_s` (best effort:
            # the store may be what failed).
            with contextlib.suppress(Exception):
                self._put_json({"node": self.node, "error": str(error)}, listed)
            raise
        self._local.delete(name)

    def _put_json(self, data: dict[str, Any], url: S3Url) -> None:
        self.client.put_bytes(json.dumps(data, sort_keys=True).encode(), url)

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
        the new files go up beside it; it is uncommitted only to be replaced. With more
        than one node, the other nodes' files are theirs to upload: their lists are
        waited for and checked before anything of the old entry changes."""
        started = time.perf_counter()
        entry, beside = self._entry(name), self._beside(name)
        old = {_relative(o.url, entry) for o in self.client.list(entry).objects}
        target = beside if committed else entry
        # `new_staging` emptied the target: what is there, `sync` uploaded.
        there = {_relative(o.url, target): o.size for o in self.client.list(target).objects}
        for rel, size in files.items():
            if rel != COMMIT_MARKER and there.get(rel) != size:
                self.client.put_file(source / rel, target.child(rel))
        expected = dict(files)
        if self.nodes > 1:
            expected.update(self._other_nodes_done(name, target, source / COMMIT_MARKER))
        if committed:
            # The old entry stops being complete before any of its objects changes.
            self.client.delete([entry.child(COMMIT_MARKER)])
            self._move_in(beside, entry, expected)
        uploaded = {_relative(o.url, entry): o.size for o in self.client.list(entry).objects}
        for rel, size in expected.items():
            if rel == COMMIT_MARKER or uploaded.get(rel) == size:
                continue
            if rel not in files:  # another node's file, gone between its list and now
                raise CheckpointError(
                    f"{entry.child(rel)} is not in the store with its {size} bytes; "
                    f"{name} is not committed"
                )
            self.client.put_file(source / rel, entry.child(rel))
        # The replaced entry's objects that this save does not hold.
        self.client.delete(entry.child(rel) for rel in old if rel not in expected)
        _record_upload_time(source / COMMIT_MARKER, time.perf_counter() - started)
        if self.fence is not None:  # last, just before the commit
            self.fence(name)
        self.client.put_file(source / COMMIT_MARKER, entry.child(COMMIT_MARKER))
        self.client.delete_prefix(beside)

    def _other_nodes_done(self, name: str, target: S3Url, manifest: Path) -> dict[str, int]:
        """Wait for the list of every node but this one under `target`; check that they
        and this node's files name each of the manifest's files with its size and
        sha256; delete the lists; the sizes of the files the other nodes uploaded."""
        described = _manifest_files(manifest)
        lists = self._wait_for_lists(name, target)
        theirs: dict[str, int] = {}
        for node, listed in sorted(lists.items()):
            for rel, info in listed.items():
                if described.get(rel) != info:
                    raise CheckpointError(
                        f"node {node} uploaded {rel} of {name} as {info}, but the manifest "
                        f"says {described.get(rel)}; {name} is not committed"
                    )
                theirs[rel] = int(info["size"])
        mine = set(_local_names(manifest.parent))
        unlisted = sorted(set(described) - set(theirs) - mine)
        if unlisted:
            raise CheckpointError(
                f"{name} is not committed: no node uploaded {', '.join(unlisted[:5])}"
            )
        self.client.delete(target.child(NODE_LISTS, _list_name(n)) for n in lists)
        return theirs

    def _wait_for_lists(self, name: str, target: S3Url) -> dict[int, dict[str, Any]]:
        """Every other node's list under `target` (`{node: {rel: {"size", "sha256"}}}`),
        as it arrives; a node's error is raised at once, a node silent past the
        deadline (or this process ending) is the end of this checkpoint."""
        lists: dict[int, dict[str, Any]] = {}
        started = time.monotonic()
        deadline = started + self.node_wait_s
        folder = target.child(NODE_LISTS)
        while True:
            # One listing per look, however many nodes: a large job polls no harder.
            arrived = {_relative(o.url, folder) for o in self.client.list(folder).objects}
            for node in range(1, self.nodes):
                if node in lists or _list_name(node) not in arrived:
                    continue
                data = json.loads(self.client.read_bytes(folder.child(_list_name(node))))
                if "error" in data:
                    raise CheckpointError(
                        f"node {node} could not upload its files of {name}: {data['error']}; "
                        f"{name} is not committed"
                    )
                lists[node] = data["files"]
            missing = [node for node in range(1, self.nodes) if node not in lists]
            if not missing:
                return lists
            if time.monotonic() > deadline or not threading.main_thread().is_alive():
                nodes = ", ".join(str(node) for node in missing)
                plural = "s" if len(missing) > 1 else ""
                waited = time.monotonic() - started
                raise CheckpointError(
                    f"{self._entry(name)} is not committed: node{plural} {nodes} did not "
                    f"finish uploading its files (waited {waited:.0f} s)"
                )
            time.sleep(NODE_POLL_S)

    def _move_in(self, beside: S3Url, entry: S3Url, wanted: dict[str, int]) -> None:
        """Copy the objects of this save uploaded beside the entry into it (inside the
        store)."""
        for info in self.client.list(beside).objects:
            rel = _relative(info.url, beside)
            if rel in wanted:
                self.client.copy(info.url, entry.child(rel))

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
        if self.node != 0:  # the store is node 0's to clean (its next `new_staging`)
            return
        self.client.delete_prefix(self._beside(name))
        if not self._committed(name):
            self.client.delete_prefix(self._entry(name))

    def clean_stale(self, ours: Callable[[str], bool]) -> list[str]:
        """The local leftovers, and in the store every `<name>.tmp/` and every `<name>/`
        without a manifest whose name `ours` accepts (uploads of crashed saves)."""
        self.wait()  # an upload running behind is no crashed save's
        removed = self._local.clean_stale(ours)
        if self.node != 0:  # the store is node 0's to clean
            return removed + self._drop_local_copies(ours)
        for folder in self.client.list(self.url, folders=True).folders:
            name = _relative(folder, self.url)
            staged = name.endswith(STAGING_SUFFIX) and ours(name[: -len(STAGING_SUFFIX)])
            torn = ours(name) and not self._committed(name)
            if staged or torn:
                self.client.delete_prefix(folder)
                removed.append(f"{self.url.child(name)}")
        return removed

    def _drop_local_copies(self, ours: Callable[[str], bool]) -> list[str]:
        """On a node other than 0, every local copy of a checkpoint: such a node drops
        its copy once its upload is in, so one still here was left by a crashed upload
        or brought down for a resume that has loaded it."""
        found = [p.name for p in self.root.glob("*") if p.is_dir() and ours(p.name)]
        for name in found:
            self._local.delete(name)
        return found

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
        names = _local_names(staged)
        return {rel: (staged / rel).stat().st_size for rel in names if rel != self.staging_marker}


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


def _local_names(folder: Path) -> list[str]:
    """The files below `folder`, as sorted relative POSIX paths."""
    return sorted(
        path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()
    )


def _manifest_files(manifest: Path) -> dict[str, dict[str, Any]]:
    """The manifest's `files` (`{rel: {"size", "sha256"}}`): what node 0 checks the
    other nodes' lists against."""
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{manifest} names no files to check: {error}") from None
    if not isinstance(files, dict):
        raise CheckpointError(f"{manifest}: its files are not a table of size and sha256")
    return files


def _list_name(node: int) -> str:
    return f"node-{node:05d}.json"


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
