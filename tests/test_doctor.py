"""`shardctl doctor SPEC --cluster local|slurm|k8s`: pre-flight checks with a fix each.

What the issue names: a master address that resolves to loopback on a multi-node
Slurm cluster (the dev cluster's nodes do: both are this host), and a grace period
shorter than the saves measured in the run's earlier checkpoints. Plus a taken port,
a checkpoint dir that is a file, and on Kubernetes (kmock) a missing runtime, service
account and a PVC that several pods cannot share.
"""

from __future__ import annotations

import copy
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from helpers.kmock_server import KMockServer, kube_api
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.doctor import Check, budget_check, percentile
from shardctl.orchestrator.spec import parse_spec
from test_k8s_render import BASE


def doctor(spec: dict[str, Any], tmp_path: Path, *args: str) -> tuple[int, dict[str, Check]]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(cli, ["doctor", str(path), "-o", "json", *args])
    assert "Traceback" not in result.output, result.output
    doc = json.loads(result.stdout)
    return result.exit_code, {c["name"]: Check(**c) for c in doc["checks"]}


def local_spec(tmp_path: Path, **k8s: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["resources"]["nodes"] = 1
    data["run_dir"] = str(tmp_path / "run")
    data["checkpoint"]["dir"] = str(tmp_path / "ckpt")
    data["k8s"].update(k8s)
    return data


def test_local_all_good_then_a_taken_port_and_a_file_in_the_way(tmp_path: Path) -> None:
    data = local_spec(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    data["local"] = {"master_port": free}
    code, checks = doctor(data, tmp_path)
    assert code == 0, checks
    assert checks["master port"].status == "ok"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        data["local"] = {"master_port": holder.getsockname()[1]}
        (tmp_path / "afile").write_text("a file where the checkpoints go")
        data["checkpoint"]["dir"] = str(tmp_path / "afile" / "ckpt")
        code, checks = doctor(data, tmp_path)
    assert code == 1
    assert checks["master port"].status == "fail" and "is taken" in checks["master port"].detail
    assert checks["checkpoint dir"].status == "fail"
    assert "afile is a file" in checks["checkpoint dir"].detail
    assert "set checkpoint.dir" in checks["checkpoint dir"].fix
    assert not (tmp_path / "ckpt").exists()  # doctor creates nothing


def write_saves(folder: Path, seconds: list[float]) -> None:
    for i, s in enumerate(seconds, start=1):
        step = folder / f"step-{i:08d}"
        step.mkdir(parents=True)
        (step / "manifest.json").write_text(json.dumps({"step": i, "save_s": s}))
    (folder / "step-00000099.tmp").mkdir()  # a torn save: no manifest, not counted


def test_a_grace_period_shorter_than_the_measured_save_fails(tmp_path: Path) -> None:
    saves = tmp_path / "earlier"
    write_saves(saves, [40.0, 45.0, 50.0, 320.0, 48.0])
    spec = parse_spec(local_spec(tmp_path, termination_grace_s=300))
    check = budget_check(spec, "k8s", str(saves))
    assert check.status == "fail", check
    assert "p95 320.0 s" in check.detail and "a save will not fit" in check.detail
    assert check.fix == "raise k8s.termination_grace_s to at least 400"
    roomy = parse_spec(local_spec(tmp_path, termination_grace_s=600))
    assert budget_check(roomy, "k8s", str(saves)).status == "ok"
    tight = parse_spec(local_spec(tmp_path, termination_grace_s=350))
    assert budget_check(tight, "k8s", str(saves)).status == "warn"
    slurm = parse_spec({**local_spec(tmp_path), "slurm": {"signal_delay_s": 120}})
    assert "slurm.signal_delay_s" in budget_check(slurm, "slurm", str(saves)).fix
    # Nothing measured: said, not passed.
    assert budget_check(spec, "k8s", str(tmp_path / "none")).status == "skip"
    assert percentile([1, 2, 3, 4, 100], 95) == 100


# -------------------------------------------------------- slurm, with a stand-in srun

# Answers the probe as the dev cluster's nodes would: every node (one line each, as many
# as --nodes asks for) resolves the first host, n1, to 127.0.0.1.
FAKE_SRUN = r"""#!/bin/sh
n=1
for a in "$@"; do case "$a" in --nodes=*) n="${a#--nodes=}";; esac; done
i=0
while [ "$i" -lt "$n" ]; do
  echo "SHARDCTL-PROBE node=n$((i+1)) id=$i master=n1 addr=127.0.0.1" \
    "port_free=yes seen=$n ifaces=lo,"
  i=$((i+1))
done
"""


@pytest.mark.parametrize(("nodes", "status"), [(1, "ok"), (2, "fail")])
def test_slurm_master_on_loopback_fails_only_with_other_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: int, status: str
) -> None:
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{srun.parent}:{os.environ['PATH']}")
    data = local_spec(tmp_path)
    data["resources"]["nodes"] = nodes
    data["slurm"] = {"partition": "debug"}
    _, checks = doctor(data, tmp_path, "--cluster", "slurm")
    master = checks["master address"]
    assert master.status == status, master
    if nodes == 1:
        assert "one node, no other node needs to reach the rendezvous" in master.detail
    else:
        assert "n1 (the first host) resolves to a loopback address" in master.detail


# ---------------------------------------------------------------------------- k8s


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KMockServer]:
    with kube_api(tmp_path, monkeypatch) as srv:
        srv.handler.resources["v1/serviceaccounts"] = {}
        srv.handler.resources["v1/persistentvolumeclaims"] = {}
        yield srv


