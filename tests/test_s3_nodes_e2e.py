"""Two nodes on this machine (one rank each) save the real loop's checkpoints to a real
S3 server (SeaweedFS, `s3_server`) with no shared staging: each node stages in its own
folder and uploads its own rank's files. An uninterrupted run through the local
cluster (its two node launches, the node agent, fenced attempts) is the reference;
then two torchrun launches (`--nnodes 2`) of the same spec, node 1 killed part way
through its upload of step 4 (its objects partial): no manifest for step 4 is ever
written; run again, the job resumes from step 2 and finishes with the reference's
weights."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.ckpt_run import ROOT, child_env, free_port, kill_group
from helpers.s3_server import S3Server, isolate_aws_settings
from helpers.train_run import assert_bit_equal, metrics, tiny_spec
from shardctl.orchestrator.cli import cli

pytestmark = pytest.mark.slow

STEPS = 8
HOLD = ROOT / "tests" / "helpers" / "s3_upload_hold.py"
# Sized for a loaded 2-core machine: a tiny 2-rank run takes seconds idle, minutes busy.
RUN_DEADLINE_S = 480.0
CKPT = "run/checkpoints"


def _node_argv(spec: Path, node: int, port: int, *, held: bool = False) -> list[str]:
    target = [str(HOLD), str(spec)] if held else ["-m", "shardctl.train", str(spec)]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
        "--node-rank", str(node), "--nproc-per-node", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(port), *target,
    ]  # fmt: skip


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )


def _both_nodes(spec: Path, env: dict[str, str], logs: Path, held: dict | None = None) -> list:
    """Node 0 and node 1 of `spec` started, node 1 with `held` added to its env."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    node0 = _start(_node_argv(spec, 0, port), env, logs / "node0.log")
    node1_env = {**env, **(held or {})}
    node1 = _start(_node_argv(spec, 1, port, held=bool(held)), node1_env, logs / "node1.log")
    return [node0, node1]


def _finish(procs: list[subprocess.Popen], logs: Path) -> list[str]:
    """Wait for both nodes (killed past the deadline); their output; both must exit 0."""
    deadline = time.monotonic() + RUN_DEADLINE_S
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            kill_group(proc)
    outs = [(logs / f"node{i}.log").read_text() for i in range(2)]
    for i, proc in enumerate(procs):
        assert proc.returncode == 0, f"node {i} failed (rc {proc.returncode}):\n{outs[i][-5000:]}"
    return outs


