"""Kubernetes without a shared volume restarts in place (issue 33's leftover): a job
with `checkpoint.dir: s3://...` and no PVC is submitted through the real `kubernetes`
client (kmock), and its pods, run on this host as in test_k8s_pods.py against a real
S3 server (SeaweedFS), keep their counts in the bucket: every start on a fresh
emptyDir still knows how many times its node restarted. With two nodes each pod has a
run dir of its own and the checkpoints meet only in the bucket.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.kmock_server import PYTORCHJOBS, KMockServer, kube_api
from shardctl.orchestrator.clusters import k8s as k8s_backend
from shardctl.orchestrator.fence import current_attempt
from shardctl.orchestrator.proctree import descendants
from shardctl.orchestrator.spec import parse_spec
from test_k8s_pods import Pods, example_job

STEPS = 24  # the two-pod job's: a crash and a preemption fit in
CRASH = "import sys\nprint('the script crashes with 3', flush=True)\nsys.exit(3)\n"


@pytest.fixture
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KMockServer]:
    with kube_api(tmp_path, monkeypatch) as server:
        yield server


def _crashing_job(tmp_path: Path, url: str) -> Any:
    """The example's one-node job on a bucket, no PVC, running a script that exits 3."""
    script = tmp_path / "code" / "crash.py"
    script.parent.mkdir()
    script.write_text(CRASH)
    data = _example_without_volume(url, script=str(script))
    data["resources"]["nodes"] = 1
    return parse_spec(data)


def _example_without_volume(url: str, **entrypoint: Any) -> dict[str, Any]:
    """The example's job (examples/k8s.yaml; running `entrypoint` if given) as data:
    checkpoints in the bucket at `url`, no PVC, at most two restarts a node."""
    data = example_job(**entrypoint)
    data["checkpoint"]["dir"] = url
    data["k8s"].update(pvc=None, backoff_limit=2)
    return data


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pod_without_a_volume_restarts_within_the_bound_counted_in_the_bucket(
    tmp_path: Path, kube: KMockServer, s3_server: Any
) -> None:
    bucket = s3_server.make_bucket("k8s-no-pvc")
    spec = _crashing_job(tmp_path, f"s3://{bucket}/runs/crash")
    k8s_backend.K8sCluster().submit(spec)
    ((_, job),) = kube.objects(PYTORCHJOBS).items()
    volumes = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
    assert not any("persistentVolumeClaim" in v for v in volumes)
    (configmap,) = kube.objects("v1/configmaps").values()
    launch = configmap["data"]["launch.sh"]
    assert f"export SHARDCTL_POD_COUNTS=s3://{bucket}/runs/crash/.attempts\n" in launch
    assert "export SHARDCTL_POD_RESTARTS=2\n" in launch

    # The pod as submitted (the same objects, test_k8s_client.py), with the bucket's
    # credentials its Secret would give it.
    pods = _with_env(Pods(spec, tmp_path / "pod"), s3_server.env())
    codes = []
    try:
        for start in range(3):
            _start([pods], attempt=start)
            codes += pods.wait(timeout=300)
    finally:
        pods.kill()
    # 128 + 3: the operator restarts it, twice (k8s.backoff_limit); then 3: the job fails.
    assert codes == [131, 131, 3], pods.tail()
    assert "the job stops" in pods.tail()
    client = s3_server.boto3_client()
    for name in ("restarts-node-0", "node-0"):
        body = client.get_object(Bucket=bucket, Key=f"runs/crash/.attempts/{name}")["Body"]
        assert body.read() == b"2\n", name
    contract = yaml.safe_load((pods.etc / "job.yaml").read_text())
    assert contract["checkpoint"]["dir"] == f"s3://{bucket}/runs/crash"


# ----------------------------------------------------- two pods, no shared run dir


def _pod_of_each_node(spec: Any, root: Path, env: dict[str, str]) -> list[Pods]:
    """One `Pods` per node, each with folders of its own (its emptyDirs: run dir, cache,
    /etc/shardctl), the bucket's credentials as its Secret gives them, one master port."""
    pods = [_with_env(Pods(spec, root / f"pod-node{node}"), env)
            for node in range(spec.resources.nodes)]  # fmt: skip
    for pod in pods:
        pod.port = pods[0].port
    return pods


def _with_env(pod: Pods, env: dict[str, str]) -> Pods:
    """The pod with `env` in its container's environment (as its Secret gives it)."""
    pod.container["env"] += [{"name": k, "value": v} for k, v in env.items()]
    return pod


def _start(pods: list[Pods], attempt: int) -> None:
    """Each pod (one a node) started, its run dir emptied first."""
    for node, pod in reversed(list(enumerate(pods))):
        # A recreated pod gets a new emptyDir: nothing of the last run dir is left.
        shutil.rmtree(pod.runs, ignore_errors=True)
        pod.runs.mkdir()
        pod.start(attempt=attempt, only=node)


def _committed_steps(client: Any, bucket: str, prefix: str) -> list[int]:
    """Steps whose manifest object is in the bucket (a checkpoint is complete then)."""
    found = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step-")
    return sorted(
        int(key.split("/step-")[1].split("/")[0])
        for key in (o["Key"] for o in found.get("Contents", []))
        if key.endswith("/manifest.json") and ".tmp/" not in key
    )


def _wait_for_commit(client: Any, bucket: str, prefix: str, pods: list[Pods], after: int) -> None:
    """Polls the bucket, 480 s at most and while every pod runs, until a checkpoint
    past step `after` is committed (-1: any)."""
    deadline = time.monotonic() + 480
    while (_committed_steps(client, bucket, prefix) or [-1])[-1] <= after:
        assert time.monotonic() < deadline, f"no checkpoint past {after} in time:\n" + _tails(pods)
        assert all(p.poll() is None for pod in pods for p in pod.procs), _tails(pods)
        time.sleep(0.5)


