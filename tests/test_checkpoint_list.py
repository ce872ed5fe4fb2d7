"""The one lister of complete checkpoints (`orchestrator/checkpoint_list.py`): it reads
only through the storage's read side, so a storage that is not a folder (here an
in-memory object store with the protocol's whole behaviour) is listed the same way;
and it stays torch-free and outside `train/`."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import pytest
from shardctl.orchestrator import checkpoint_list as lister
from shardctl.orchestrator.attempts import newest_checkpoint
from shardctl.orchestrator.storage import COMMIT_MARKER, CheckpointStorage, EntryStat, PosixStorage
from shardctl.train.manifest import complete_candidates

MANIFEST_OF_10 = {"step": 10, "save_s": 4.5}
MANIFEST_OF_20 = {"step": 20, "save_s": 7.0}


class MemoryObjectStore:
    """`CheckpointStorage` over a dict of keys, as an object store behaves: a save is
    staged in a local folder and uploaded at publish, the manifest last; a deletion
    removes the manifest first. Nothing stored is a file under `root`."""

    def __init__(self, scratch: Path) -> None:
        self.root = scratch / "never-created"  # the lister must not read it
        self.scratch = scratch
        self.objects: dict[str, tuple[bytes, float]] = {}
        self.clock = 1000.0

    def put(self, key: str, data: bytes) -> None:
        self.clock += 1.0
        self.objects[key] = (data, self.clock)

    # The write side.
    def staging_path(self, name: str) -> Path:
        return self.scratch / f"{name}.tmp"

    def new_staging(self, name: str) -> Path:
        shutil.rmtree(self.staging_path(name), ignore_errors=True)
        self.staging_path(name).mkdir(parents=True)
        return self.staging_path(name)

    def sync(self, staged: Path, files: Iterable[str]) -> None:
        for rel in files:
            self.put(f"{staged.name[: -len('.tmp')]}/{rel}", (staged / rel).read_bytes())

    def publish(self, name: str, *, replace: bool = False) -> Path:
        staged = self.staging_path(name)
        files = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
        self.sync(staged, [rel for rel in files if rel != COMMIT_MARKER])
        self.sync(staged, [COMMIT_MARKER])  # its arrival commits the checkpoint
        return self.root / name

    def delete(self, name: str) -> None:
        self.objects.pop(f"{name}/{COMMIT_MARKER}")  # uncommitted first
        for key in [k for k in self.objects if k.startswith(f"{name}/")]:
            del self.objects[key]

    def discard(self, name: str) -> None:
        shutil.rmtree(self.staging_path(name), ignore_errors=True)

    def clean_stale(self, ours: Callable[[str], bool]) -> list[str]:
        stale = {k.split("/")[0] for k in self.objects} - {
            k.split("/")[0] for k in self.objects if k.endswith(f"/{COMMIT_MARKER}")
        }
        for key in [k for k in self.objects if k.split("/")[0] in stale]:
            del self.objects[key]
        return sorted(stale)

    # The read side.
    def exists(self, rel: str) -> bool:
        return rel in self.objects or any(k.startswith(f"{rel}/") for k in self.objects)

    def listdir(self, prefix: str = "") -> list[str]:
        start = f"{prefix}/" if prefix else ""
        return sorted({k[len(start) :].split("/")[0] for k in self.objects if k.startswith(start)})

    def open(self, rel: str) -> BinaryIO:
        if rel not in self.objects:
            raise FileNotFoundError(rel)
        return io.BytesIO(self.objects[rel][0])

    def stat(self, rel: str) -> EntryStat:
        if rel not in self.objects:
            raise FileNotFoundError(rel)
        data, mtime = self.objects[rel]
        return EntryStat(size=len(data), mtime=mtime)


def save(store: MemoryObjectStore, step: int, manifest: dict[str, object]) -> None:
    staged = store.new_staging(lister.step_dirname(step))
    (staged / "model").mkdir()
    (staged / "model" / "shard-0.bin").write_bytes(b"x" * 8)
    (staged / COMMIT_MARKER).write_text(json.dumps(manifest))
    store.publish(lister.step_dirname(step))


def test_the_lister_reads_an_object_store_through_the_seam(tmp_path: Path) -> None:
    store = MemoryObjectStore(tmp_path)
    assert isinstance(store, CheckpointStorage)
    assert lister.complete_checkpoints(store) == []
    save(store, 10, MANIFEST_OF_10)
    save(store, 20, MANIFEST_OF_20)
    # An upload cut short before its manifest, and keys that are no checkpoint.
    store.put("step-00000030/model/shard-0.bin", b"partial")
    store.put("step-00000040.tmp/manifest.json", b"{}")
    store.put("notes/manifest.json", b"{}")

    found = lister.complete_checkpoints(store)
    assert [(c.step, c.name) for c in found] == [(20, "step-00000020"), (10, "step-00000010")]
    assert found[0].manifest() == MANIFEST_OF_20
    assert found[0].committed_at() == store.objects[f"step-00000020/{COMMIT_MARKER}"][1]
    assert found[0].path == store.root / "step-00000020"
    assert [(e.name, e.staged) for e in lister.step_entries(store)] == [
        ("step-00000010", False),
        ("step-00000020", False),
        ("step-00000030", False),
        ("step-00000040.tmp", True),
    ]
    assert not lister.is_committed(store, "step-00000030")
    assert lister.save_times(store) == [4.5, 7.0]
    newest_first = [store.root / "step-00000020", store.root / "step-00000010"]
    assert complete_candidates(store) == newest_first
    assert not store.root.exists()  # everything came through the read side


def test_a_deletion_uncommits_first_and_the_newest_is_the_one_before(tmp_path: Path) -> None:
    store = MemoryObjectStore(tmp_path)
    save(store, 10, MANIFEST_OF_10)
    save(store, 20, MANIFEST_OF_20)
    store.objects.pop(f"step-00000020/{COMMIT_MARKER}")  # a delete stopped after step one
    newest = lister.newest_complete(store)
    assert newest is not None and newest.step == 10
    assert store.clean_stale(lambda name: True) == ["step-00000020"]
    assert lister.step_entries(store) == [lister.StepEntry(10, "step-00000010", False)]


def test_a_manifest_that_is_not_json_is_listed_but_measures_nothing(tmp_path: Path) -> None:
    store = MemoryObjectStore(tmp_path)
    save(store, 10, MANIFEST_OF_10)
    store.put(f"step-00000010/{COMMIT_MARKER}", b"{cut sho")
    [checkpoint] = lister.complete_checkpoints(store)  # committed; `verify` judges it
    with pytest.raises(ValueError):
        checkpoint.manifest()
    assert lister.save_times(store) == []


def test_posix_storage_read_side(tmp_path: Path) -> None:
    storage = PosixStorage(tmp_path / "ckpts")
    assert storage.listdir() == [] and not storage.exists("step-00000001")
    (tmp_path / "ckpts" / "step-00000001").mkdir(parents=True)
    (tmp_path / "ckpts" / "step-00000001" / COMMIT_MARKER).write_text("{}")
    assert storage.listdir() == ["step-00000001"]
    assert storage.listdir("step-00000001") == [COMMIT_MARKER]
    assert storage.listdir(f"step-00000001/{COMMIT_MARKER}") == []  # a file: nothing below
    with storage.open(f"step-00000001/{COMMIT_MARKER}") as stream:
        assert stream.read() == b"{}"
    assert storage.stat(f"step-00000001/{COMMIT_MARKER}").size == 2
    with pytest.raises(FileNotFoundError):
        storage.stat("step-00000002/manifest.json")
    with pytest.raises(ValueError, match="not a path below the root"):
        storage.exists("../elsewhere")
    assert newest_checkpoint(tmp_path / "ckpts") is not None


def test_a_posix_folder_without_manifest_a_tmp_and_trash_are_never_complete(
    tmp_path: Path,
) -> None:
    for name, marker in (
        ("step-00000001", True),
        ("step-00000002", False),
        ("step-00000003.tmp", True),
        (".trash-step-00000004-1-2", True),
    ):
        (tmp_path / name).mkdir()
        if marker:
            (tmp_path / name / COMMIT_MARKER).write_text("{}")
    assert [c.name for c in lister.complete_checkpoints(tmp_path)] == ["step-00000001"]
    assert not lister.committed_folder(tmp_path / "step-00000003.tmp")
    assert lister.committed_folder(tmp_path / "step-00000001")


def imported_by(module: str) -> list[str]:
    """Every module a fresh interpreter holds after importing `module`."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    "module", ["shardctl.orchestrator.checkpoint_list", "shardctl.orchestrator.attempts"]
)
def test_the_lister_imports_no_torch_and_nothing_of_train(module: str) -> None:
    modules = imported_by(module)
    assert module in modules  # the interpreter really imported it
    assert [m for m in modules if m == "torch" or m.startswith("torch.")] == []
    assert [m for m in modules if m.startswith("shardctl.train")] == []


def test_the_import_check_sees_train() -> None:
    # The check above could pass on a wrong module list; it sees a real import of train/.
    assert "shardctl.train.manifest" in imported_by("shardctl.train.manifest")