def _wait_until(
    done: Callable[[], bool], what: str, procs: list[subprocess.Popen], logs: Path
) -> None:
    deadline = time.monotonic() + RUN_DEADLINE_S
    while not done():
        ended = [i for i, proc in enumerate(procs) if proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            tails = "\n".join((logs / f"node{i}.log").read_text()[-3000:] for i in range(2))
            pytest.fail(f"never saw {what} (nodes ended: {ended}):\n{tails}")
        time.sleep(0.1)


def test_two_nodes_without_shared_staging_lose_a_node_mid_upload_and_resume_bit_identical(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate_aws_settings(monkeypatch, tmp_path)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = s3_server.make_bucket(f"nodes-{uuid.uuid4().hex[:12]}")
    raw = s3_server.boto3_client()

    def keys(below: str = CKPT) -> set[str]:
        found = raw.list_objects_v2(Bucket=bucket, Prefix=f"{below}/").get("Contents", [])
        return {item["Key"][len(CKPT) + 1 :] for item in found}

    common = {"train": {"steps": STEPS}, "resources": {"nodes": 2, "procs_per_node": 1}}
    # The reference: the same two nodes, uninterrupted, submitted to the local cluster.
    expected = _local_cluster_reference(s3_server, tmp_path, monkeypatch, common)

    spec = tiny_spec(tmp_path, "s3run", checkpoint={"dir": f"s3://{bucket}/{CKPT}"}, **common)
    run_dir = tmp_path / "s3run"
    env = {**child_env(), "SHARDCTL_RUN_DIR": str(run_dir)}
    # Node 1's upload of step 4 stops after its first object, until it is killed.
    held = {
        "SHARDCTL_TEST_HOLD_UPLOAD": "step-00000004",
        "SHARDCTL_TEST_HOLD_RELEASE": str(tmp_path / "never-released"),
    }
    logs = tmp_path / "held-logs"
    procs = _both_nodes(spec, env, logs, held)
    try:
        # Step 2 committed; step 4: node 0's files up, node 1's first object up.
        wanted = {
            "step-00000002/manifest.json",
            "step-00000004/dcp/__0_0.distcp",
            "step-00000004/train_state/rank-00000.pt",
            "step-00000004/dcp/__1_0.distcp",
        }
        _wait_until(lambda: wanted <= keys(), f"objects {sorted(wanted)}", procs, logs)
        # Training went on behind the upload (node 0 logged step 5, its publisher waiting).
        _wait_until(
            lambda: any(m.get("step", 0) >= 5 for m in _metrics(run_dir)), "step 5", procs, logs
        )
        # Each node staged in a folder of its own: neither ever held the other's rank files.
        node0 = run_dir / "s3-cache" / "node-0" / bucket / CKPT
        node1 = run_dir / "s3-cache" / "node-1" / bucket / CKPT
        assert (node0 / "step-00000004" / "dcp" / "__0_0.distcp").is_file()
        assert (node1 / "step-00000004" / "dcp" / "__1_0.distcp").is_file()
        assert not list(node0.rglob("__1_0.distcp")), "node 0 saw node 1's file"
        assert not list(node1.rglob("__0_0.distcp")) and not list(node1.rglob(".metadata"))
    finally:
        for proc in procs:  # node 1 mid-upload, and node 0 waiting on it: kill -9
            kill_group(proc)
            proc.wait(timeout=60)
    stored = keys()
    assert "step-00000004/manifest.json" not in stored  # never committed
    assert "step-00000004/train_state/rank-00001.pt" not in stored  # node 1's upload partial
    # Step 2 holds node 1's files, uploaded by node 1 (node 0 never had them).
    assert {"step-00000002/dcp/__1_0.distcp", "step-00000002/train_state/rank-00001.pt"} <= stored

    # Run again: both nodes resume from step 2, the newest complete checkpoint, and finish.
    outs = _finish(_both_nodes(spec, env, tmp_path / "logs"), tmp_path / "logs")
    assert "step-00000002 (step 2)" in outs[0] and "resumed from" in outs[0], outs[0][-3000:]
    assert "step-00000008/manifest.json" in keys()
    assert not [k for k in keys() if "/.nodes/" in k]  # the nodes' lists go before a commit
    # Node 1 kept no copy: neither the killed upload's, nor resume's, nor its last upload's.
    assert not list((run_dir / "s3-cache" / "node-1" / bucket / CKPT).glob("step-*"))

    resumed = _consolidated(f"s3://{bucket}/{CKPT}/step-00000008", tmp_path / "m1")
    assert_bit_equal(resumed, expected)


def _consolidated(checkpoint: str, out: Path) -> dict:
    """The tensors `shardctl consolidate CHECKPOINT` writes."""
    result = CliRunner().invoke(cli, ["consolidate", checkpoint, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return _tensors(out)


def _metrics(run_dir: Path) -> list[dict]:
    try:
        return metrics(run_dir)
    except (FileNotFoundError, ValueError):  # not yet written, or a line half written
        return []


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def _local_cluster_reference(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, common: dict
) -> dict:
    """The uninterrupted run of `common` submitted to the local cluster, to a bucket of
    its own: each node uploads its own rank's files from a folder of its own (node 1
    sees the run's claim in the shared run dir and is fenced too). Its final weights."""
    from helpers.local_run import follow_to_end
    from shardctl.orchestrator.clusters.local import LocalCluster
    from shardctl.orchestrator.spec import load_spec

    monkeypatch.chdir(tmp_path)
    bucket = s3_server.make_bucket(f"local-{uuid.uuid4().hex[:12]}")
    spec = load_spec(tiny_spec(tmp_path, "two", checkpoint={"dir": f"s3://{bucket}/{CKPT}"},
                               **common))  # fmt: skip
    local = LocalCluster()
    ref = local.schedule(local.dryrun(spec))
    assert follow_to_end(local, ref) == 0, local.logs(ref)[-5000:]
    last = f"step-{STEPS:08d}"
    raw = s3_server.boto3_client()
    found = raw.list_objects_v2(Bucket=bucket, Prefix=f"{CKPT}/{last}/")["Contents"]
    stored = {item["Key"].split(f"/{last}/", 1)[1] for item in found}
    assert {"manifest.json", "dcp/__1_0.distcp", "train_state/rank-00001.pt"} <= stored
    cache = tmp_path / "two" / "s3-cache"
    assert (cache / "node-0" / bucket / CKPT / last / "dcp" / "__0_0.distcp").is_file()
    assert not list(cache.rglob("__1_0.distcp"))  # node 1's, uploaded by node 1 and dropped
    return _consolidated(f"s3://{bucket}/{CKPT}/{last}", tmp_path / "m0")