def _ranks_below(pod: Pods) -> Iterator[tuple[Any, list[bytes]]]:
    """(process, environment words) of each training rank below the pod (torchrun gave
    it LOCAL_RANK)."""
    for proc in pod.procs:
        for p in descendants(proc.pid):
            try:
                env = (Path("/proc") / str(p.pid) / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(w.startswith(b"LOCAL_RANK=") for w in env):
                yield p, env


def _a_rank_of(pod: Pods) -> Any:
    """A training rank below the pod."""
    for rank, _ in _ranks_below(pod):
        return rank
    raise AssertionError("no rank below the pod:\n" + pod.tail())


def _exit_codes(pods: list[Pods], timeout: float) -> list[int]:
    """Every pod's exit codes, each waited for `timeout` s at most."""
    return [code for pod in pods for code in pod.wait(timeout=timeout)]


def _logs(pods: list[Pods]) -> str:
    return "\n".join(log.read_text() for pod in pods for log in pod.logs)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_pods_without_a_volume_crash_and_are_preempted_and_resume_from_the_bucket(
    tmp_path: Path, kube: KMockServer, s3_server: Any
) -> None:
    """A 2-node PyTorchJob with `checkpoint.dir: s3://...` and no PVC, submitted through
    the kubernetes client (kmock), its pods run on this host each with a run dir of its
    own: they train and save to the bucket from their own folders; a rank of node 1
    killed after the first committed checkpoint ends both pods with a code the operator
    restarts; the recreated pods (fresh emptyDirs) resume from the bucket's newest
    complete checkpoint. Then the pod of global rank 0 alone is deleted (SIGTERM): every
    rank saves, both pods exit 170 (the other pod sees no PREEMPTED, which is in rank
    0's pod, and takes its ranks' exits 42 for the save), neither counts a restart; the
    recreated pods resume from that save and the job succeeds."""
    bucket = s3_server.make_bucket("k8s-two-pods")
    prefix = "runs/two"
    data = _example_without_volume(f"s3://{bucket}/{prefix}")
    data["train"]["steps"] = STEPS
    data["checkpoint"].update(every_steps=4, keep=2)
    spec = parse_spec(data)
    assert spec.resources.nodes == 2
    k8s_backend.K8sCluster().submit(spec)  # refused before: k8s.pvc is required
    ((_, job),) = kube.objects(PYTORCHJOBS).items()
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        volumes = replica["template"]["spec"]["volumes"]
        assert {"name": "runs", "emptyDir": {}} in volumes
        assert not any("persistentVolumeClaim" in v for v in volumes)

    pods = _pod_of_each_node(spec, tmp_path, s3_server.env())
    client = s3_server.boto3_client()
    killed: list[Any] = []
    try:
        _start(pods, attempt=0)
        _wait_for_commit(client, bucket, prefix, pods, after=-1)
        rank = _a_rank_of(pods[1])
        os.kill(rank.pid, signal.SIGKILL)  # a crash of node 1's pod
        killed.append(rank)
        codes = _exit_codes(pods, timeout=300)
        # 128-255: the operator restarts each pod (a crash within k8s.backoff_limit).
        assert all(128 <= code <= 255 for code in codes), (codes, _tails(pods))
        saved = _committed_steps(client, bucket, prefix)
        assert saved and saved[-1] < STEPS, (saved, _tails(pods))

        _start(pods, attempt=1)  # the operator recreates both pods
        _wait_for_commit(client, bucket, prefix, pods, after=saved[-1])
        assert f"resumed at step {saved[-1]}" in _logs(pods), _tails(pods)
        tokens = {_claimed(pod, spec.name) for pod in pods}
        assert tokens == {f"k8s-{spec.name}-1"}, tokens

        # The kubelet deletes the pod that holds global rank 0 (SIGTERM to its agent).
        holder = next(pod for pod in pods if _holds_rank_0(pod))
        os.kill(holder.procs[0].pid, signal.SIGTERM)
        codes = _exit_codes(pods, timeout=300)
        assert codes == [170, 170], _tails(pods)
        preempted = _committed_steps(client, bucket, prefix)[-1]
        assert saved[-1] < preempted < STEPS, _tails(pods)

        _start(pods, attempt=2)
        codes = _exit_codes(pods, timeout=480)
        assert codes == [0, 0], _tails(pods)
    finally:
        for pod in pods:
            pod.kill()
    assert _committed_steps(client, bucket, prefix)[-1] == STEPS
    assert f"resumed at step {preempted}" in _logs(pods), _tails(pods)
    # Each pod's starts were counted in the bucket, so both derived the same token; the
    # crash counted one restart of each node, the preemption none.
    for name, count in (("node-0", 2), ("node-1", 2), ("restarts-node-0", 1),
                        ("restarts-node-1", 1)):  # fmt: skip
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/.attempts/{name}")["Body"]
        assert body.read() == f"{count}\n".encode(), name
    # Rank 0 ran in one of the pods: its DONE is in that pod's own run dir only.
    assert sum((pod.runs / spec.name / "DONE").is_file() for pod in pods) == 1


def _holds_rank_0(pod: Pods) -> bool:
    """Whether global rank 0 runs below the pod (c10d numbers nodes by arrival)."""
    return any(b"RANK=0" in env for _, env in _ranks_below(pod))


def _claimed(pod: Pods, name: str) -> object:
    """The attempt token claimed in the pod's own run dir."""
    claim = current_attempt(pod.runs / name)
    return claim["token"] if claim else None


def _tails(pods: list[Pods]) -> str:
    return "\n".join(pod.tail() for pod in pods)
