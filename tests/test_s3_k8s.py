"""Kubernetes without a shared volume (issue 33): with `checkpoint.dir: s3://...` a
PyTorchJob or TrainJob of one node or several mounts no PVC, its pods keep the URL (the run dir's
small files in an emptyDir), the S3 credentials come from a named Secret through
`envFrom`, and no secret of the submitting machine reaches a rendered file. The CRD
and core schema checks of these variants: test_k8s_render.py (`s3-one-node-no-pvc`,
`s3-two-nodes-no-pvc`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardctl.orchestrator.clusters.k8s import objects as render_k8s
from test_k8s_render import BASE, TRAINJOB_VARIANTS, VARIANTS, make

URL = "s3://team-ckpt/runs/k8s-test"
SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


def _pods(objects: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pod spec of a rendered PyTorchJob or TrainJob."""
    if "pytorchjob" in objects:
        specs = objects["pytorchjob"]["spec"]["pytorchReplicaSpecs"].values()
        return [r["template"]["spec"] for r in specs]
    (patch,) = objects["trainjob"]["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return [rjob["template"]["spec"]["template"]["spec"]]


@pytest.mark.parametrize(
    "overrides",
    [
        VARIANTS["s3-one-node-no-pvc"],
        TRAINJOB_VARIANTS["trainjob-s3-one-node-no-pvc"],
        VARIANTS["s3-two-nodes-no-pvc"],
        TRAINJOB_VARIANTS["trainjob-s3-two-nodes-no-pvc"],
    ],
    ids=["pytorchjob", "trainjob", "pytorchjob-2-nodes", "trainjob-2-nodes"],
)
def test_a_job_on_s3_needs_no_pvc_and_reads_credentials_from_a_secret(
    overrides: dict[str, Any],
) -> None:
    """One node or several: each pod's run dir is its own emptyDir (each pod uploads its
    own ranks' files), and its counts live beside the checkpoints in the bucket."""
    spec = make(**overrides)
    rendered = render_k8s.render(spec)
    objects = rendered.objects
    launch = objects["configmap"]["data"]["launch.sh"]
    assert f"export SHARDCTL_POD_COUNTS={URL}/.attempts\n" in launch
    assert f"export SHARDCTL_POD_RESTARTS={spec.k8s.backoff_limit}\n" in launch
    inside = yaml.safe_load(objects["configmap"]["data"]["job.yaml"])
    # Was replaced by the PVC's folder, so the pods checkpointed into their emptyDir.
    assert inside["checkpoint"]["dir"] == URL
    assert inside["run_dir"] == "/shardctl/runs/k8s-test"
    for pod in _pods(objects):
        runs = next(v for v in pod["volumes"] if v["name"] == "runs")
        assert runs == {"name": "runs", "emptyDir": {}}
        assert not any("persistentVolumeClaim" in v for v in pod["volumes"])
    # In the pod template (PyTorchJob) or the runtime of shardctl's own (TrainJob).
    carried = json.dumps([objects, rendered.runtime])
    assert '"envFrom": [{"secretRef": {"name": "s3-credentials"}}]' in carried
    assert '"AWS_' not in carried  # no credential variable inline


def test_no_aws_secret_of_the_submitting_machine_reaches_a_rendered_file(
    tmp_path: Path,
) -> None:
    data = {
        **BASE,
        "resources": {**BASE["resources"], "nodes": 1},
        "checkpoint": {"every_steps": 2, "dir": URL},
        "k8s": {**BASE["k8s"], "pvc": None, "env_from_secrets": ["s3-credentials"]},
    }
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(data))
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEH7",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
    }
    out_dir = tmp_path / "rendered"
    cli = [sys.executable, "-m", "shardctl.orchestrator.cli"]
    trainjob = ["--set", "k8s.api=trainjob", "--set", "k8s.runtime=shardctl-torch"]
    for choice in ([], trainjob):
        dry = subprocess.run(
            [*cli, "submit", str(spec), "--cluster", "k8s", "--dry-run", *choice],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert dry.returncode == 0, dry.stderr
        assert URL in dry.stdout
        assert SECRET not in dry.stdout + dry.stderr
        assert "AKIAEXAMPLEH7" not in dry.stdout + dry.stderr
    rendered = subprocess.run(
        [*cli, "render", str(spec), "--cluster", "k8s", "--out", str(out_dir)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    files = [p for p in out_dir.rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert SECRET not in path.read_text(errors="replace"), path


def test_ls_says_a_run_dir_without_a_pvc_is_in_the_pods() -> None:
    """`ls`/`status` cannot read a Kubernetes run dir here; without a PVC they say it is
    in the pods' emptyDirs, not on a claim the job does not have."""
    from shardctl.orchestrator.cli.jobs import _progress
    from shardctl.orchestrator.clusters.base import JobRef
    from shardctl.orchestrator.clusters.k8s import K8sCluster

    ref = JobRef("k8s", "ml/k8s-test", "k8s-test", "/shardctl/runs/k8s-test", {"pvc": None})
    progress, why = _progress(K8sCluster(), ref)
    assert progress is None
    assert "each pod's emptyDir" in why and "not on this machine" in why
