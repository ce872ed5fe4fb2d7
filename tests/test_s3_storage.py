"""`S3Storage` (orchestrator/s3/storage.py) against a real S3 server (SeaweedFS, the
session's `s3_server` fixture): the manifest goes up last and comes down first, a torn
upload is never listed complete, a replaced entry stays whole until the new one is
committed, a stale writer cannot commit, and shardctl's one lister reads it."""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from pathlib import Path

import pytest
from helpers.s3_server import S3Server, isolate_aws_settings
from shardctl.orchestrator.checkpoint_list import complete_checkpoints, step_entries
from shardctl.orchestrator.errors import CheckpointError
from shardctl.orchestrator.s3 import S3Client, parse_s3_url
from shardctl.orchestrator.s3.storage import S3Storage
from shardctl.orchestrator.storage import CheckpointStorage

MARKER = ".shardctl-staging"


@pytest.fixture
def storage(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Storage:
    isolate_aws_settings(monkeypatch, tmp_path)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = s3_server.make_bucket(f"st-{uuid.uuid4().hex[:12]}")
    return S3Storage(
        parse_s3_url(f"s3://{bucket}/run/checkpoints"),
        tmp_path / "local",
        client=S3Client(max_attempts=2),
        staging_marker=MARKER,
    )


def keys(storage: S3Storage, below: str = "") -> dict[str, bytes]:
    """Every object under the storage's prefix (or `below` it), read with plain boto3."""
    raw = storage.client._client
    prefix = storage.url.child(below).folder_key
    found = {}
    for page in raw.get_paginator("list_objects_v2").paginate(
        Bucket=storage.url.bucket, Prefix=prefix
    ):
        for item in page.get("Contents", []):
            body = raw.get_object(Bucket=storage.url.bucket, Key=item["Key"])["Body"].read()
            found[item["Key"][len(storage.url.folder_key) :]] = body
    return found


def stage(storage: S3Storage, name: str, files: dict[str, bytes]) -> Path:
    """A save of `files` staged as a writer and the checkpoint manager would: data files,
    then the manifest (a stand-in: the storage only knows its name) written last."""
    staged = storage.new_staging(name)
    for rel, data in files.items():
        (staged / rel).parent.mkdir(parents=True, exist_ok=True)
        (staged / rel).write_bytes(data)
    (staged / "manifest.json").write_text(json.dumps({"files": sorted(files)}))
    return staged


def record_writes(storage: S3Storage) -> list[tuple[str, str]]:
    """(operation, key) of every write and delete request the storage's client sends."""
    seen: list[tuple[str, str]] = []

    def note(params: dict, model, **_: object) -> None:
        if "Key" in params:
            seen.append((model.name, params["Key"].split("/checkpoints/", 1)[1]))
        for item in params.get("Delete", {}).get("Objects", []):
            seen.append((model.name, item["Key"].split("/checkpoints/", 1)[1]))

    events = storage.client._client.meta.events
    for operation in ("PutObject", "CreateMultipartUpload", "DeleteObjects", "CopyObject"):
        events.register(f"provide-client-params.s3.{operation}", note)
    return seen


def test_it_is_a_checkpoint_storage(storage: S3Storage) -> None:
    assert isinstance(storage, CheckpointStorage)


def test_a_save_goes_up_with_its_manifest_last_and_is_listed_complete(
    storage: S3Storage,
) -> None:
    files = {"dcp/__0_0.distcp": os.urandom(3000), "trainer/rank-00000.pt": b"t" * 10}
    staged = stage(storage, "step-00000010", files)
    writes = record_writes(storage)
    storage.sync(staged, ["dcp/__0_0.distcp"])  # one rank's share; publish sends the rest
    final = storage.publish("step-00000010", replace=True)

    assert [key for op, key in writes if op == "PutObject"][-1] == "step-00000010/manifest.json"
    assert keys(storage) == {
        "step-00000010/dcp/__0_0.distcp": files["dcp/__0_0.distcp"],
        "step-00000010/trainer/rank-00000.pt": b"t" * 10,
        "step-00000010/manifest.json": (staged.parent / "step-00000010/manifest.json").read_bytes(),
    }
    assert final == storage.root / "step-00000010"  # the local copy readers find by path
    assert (final / "dcp/__0_0.distcp").read_bytes() == files["dcp/__0_0.distcp"]
    assert not (final / MARKER).exists() and not staged.exists()
    assert [c.name for c in complete_checkpoints(storage)] == ["step-00000010"]
    assert complete_checkpoints(storage)[0].manifest() == {
        "files": ["dcp/__0_0.distcp", "trainer/rank-00000.pt"]
    }


def test_a_torn_upload_is_never_complete_and_is_cleaned(storage: S3Storage) -> None:
    stage(storage, "step-00000010", {"a.bin": b"a"})
    storage.publish("step-00000010")
    staged = stage(storage, "step-00000020", {"a.bin": b"b", "b.bin": b"c"})
    storage.sync(staged, ["a.bin", "b.bin"])  # the files are up; the writer dies here

    assert "step-00000020/a.bin" in keys(storage)
    assert [(e.name, e.staged) for e in step_entries(storage)][-2:] == [
        ("step-00000010", False),
        ("step-00000020", False),
    ]
    assert [c.name for c in complete_checkpoints(storage)] == ["step-00000010"]

    removed = storage.clean_stale(lambda name: name.startswith("step-"))
    assert f"{storage.url}/step-00000020" in removed
    assert set(keys(storage)) == {"step-00000010/a.bin", "step-00000010/manifest.json"}


def test_a_new_try_of_a_name_drops_what_a_crashed_try_uploaded(storage: S3Storage) -> None:
    staged = stage(storage, "step-00000030", {"a.bin": b"a", "old-only.bin": b"x"})
    storage.sync(staged, ["a.bin", "old-only.bin"])  # crashed before publish
    stage(storage, "step-00000030", {"a.bin": b"A"})
    storage.publish("step-00000030")
    assert keys(storage, "step-00000030") == {
        "step-00000030/a.bin": b"A",
        "step-00000030/manifest.json": b'{"files": ["a.bin"]}',
    }


def test_a_replaced_entry_stays_whole_until_the_new_one_commits(storage: S3Storage) -> None:
    stage(storage, "step-00000010", {"a.bin": b"old-a", "gone.bin": b"old-only"})
    storage.publish("step-00000010")
    staged = stage(storage, "step-00000010", {"a.bin": b"new-a", "b.bin": b"new-b"})
    storage.sync(staged, ["a.bin", "b.bin"])

    # Uploaded beside the complete entry, which is untouched.
    assert keys(storage, "step-00000010") == {
        "step-00000010/a.bin": b"old-a",
        "step-00000010/gone.bin": b"old-only",
        "step-00000010/manifest.json": b'{"files": ["a.bin", "gone.bin"]}',
    }
    assert [c.name for c in complete_checkpoints(storage)] == ["step-00000010"]

    writes = record_writes(storage)
    storage.publish("step-00000010", replace=True)
    assert writes[0] == ("DeleteObjects", "step-00000010/manifest.json")  # uncommit first
    commit = writes.index(("PutObject", "step-00000010/manifest.json"))
    assert {op for op, _key in writes[commit + 1 :]} == {"DeleteObjects"}  # commit last,
    assert {key for _op, key in writes[commit + 1 :]} == {  # then the upload beside goes
        "step-00000010.tmp/a.bin",
        "step-00000010.tmp/b.bin",
    }
    assert keys(storage) == {
        "step-00000010/a.bin": b"new-a",
        "step-00000010/b.bin": b"new-b",
        "step-00000010/manifest.json": b'{"files": ["a.bin", "b.bin"]}',
    }
    assert (storage.root / "step-00000010/b.bin").read_bytes() == b"new-b"


def test_publishing_over_a_complete_entry_without_replace_is_refused(storage: S3Storage) -> None:
    stage(storage, "model", {"w.bin": b"old"})
    storage.publish("model")
    staged = stage(storage, "model", {"w.bin": b"new"})
    storage.sync(staged, ["w.bin"])
    with pytest.raises(CheckpointError) as caught:
        storage.publish("model")
    assert str(caught.value) == f"{storage.url}/model already exists; nothing was replaced"
    assert keys(storage, "model") == {
        "model/w.bin": b"old",
        "model/manifest.json": b'{"files": ["w.bin"]}',
    }


def test_a_stale_writer_cannot_commit(storage: S3Storage) -> None:
    stage(storage, "step-00000010", {"a.bin": b"a"})
    storage.publish("step-00000010")
    staged = stage(storage, "step-00000020", {"a.bin": b"b"})
    storage.sync(staged, ["a.bin"])

    def refuse(name: str) -> None:
        raise CheckpointError(f"attempt no longer current: {name} not published")

    storage.fence = refuse
    with pytest.raises(CheckpointError, match="attempt no longer current"):
        storage.publish("step-00000020")
    assert "step-00000020/manifest.json" not in keys(storage)
    assert [c.name for c in complete_checkpoints(storage)] == ["step-00000010"]


def test_delete_takes_the_manifest_first(storage: S3Storage) -> None:
    stage(storage, "step-00000010", {"a.bin": b"a", "b.bin": b"b"})
    storage.publish("step-00000010")
    writes = record_writes(storage)
    storage.delete("step-00000010")
    assert writes[0] == ("DeleteObjects", "step-00000010/manifest.json")
    assert sorted(key for _op, key in writes[1:]) == ["step-00000010/a.bin", "step-00000010/b.bin"]
    assert keys(storage) == {}
    assert not (storage.root / "step-00000010").exists()


def test_the_read_side(storage: S3Storage) -> None:
    stage(storage, "step-00000010", {"dcp/x.distcp": b"12345", "top.bin": b"t"})
    storage.publish("step-00000010")

    assert storage.listdir("") == ["step-00000010"]
    assert storage.listdir("step-00000010") == ["dcp", "manifest.json", "top.bin"]
    assert storage.listdir("nothing-here") == []
    assert storage.exists("step-00000010") and storage.exists("step-00000010/dcp")
    assert storage.exists("step-00000010/dcp/x.distcp")
    assert not storage.exists("step-00000010/dcp/y.distcp")
    assert not storage.exists("step-00000020")
    with storage.open("step-00000010/dcp/x.distcp") as stream:
        assert stream.read() == b"12345"
    assert storage.stat("step-00000010/dcp/x.distcp").size == 5
    assert storage.stat("step-00000010/dcp/x.distcp").mtime > 1.7e9
    with pytest.raises(FileNotFoundError):
        storage.open("step-00000010/missing")
    with pytest.raises(FileNotFoundError):
        storage.stat("step-00000010/missing")
    with pytest.raises(ValueError, match="not a path below the root"):
        storage.exists("../other-run")


def test_fetch_brings_a_complete_entry_down_to_the_local_root(storage: S3Storage) -> None:
    files = {"dcp/x.distcp": os.urandom(5000), "top.bin": b"t"}
    stage(storage, "step-00000010", files)
    local = storage.publish("step-00000010")
    shutil.rmtree(local)  # another machine than the writer's: no local copy

    gets: list[str] = []
    storage.client._client.meta.events.register(
        "provide-client-params.s3.GetObject", lambda params, **_: gets.append(params["Key"])
    )
    assert storage.fetch("step-00000010") == local
    assert (local / "dcp/x.distcp").read_bytes() == files["dcp/x.distcp"]
    assert (local / "top.bin").read_bytes() == b"t"
    assert json.loads((local / "manifest.json").read_text()) == {
        "files": ["dcp/x.distcp", "top.bin"]
    }
    assert gets[-1].endswith("step-00000010/manifest.json")  # the commit marker last
    assert not list(storage.root.glob("*.fetch"))

    gets.clear()
    assert storage.fetch("step-00000010") == local  # whole already: nothing downloaded
    assert gets == []
    (local / "top.bin").write_bytes(b"")  # a torn local copy is fetched again
    storage.fetch("step-00000010")
    assert (local / "top.bin").read_bytes() == b"t"


def test_fetch_refuses_an_entry_that_is_not_complete(storage: S3Storage) -> None:
    staged = stage(storage, "step-00000020", {"a.bin": b"a"})
    storage.sync(staged, ["a.bin"])
    with pytest.raises(CheckpointError) as caught:
        storage.fetch("step-00000020")
    assert str(caught.value) == (
        f"{storage.url}/step-00000020 is not a complete checkpoint (no manifest.json)"
    )


def behind_of(storage: S3Storage) -> S3Storage:
    """The same storage with its uploads behind training."""
    return S3Storage(
        storage.url, storage.root, client=storage.client, staging_marker=MARKER, behind=True
    )


def test_behind_training_publish_returns_first_and_the_next_save_waits(
    storage: S3Storage,
) -> None:
    behind = behind_of(storage)
    reached, release = threading.Event(), threading.Event()
    order: list[str] = []

    def hold_the_manifest(params: dict, **_: object) -> None:
        if params["Key"].endswith("/manifest.json"):
            reached.set()
            assert release.wait(timeout=120), "the test never released the upload"
            order.append("commit")

    behind.client._client.meta.events.register(
        "provide-client-params.s3.PutObject", hold_the_manifest
    )
    staged = stage(behind, "step-00000010", {"a.bin": b"a" * 100, "b.bin": b"b"})
    behind.sync(staged, ["a.bin", "b.bin"])
    assert keys(behind) == {}  # nothing goes up while the ranks write
    final = behind.publish("step-00000010")

    # publish returned; the upload runs on and holds before its commit.
    assert (final / "a.bin").read_bytes() == b"a" * 100  # the local copy, at once
    assert reached.wait(timeout=120)
    assert set(keys(behind)) == {"step-00000010/a.bin", "step-00000010/b.bin"}
    assert complete_checkpoints(behind) == []  # not committed: never listed

    def next_save() -> None:
        behind.new_staging("step-00000020")
        order.append("next save staged")

    waiting = threading.Thread(target=next_save)
    waiting.start()
    waiting.join(timeout=2)
    assert waiting.is_alive()  # it waits for the upload still running
    release.set()
    waiting.join(timeout=120)
    assert not waiting.is_alive()
    assert order == ["commit", "next save staged"]
    assert [c.name for c in complete_checkpoints(behind)] == ["step-00000010"]


def test_behind_training_a_failed_upload_is_raised_once_by_wait(storage: S3Storage) -> None:
    behind = behind_of(storage)
    calls: list[str] = []

    def stale_once_the_upload_runs(name: str) -> None:
        calls.append(name)
        # new_staging's and publish's checks pass; the one just before the commit, in
        # the upload's thread, finds the attempt replaced.
        if len(calls) > 2:
            raise CheckpointError(f"attempt no longer current: {name} not published")

    behind.fence = stale_once_the_upload_runs
    stage(behind, "step-00000010", {"a.bin": b"a"})
    behind.publish("step-00000010")
    with pytest.raises(CheckpointError, match="attempt no longer current"):
        behind.wait()
    behind.wait()  # told once
    assert "step-00000010/manifest.json" not in keys(behind)
    assert complete_checkpoints(behind) == []
