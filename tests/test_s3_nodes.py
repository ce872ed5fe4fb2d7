"""A checkpoint on S3 saved by more than one node without a shared volume, against a
real S3 server (SeaweedFS, the session's `s3_server` fixture): each node stages in a
folder of its own and uploads its own files; node 0 writes the manifest only once every
other node's list of what it uploaded is in the store and agrees with the manifest. A
node that never finishes leaves no manifest, the previous checkpoint the newest."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path

import pytest
from helpers.s3_server import S3Server, isolate_aws_settings
from shardctl.orchestrator.checkpoint_list import complete_checkpoints
from shardctl.orchestrator.errors import CheckpointError
from shardctl.orchestrator.s3 import S3Client, parse_s3_url
from shardctl.orchestrator.s3.storage import S3Storage

# Node 0's files and node 1's: what each node's ranks wrote into its own folder.
NODE0 = {".metadata": b"meta", "__0_0.distcp": b"rank zero" * 100, "trainer/rank-00000.pt": b"t0"}
NODE1 = {"__1_0.distcp": b"rank one" * 120, "trainer/rank-00001.pt": b"t1"}
# Long enough for a loaded 2-core machine to upload a few small objects.
UPLOAD_DEADLINE_S = 120.0


def _described(files: dict[str, bytes]) -> dict[str, dict]:
    return {
        rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for rel, data in files.items()
    }


@pytest.fixture
def url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    isolate_aws_settings(monkeypatch, tmp_path)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = s3_server.make_bucket(f"nodes-{uuid.uuid4().hex[:12]}")
    return f"s3://{bucket}/run/checkpoints"


def _node(url: str, root: Path, node: int, wait_s: float = UPLOAD_DEADLINE_S) -> S3Storage:
    return S3Storage(
        parse_s3_url(url),
        root / f"node-{node}",
        client=S3Client(max_attempts=2),
        behind=True,
        node=node,
        nodes=2,
        node_wait_s=wait_s,
    )


def _stage(storage: S3Storage, name: str, files: dict[str, bytes]) -> Path:
    staged = storage.new_staging(name)
    for rel, data in files.items():
        (staged / rel).parent.mkdir(parents=True, exist_ok=True)
        (staged / rel).write_bytes(data)
    return staged


def _write_manifest(staged: Path, step: int, files: dict[str, dict]) -> None:
    (staged / "manifest.json").write_text(json.dumps({"step": step, "files": files}))


def _keys(storage: S3Storage, below: str) -> set[str]:
    return {
        info.url.key[len(storage.url.folder_key) :]
        for info in storage.client.list(storage.url.child(below)).objects
    }


def _wait_for_keys(storage: S3Storage, below: str, wanted: set[str]) -> None:
    deadline = time.monotonic() + UPLOAD_DEADLINE_S
    while not wanted <= _keys(storage, below):
        assert time.monotonic() < deadline, f"never uploaded: {wanted - _keys(storage, below)}"
        time.sleep(0.05)


def _save(node0: S3Storage, node1: S3Storage, step: int, *, node1_files=None) -> None:
    """One save of both nodes; node 1 uploads `node1_files` (its list) unless None."""
    name = f"step-{step:08d}"
    staged0 = _stage(node0, name, NODE0)
    _stage(node1, name, NODE1)
    _write_manifest(staged0, step, _described({**NODE0, **NODE1}))
    node0.publish(name, replace=True)
    if node1_files is not None:
        node1.publish_node(name, node1_files)


def test_the_manifest_goes_up_only_once_the_other_node_has_uploaded_its_files(
    url: str, tmp_path: Path
) -> None:
    node0, node1 = _node(url, tmp_path, 0), _node(url, tmp_path, 1)
    _save(node0, node1, 2)
    # Node 0's own files are up, and it waits for node 1's list: no manifest yet.
    _wait_for_keys(node0, "step-00000002", {f"step-00000002/{rel}" for rel in NODE0})
    assert "step-00000002/manifest.json" not in _keys(node0, "step-00000002")
    assert complete_checkpoints(node0) == []

    node1.publish_node("step-00000002", _described(NODE1))
    node1.wait()
    node0.wait()
    stored = _keys(node0, "step-00000002")
    every = {f"step-00000002/{rel}" for rel in [*NODE0, *NODE1, "manifest.json"]}
    assert stored == every  # node 1's files from node 1; the lists deleted before the commit
    assert [c.name for c in complete_checkpoints(node0)] == ["step-00000002"]
    # Neither node ever held the other's files; node 1 dropped its copy once uploaded.
    assert not (tmp_path / "node-0" / "step-00000002" / "__1_0.distcp").exists()
    assert not (tmp_path / "node-1" / "step-00000002").exists()
    # A reader on a third machine gets the whole checkpoint.
    reader = S3Storage(parse_s3_url(url), tmp_path / "reader", client=S3Client(max_attempts=2))
    fetched = reader.fetch("step-00000002")
    assert (fetched / "__1_0.distcp").read_bytes() == NODE1["__1_0.distcp"]
    assert (fetched / "__0_0.distcp").read_bytes() == NODE0["__0_0.distcp"]


def test_a_node_that_never_finishes_its_upload_leaves_no_manifest(url: str, tmp_path: Path) -> None:
    node0, node1 = _node(url, tmp_path, 0, wait_s=2.0), _node(url, tmp_path, 1)
    _save(node0, node1, 2, node1_files=_described(NODE1))
    node1.wait()
    node0.wait()
    # Node 1 is lost before its upload of step 4 ends: its list never comes.
    _save(node0, node1, 4)
    with pytest.raises(CheckpointError, match="node 1 did not finish uploading"):
        node0.wait()
    assert "step-00000004/__0_0.distcp" in _keys(node0, "step-00000004")
    assert "step-00000004/manifest.json" not in _keys(node0, "step-00000004")
    assert [c.name for c in complete_checkpoints(node0)] == ["step-00000002"]


def test_a_node_whose_upload_failed_stops_the_commit_at_once(url: str, tmp_path: Path) -> None:
    node0, node1 = _node(url, tmp_path, 0), _node(url, tmp_path, 1)
    # Node 1 names a file its folder does not hold: its upload fails, and it says so.
    lost = {**_described(NODE1), "__9_0.distcp": {"size": 1, "sha256": "0" * 64}}
    _save(node0, node1, 2, node1_files=lost)
    with pytest.raises(Exception, match=r"__9_0\.distcp"):
        node1.wait()
    with pytest.raises(CheckpointError, match="node 1 could not upload its files of step-"):
        node0.wait()
    assert "step-00000002/manifest.json" not in _keys(node0, "step-00000002")


def test_a_node_list_that_disagrees_with_the_manifest_is_refused(url: str, tmp_path: Path) -> None:
    node0, node1 = _node(url, tmp_path, 0), _node(url, tmp_path, 1)
    wrong = _described(NODE1)
    wrong["__1_0.distcp"] = {**wrong["__1_0.distcp"], "sha256": "f" * 64}
    _save(node0, node1, 2, node1_files=wrong)
    node1.wait()
    with pytest.raises(CheckpointError, match=r"uploaded __1_0\.distcp of step-00000002 as"):
        node0.wait()
    assert complete_checkpoints(node0) == []


def test_each_node_stages_in_a_folder_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks' node from what the launcher says of the ranks per node; with more than
    one node, a bucket's staging folder is the node's own under the run dir."""
    from shardctl.orchestrator.storage import checkpoint_storage
    from shardctl.train.checkpoint import RANKS_PER_NODE_ENV, _node_layout

    for name in RANKS_PER_NODE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert _node_layout(1, 2) == (0, 1, 2)  # no launcher said: one node
    monkeypatch.setenv("LOCAL_SIZE", "1")  # DeepSpeed's launcher
    assert [_node_layout(rank, 2) for rank in range(2)] == [(0, 2, 1), (1, 2, 1)]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's
    assert [_node_layout(rank, 4) for rank in range(4)] == [(0, 2, 2)] * 2 + [(1, 2, 2)] * 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # not a divisor: one node
    assert _node_layout(3, 4) == (0, 1, 4)
    roots = {
        checkpoint_storage("s3://bkt/p", run_dir="/r", node=node, nodes=2).root for node in (0, 1)
    }
    assert roots == {Path("/r/s3-cache/node-0/bkt/p"), Path("/r/s3-cache/node-1/bkt/p")}
    assert checkpoint_storage("s3://bkt/p", run_dir="/r").root == Path("/r/s3-cache/bkt/p")


