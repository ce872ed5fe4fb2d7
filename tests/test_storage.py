"""PosixStorage, the one publish path of checkpoints, `convert` and `consolidate`:
a staged folder is never listed, publish makes it visible whole (also while a
reader is looking), replace swaps, delete never leaves a complete-looking half."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from shardctl.orchestrator import storage as storage_mod
from shardctl.orchestrator.checkpoint_list import complete_checkpoints
from shardctl.orchestrator.errors import CheckpointError, UsageError
from shardctl.train.manifest import MANIFEST, complete_candidates
from shardctl.train.storage import CheckpointStorage, PosixStorage

FILES = ("a.bin", "sub/b.bin", "sub/deeper/c.bin")


def stage(storage: PosixStorage, name: str, generation: int) -> Path:
    """A staged folder of three files and a manifest, every byte tagged `generation`."""
    staged = storage.new_staging(name)
    for rel in FILES:
        (staged / rel).parent.mkdir(parents=True, exist_ok=True)
        (staged / rel).write_text(f"{generation}\n" * 1000)
    storage.sync(staged, FILES)
    (staged / MANIFEST).write_text(json.dumps({"generation": generation}))
    return staged


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def listed(storage: PosixStorage) -> list[str]:
    """The complete checkpoints the one lister finds, oldest first."""
    return [c.name for c in reversed(complete_checkpoints(storage))]


def test_posix_storage_is_a_checkpoint_storage(tmp_path: Path) -> None:
    assert isinstance(PosixStorage(tmp_path), CheckpointStorage)


def test_a_staged_folder_is_never_listed_and_publish_moves_it_whole(tmp_path: Path) -> None:
    storage = PosixStorage(tmp_path / "ckpts")
    staged = stage(storage, "step-00000002", 1)
    assert staged == tmp_path / "ckpts" / "step-00000002.tmp"
    # Complete on disk, manifest included, but not yet published: not listed.
    assert listed(storage) == []
    assert complete_candidates(storage) == []
    final = storage.publish("step-00000002")
    assert final == tmp_path / "ckpts" / "step-00000002"
    assert names(storage.root) == ["step-00000002"]
    assert listed(storage) == ["step-00000002"]
    assert complete_candidates(tmp_path / "ckpts") == [final]
    assert all((final / rel).read_text() == "1\n" * 1000 for rel in FILES)


def test_a_published_folder_without_manifest_is_not_complete(tmp_path: Path) -> None:
    storage = PosixStorage(tmp_path)
    storage.new_staging("step-00000001")
    storage.publish("step-00000001")
    assert (tmp_path / "step-00000001").is_dir()
    assert listed(storage) == []


def test_publish_refuses_to_replace_unless_asked(tmp_path: Path) -> None:
    storage = PosixStorage(tmp_path)
    stage(storage, "out", 1)
    storage.publish("out")
    stage(storage, "out", 2)
    with pytest.raises(CheckpointError, match="already exists; nothing was replaced"):
        storage.publish("out")
    assert json.loads((tmp_path / "out" / MANIFEST).read_text()) == {"generation": 1}
    storage.discard("out")
    assert names(tmp_path) == ["out"]


@pytest.mark.parametrize("exchange", [True, False], ids=["rename-exchange", "move-aside"])
def test_replace_swaps_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:  # file systems without renameat2 RENAME_EXCHANGE
        monkeypatch.setattr(storage_mod, "_rename_exchange", lambda a, b: False)
    storage = PosixStorage(tmp_path)
    stage(storage, "step-00000004", 1)
    storage.publish("step-00000004")
    stage(storage, "step-00000004", 2)
    storage.publish("step-00000004", replace=True)
    assert names(tmp_path) == ["step-00000004"]
    final = tmp_path / "step-00000004"
    assert all((final / rel).read_text() == "2\n" * 1000 for rel in FILES)


def test_a_reader_never_sees_a_partial_folder_while_it_is_replaced(tmp_path: Path) -> None:
    """Another process's view during publishes: a listed folder, once opened, holds
    every file, all from the save its manifest names (the old folder may vanish
    under the reader once replaced: then it is no longer the published one)."""
    storage = PosixStorage(tmp_path)
    stage(storage, "step-00000001", 0)
    storage.publish("step-00000001")
    done = threading.Event()
    reads: list[int] = []
    errors: list[str] = []

    def read_one(name: str) -> None:
        try:
            fd = os.open(tmp_path / name, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return  # moved aside between listing and opening
        try:
            try:
                with open(MANIFEST, opener=lambda p, f: os.open(p, f, dir_fd=fd)) as m:
                    generation = json.load(m)["generation"]
                contents = set()
                for rel in FILES:
                    with open(rel, opener=lambda p, f: os.open(p, f, dir_fd=fd)) as fh:
                        contents.add(fh.read())
            except FileNotFoundError as exc:
                still_published = os.stat(tmp_path / name).st_ino == os.fstat(fd).st_ino
                if still_published:
                    errors.append(f"published but partial: {exc}")
                return
            if contents != {f"{generation}\n" * 1000}:
                errors.append(f"manifest says save {generation}, files hold {contents!r:.80}")
            reads.append(generation)
        finally:
            os.close(fd)

    def read() -> None:
        reader = PosixStorage(tmp_path)
        while not done.is_set():
            for name in listed(reader):
                read_one(name)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        for generation in range(1, 40):
            stage(storage, "step-00000001", generation)
            storage.publish("step-00000001", replace=True)
    finally:
        done.set()
        reader.join(timeout=60)
    assert not reader.is_alive()
    assert errors == []
    assert reads, "the reader never read the published folder"


def test_delete_hides_first_and_a_crash_mid_delete_is_cleaned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = PosixStorage(tmp_path)
    for step in (1, 2):
        stage(storage, f"step-0000000{step}", step)
        storage.publish(f"step-0000000{step}")
    storage.delete("step-00000001")
    assert names(tmp_path) == ["step-00000002"]

    # A crash after the rename to trash, before the recursive delete.
    monkeypatch.setattr(storage_mod, "_remove", lambda path: None)
    storage.delete("step-00000002")
    monkeypatch.undo()
    assert listed(storage) == []
    [trash] = names(tmp_path)
    assert trash.startswith(".trash-step-00000002-")
    assert (tmp_path / trash / MANIFEST).is_file()  # whole, yet never listed

    stage(storage, "step-00000003", 3)  # a save that crashed before its publish
    (tmp_path / "notes.tmp").mkdir()  # not a name this caller owns: kept
    removed = storage.clean_stale(lambda name: name.startswith("step-"))
    assert sorted(removed) == sorted([trash, "step-00000003.tmp"])
    assert names(tmp_path) == ["notes.tmp"]


def test_a_staging_marker_guards_leftovers_and_is_gone_once_published(tmp_path: Path) -> None:
    storage = PosixStorage(tmp_path, staging_marker=".ours", durable=False)
    (tmp_path / "model.tmp").mkdir()  # someone else's folder
    with pytest.raises(UsageError, match=r"model\.tmp exists and was not made by shardctl"):
        storage.new_staging("model")
    (tmp_path / "model.tmp").rmdir()
    staged = storage.new_staging("model")
    (staged / "half.bin").write_bytes(b"x")  # an interrupted run's leftover ...
    staged = storage.new_staging("model")  # ... is ours: replaced by an empty folder
    assert names(staged) == [".ours"]
    (staged / "model.safetensors").write_bytes(b"weights")
    storage.publish("model")
    assert names(tmp_path / "model") == ["model.safetensors"]
