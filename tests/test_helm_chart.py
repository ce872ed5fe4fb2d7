"""The Helm chart helm/shardctl-job, rendered by a real helm (scripts/install-helm).

The central claim: `helm template` of the values that `shardctl render --cluster
k8s` writes yields the very same ConfigMap and PyTorchJob as the Python
renderer (compared as parsed objects), and both validate.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.k8s_schemas import find_helm, validate_any, validate_core
from shardctl.orchestrator.clusters.k8s import objects as render_k8s
from shardctl.orchestrator.spec import JobSpec, load_spec
from test_k8s_render import TRAINJOB_VARIANTS, VARIANTS, make

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "shardctl-job"

pytestmark = pytest.mark.helm


@pytest.fixture(scope="module")
def helm() -> str:
    return find_helm()


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)
    if check:
        assert out.returncode == 0, f"helm {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out


def write_values(tmp_path: Path, spec: JobSpec) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(render_k8s.k8s_artifacts(spec)["values.yaml"])
    return path


def template(helm: str, values: Path, *extra: str) -> dict[str, dict[str, Any]]:
    out = run_helm(helm, "template", "run1", str(CHART), "-f", str(values), *extra)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object per kind expected"
    return by_kind


def spec_cases() -> dict[str, JobSpec]:
    cases = {name: make(**overrides) for name, overrides in VARIANTS.items()}
    cases.update({name: make(**overrides) for name, overrides in TRAINJOB_VARIANTS.items()})
    cases["examples/k8s.yaml"] = load_spec(ROOT / "examples" / "k8s.yaml")
    code = ROOT / "tests" / "data" / "usercode"
    cases["entrypoint-code-dir-accelerate"] = make(
        train=None,
        launcher="accelerate",
        # A script's FSDP under accelerate needs a GPU (refused on cpu): DeepSpeed.
        strategy={"backend": "deepspeed", "zero_stage": 2},
        entrypoint={
            "script": str(code / "train.py"),
            "code_dir": str(code),
            "args": ["--x", "$(y)"],
        },
    )
    cases["entrypoint-script"] = make(train=None, entrypoint={"script": str(code / "train.py")})
    cases["entrypoint-module-in-image"] = make(train=None, entrypoint={"module": "mypkg.train"})
    cases["trainjob-entrypoint-code-dir"] = make(
        train=None,
        k8s__api="trainjob",
        entrypoint={"script": str(code / "train.py"), "code_dir": str(code)},
    )
    cases["examples/k8s-trainjob.yaml"] = load_spec(ROOT / "examples" / "k8s-trainjob.yaml")
    return cases


CASES = spec_cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_helm_template_equals_python_renderer(helm: str, tmp_path: Path, case: str) -> None:
    spec = CASES[case]
    objects = template(helm, write_values(tmp_path, spec))
    expected = render_k8s.k8s_objects(spec)
    kind = "TrainJob" if spec.k8s.api == "trainjob" else "PyTorchJob"
    assert set(objects) == {"ConfigMap", kind}
    assert objects[kind] == expected[kind.lower()], _diff(expected[kind.lower()], objects[kind])
    assert objects["ConfigMap"] == expected["configmap"], _diff(
        expected["configmap"], objects["ConfigMap"]
    )
    validate_any(objects[kind])
    validate_core(objects["ConfigMap"])


def _diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    import difflib

    lines = difflib.unified_diff(
        render_k8s.dump(a).splitlines(True),
        render_k8s.dump(b).splitlines(True),
        "python renderer",
        "helm template",
    )
    return "objects differ:\n" + "".join(lines)


def test_shardctl_render_output_installs_the_same_objects(helm: str, tmp_path: Path) -> None:
    """End to end: the files `shardctl render --cluster k8s` writes, through helm."""
    from shardctl.orchestrator.clusters import render_artifacts

    files = render_artifacts(CASES["examples/k8s.yaml"], "k8s")
    values = tmp_path / "values.yaml"
    values.write_text(files["values.yaml"])
    objects = template(helm, values)
    assert objects["PyTorchJob"] == yaml.safe_load(files["pytorchjob.yaml"])
    assert objects["ConfigMap"] == yaml.safe_load(files["configmap.yaml"])
    # The job.yaml and launch.sh shardctl render writes are the very ones the pods get.
    assert objects["ConfigMap"]["data"]["job.yaml"] == files["job.yaml"]
    assert objects["ConfigMap"]["data"]["launch.sh"] == files["launch.sh"]


@pytest.mark.parametrize("case", ["examples/k8s.yaml", "examples/k8s-trainjob.yaml"])
def test_lint_strict_with_rendered_values(helm: str, tmp_path: Path, case: str) -> None:
    values = write_values(tmp_path, CASES[case])
    out = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values))
    assert "0 chart(s) failed" in out.stdout


def test_chart_defaults_ask_for_rendered_values(helm: str) -> None:
    out = run_helm(helm, "template", "run1", str(CHART), "--set", "name=x", check=False)
    assert out.returncode != 0
    assert "values.jobSpec is empty" in out.stderr
    assert "shardctl render SPEC --cluster k8s" in out.stderr


@pytest.mark.parametrize(
    ("overlay", "message"),
    [
        ({"elastic": {"minReplicas": 3, "maxReplicas": 2}}, "minReplicas (3) is larger"),
        ({"nodes": 9, "elastic": {"minReplicas": 1, "maxReplicas": 4}}, "nodes (9) must lie"),
        ({"storage": {"create": True, "claimName": None}}, "storage.claimName is empty"),
        # Two pods with checkpoints on a path need one volume (with s3:// none: the
        # `s3-two-nodes-no-pvc` cases render).
        (
            {"storage": {"claimName": None}},
            "values.nodes is 2 and the job's checkpoint.dir is a path",
        ),
        ({"nodes": 0}, "nodes: Must be greater than or equal to 1"),
        ({"securityContext": {"runAsUser": 0}}, "runAsUser"),
        ({"restartPolicy": "Sometimes"}, "restartPolicy"),
        ({"noddes": 2}, "noddes"),
        ({"name": "Not_A_Name"}, "name"),
        ({"launcherFiles": {"job.yaml": "x"}}, "launcherFiles"),
    ],
)
def test_invalid_values_fail_with_a_message(
    helm: str, tmp_path: Path, overlay: dict[str, Any], message: str
) -> None:
    values = write_values(tmp_path, CASES["examples/k8s.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(overlay))
    out = run_helm(
        helm, "template", "run1", str(CHART), "-f", str(values), "-f", str(bad), check=False
    )
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


def test_optional_pvc_and_service_account(helm: str, tmp_path: Path) -> None:
    values = write_values(tmp_path, CASES["examples/k8s.yaml"])
    objects = template(
        helm, values, "--set", "storage.create=true,serviceAccount.create=true,storage.size=10Gi"
    )
    assert set(objects) == {"ConfigMap", "PyTorchJob", "PersistentVolumeClaim", "ServiceAccount"}
    for obj in objects.values():
        validate_any(obj)
    pvc = objects["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == "shardctl-runs"
    # Two nodes write shards into one folder: shared (RWX) storage.
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    sa = objects["ServiceAccount"]
    assert sa["metadata"]["name"] == "shardctl-trainer"
    assert sa["automountServiceAccountToken"] is False


def test_long_names_are_cut_to_63(helm: str, tmp_path: Path) -> None:
    # The schema allows 50 characters (the operator appends "-worker-N"); the
    # helper still cuts at 63, the same way the Python side does.
    values = write_values(tmp_path, make(name="n" * 50))
    objects = template(helm, values)
    assert objects["ConfigMap"]["metadata"]["name"] == "n" * 50 + "-spec"
    assert objects["PyTorchJob"]["metadata"]["name"] == "n" * 50


def test_notes_tell_how_to_follow(helm: str, tmp_path: Path) -> None:
    # `helm install --dry-run` needs a cluster; render NOTES.txt through a copy of
    # the chart with one extra template that includes it as a YAML string.
    import shutil

    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: Notes\nnotes: {{ include "shardctl-job/templates/NOTES.txt" . '
        "| toJson }}\n"
    )
    values = write_values(tmp_path, CASES["examples/k8s.yaml"])
    out = run_helm(
        helm, "template", "run1", str(chart), "-f", str(values),
        "--show-only", "templates/zz-notes.yaml",
    )  # fmt: skip
    notes = yaml.safe_load(out.stdout)["notes"]
    assert "kubectl -n shardctl get pytorchjob k8s-tiny" in notes
    assert "training.kubeflow.org/replica-type=master" in notes
    assert "resumes from the newest complete checkpoint" in notes
    assert "WARNING" not in notes
    (values_no_pvc := tmp_path / "nopvc.yaml").write_text(
        yaml.safe_dump({"storage": {"claimName": None}, "nodes": 1})
    )
    out = run_helm(
        helm, "template", "run1", str(chart), "-f", str(values), "-f", str(values_no_pvc),
        "--show-only", "templates/zz-notes.yaml",
    )  # fmt: skip
    assert "checkpoints are lost when a pod is deleted" in yaml.safe_load(out.stdout)["notes"]
    values = write_values(tmp_path, CASES["examples/k8s-trainjob.yaml"])
    out = run_helm(
        helm, "template", "run1", str(chart), "-f", str(values),
        "--show-only", "templates/zz-notes.yaml",
    )  # fmt: skip
    notes = yaml.safe_load(out.stdout)["notes"]
    assert "TrainJob k8s-tiny-v2 in namespace shardctl on the ClusterTrainingRuntime" in notes
    assert "kubectl -n shardctl get trainjob k8s-tiny-v2 -w" in notes
    assert "jobset.sigs.k8s.io/jobset-name=k8s-tiny-v2" in notes
    assert "PyTorchJob" not in notes and "WARNING" not in notes