def test_k8s_checks_through_the_api(server: KMockServer, tmp_path: Path) -> None:
    from kubernetes import client

    data = copy.deepcopy(BASE)  # 2 nodes, PVC "runs", namespace "ml"
    data["k8s"]["api"] = "trainjob"
    code, checks = doctor(data, tmp_path, "--cluster", "k8s")
    assert code == 1
    assert checks["operator"].status == "ok"
    assert checks["runtime"].status == "fail"
    assert "'torch-distributed' (k8s.runtime) does not exist" in checks["runtime"].detail
    assert "helm install kubeflow-trainer" in checks["runtime"].fix
    assert checks["service account"].status == "fail"
    assert checks["checkpoint dir"].status == "fail"
    assert "no PersistentVolumeClaim 'runs'" in checks["checkpoint dir"].detail

    cfg = client.Configuration()
    cfg.host = server.url
    api = client.ApiClient(cfg)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    custom.create_cluster_custom_object("trainer.kubeflow.org", "v1alpha1",
        "clustertrainingruntimes", {"metadata": {"name": "torch-distributed"}})  # fmt: skip
    core.create_namespaced_service_account("ml", {"metadata": {"name": "shardctl-trainer"}})
    core.create_namespaced_persistent_volume_claim(
        "ml", {"metadata": {"name": "runs"}, "spec": {"accessModes": ["ReadWriteOnce"]}}
    )
    code, checks = doctor(data, tmp_path, "--cluster", "k8s")
    assert checks["runtime"].status == "ok" and checks["service account"].status == "ok"
    # Two pods on different nodes cannot share a ReadWriteOnce claim.
    assert (
        checks["checkpoint dir"].status == "fail"
        and "ReadWriteMany" in checks["checkpoint dir"].fix
    )
    assert code == 1
    core.delete_namespaced_persistent_volume_claim("runs", "ml")
    core.create_namespaced_persistent_volume_claim(
        "ml", {"metadata": {"name": "runs"}, "spec": {"accessModes": ["ReadWriteMany"]}}
    )
    code, checks = doctor(data, tmp_path, "--cluster", "k8s")
    assert code == 0, checks
    assert checks["checkpoint dir"].detail == "PVC runs exists (ReadWriteMany)"
    # No PVC: two pods need one unless their checkpoints are in a bucket (the cluster's
    # own checks: doctor's S3 probe of the bucket is test_s3_client.py's).
    from shardctl.orchestrator.clusters.k8s import K8sCluster
    from shardctl.orchestrator.spec import parse_spec

    data["k8s"]["pvc"] = None
    found = {c.name: c for c in K8sCluster().preflight(parse_spec(data)).checks}
    assert found["checkpoint dir"].status == "fail" and "s3://" in found["checkpoint dir"].fix
    data["checkpoint"]["dir"] = "s3://team-ckpt/runs"
    found = {c.name: c for c in K8sCluster().preflight(parse_spec(data)).checks}
    assert found["checkpoint dir"].status == "ok", found["checkpoint dir"]
    assert "markers live in the pod (each pod's own)" in found["checkpoint dir"].detail
