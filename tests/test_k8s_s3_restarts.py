"""Kubernetes without a shared volume restarts in place (issue 33's leftover): a
one-node job with `checkpoint.dir: s3://...` and no PVC is submitted through the real
`kubernetes` client (kmock), and its pod, run on this host as in test_k8s_pods.py
against a real S3 server (SeaweedFS), keeps its counts in the bucket: every start on a
fresh emptyDir still knows how many times its node restarted.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.kmock_server import PYTORCHJOBS, KMockServer
from shardctl.orchestrator.clusters import k8s as k8s_backend
from shardctl.orchestrator.spec import load_spec, parse_spec
from test_k8s_pods import Pods

ROOT = Path(__file__).resolve().parent.parent
CRASH = "import sys\nprint('the script crashes with 3', flush=True)\nsys.exit(3)\n"


@pytest.fixture
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KMockServer]:
    server = KMockServer().start()
    try:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path)))
        for var in ("SHARDCTL_KUBECONFIG", "SHARDCTL_KUBE_CONTEXT", "SHARDCTL_K8S_REPLACE",
                    "KUBERNETES_SERVICE_HOST"):  # fmt: skip
            monkeypatch.delenv(var, raising=False)
        yield server
    finally:
        server.stop()


def _crashing_job(tmp_path: Path, url: str) -> Any:
    """The example's one-node job on a bucket, no PVC, running a script that exits 3."""
    script = tmp_path / "code" / "crash.py"
    script.parent.mkdir()
    script.write_text(CRASH)
    data = load_spec(ROOT / "examples" / "k8s.yaml").to_yaml_dict()
    del data["train"]
    data["entrypoint"] = {"script": str(script)}
    data["resources"]["nodes"] = 1
    data["checkpoint"]["dir"] = url
    data["k8s"].update(pvc=None, backoff_limit=2)
    return parse_spec(data)


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
    pods = Pods(spec, tmp_path / "pod")
    pods.container["env"] += [{"name": k, "value": v} for k, v in s3_server.env().items()]
    codes = []
    try:
        for start in range(3):
            # A recreated pod gets a new emptyDir: nothing of the last run dir is left.
            shutil.rmtree(pods.runs / spec.name, ignore_errors=True)
            pods.start(attempt=start)
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