def test_a_node_other_than_0_is_fenced_where_it_sees_the_runs_claim(tmp_path: Path) -> None:
    """Node 0 (the commit) is always fenced; another node where the run dir it sees holds
    the claim (shared: a stale attempt there stops), not where its run dir is its own."""
    from shardctl.orchestrator.fence import AttemptFence, StaleAttemptError, claim_attempt
    from shardctl.train.checkpoint import _fence_of_node

    shared, own = tmp_path / "shared", tmp_path / "own"
    claim_attempt(shared, "attempt-2")
    stale = AttemptFence(shared, "attempt-1")
    for node in (0, 1):
        with pytest.raises(StaleAttemptError):
            _fence_of_node(stale, node)("step-00000002")
    own.mkdir()
    alone = AttemptFence(own, "attempt-2")  # a pod's emptyDir: node 0 claimed elsewhere
    assert _fence_of_node(alone, 1) is None
    with pytest.raises(StaleAttemptError):
        _fence_of_node(alone, 0)("step-00000002")
    assert _fence_of_node(None, 0) is None


def test_a_node_other_than_0_drops_the_local_copies_a_crash_left(url: str, tmp_path: Path) -> None:
    """Node 1 keeps no copy once its upload is in: one found at the next save was left
    by a crashed upload (or a resume's download) and goes; node 0's are its to keep."""
    node0, node1 = _node(url, tmp_path, 0), _node(url, tmp_path, 1)
    _save(node0, node1, 2, node1_files=_described(NODE1))
    node1.wait()
    node0.wait()
    left = tmp_path / "node-1" / "step-00000004"  # a killed node's held upload
    (left / "dcp").mkdir(parents=True)
    (left / "dcp" / "__1_0.distcp").write_bytes(b"x")
    ours = lambda name: name.startswith("step-")  # noqa: E731
    assert node1.clean_stale(ours) == ["step-00000004"]
    assert not left.exists()
    assert node0.clean_stale(ours) == []
    assert (tmp_path / "node-0" / "step-00000002" / "__0_0.distcp").is_file()
