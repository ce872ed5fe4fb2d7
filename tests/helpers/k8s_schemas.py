"""Validation of rendered Kubernetes objects, shared by the k8s, helm and manifest tests.

- PyTorchJobs against the training operator's CRD schema (kept outside the
  project, in ../shared/k8s/), made strict: the API server silently prunes
  unknown fields, so a misspelt key would vanish unnoticed; here it fails.
- Core objects (ConfigMap, PVC, RBAC, ServiceAccount, Namespace, and each
  replica's pod template as a Pod) against kubernetes-validate's schemas.
- Locating a real helm binary (PATH or $SHARDCTL_HELM; scripts/install-helm).
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT.parent / "shared" / "k8s" / "kubeflow.org_pytorchjobs.yaml"
K8S_VERSION = "1.31.0"


def _strict(schema: Any) -> Any:
    """Every object schema with `properties` refuses keys it does not list."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def _crd_validator() -> Any:
    import jsonschema

    crd = yaml.safe_load(CRD_PATH.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(copy.deepcopy(v1["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


def require_crd() -> None:
    if not CRD_PATH.is_file():
        pytest.skip(
            f"PyTorchJob CRD schema not present at {CRD_PATH} "
            "(reference data kept outside the project; see its README)"
        )


def validate_pytorchjob(obj: dict[str, Any]) -> None:
    """Raise AssertionError listing every violation of the (strict) CRD schema."""
    require_crd()
    errors = sorted(_crd_validator().iter_errors(obj), key=lambda e: list(e.path))
    problems = [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in errors]
    assert not problems, "PyTorchJob violates the CRD schema:\n" + "\n".join(problems)
    # What the schema cannot say but the operator needs.
    assert obj["apiVersion"] == "kubeflow.org/v1" and obj["kind"] == "PyTorchJob"
    for replica in obj["spec"]["pytorchReplicaSpecs"].values():
        validate_core(pod_of(obj, replica))


TRAINER_DIR = ROOT.parent / "shared" / "k8s" / "trainer-v2.3"
TRAINER_CRDS = {
    "TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
    "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    "TrainingRuntime": "trainer.kubeflow.org_trainingruntimes.yaml",
}


def require_trainer_crds() -> None:
    missing = [f for f in TRAINER_CRDS.values() if not (TRAINER_DIR / f).is_file()]
    if missing:
        pytest.skip(
            f"Kubeflow Trainer v2.3 CRDs not present in {TRAINER_DIR} ({', '.join(missing)}; "
            "reference data kept outside the project; see its README)"
        )


@functools.cache
def _trainer_validator(kind: str) -> Any:
    import jsonschema

    crd = yaml.safe_load((TRAINER_DIR / TRAINER_CRDS[kind]).read_text())
    (v1alpha1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = _strict(copy.deepcopy(v1alpha1["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


def validate_trainer_object(obj: dict[str, Any]) -> None:
    """A TrainJob or a (Cluster)TrainingRuntime against its v2.3 CRD (strict), plus the
    CRD's CEL rules on names that JSON schema cannot express."""
    require_trainer_crds()
    kind = obj.get("kind")
    assert kind in TRAINER_CRDS, f"not a Kubeflow Trainer kind: {kind!r}"
    errors = sorted(_trainer_validator(kind).iter_errors(obj), key=lambda e: list(e.path))
    problems = [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in errors]
    assert not problems, f"{kind} violates the v2.3 CRD schema:\n" + "\n".join(problems)
    assert obj["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    if kind == "TrainJob":
        import re

        name = obj["metadata"]["name"]
        assert re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name) and len(name) <= 63, name
    # Each pod template (a runtime's) as the Pod it becomes.
    for rjob in (obj["spec"].get("template") or {}).get("spec", {}).get("replicatedJobs", []):
        pod_spec = rjob["template"]["spec"]["template"]["spec"]
        validate_core(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": pod_spec}
        )


def pod_of(job: dict[str, Any], replica: dict[str, Any]) -> dict[str, Any]:
    """A replica's pod template as the Pod the operator will create from it."""
    template = replica["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template.get("metadata", {}), "name": job["metadata"]["name"] + "-pod"},
        "spec": template["spec"],
    }


def validate_core(obj: dict[str, Any]) -> None:
    """Validate a core object with kubernetes-validate (strict: unknown keys fail)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(
            f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}: {exc.message} "
            f"at {'/'.join(map(str, exc.path))}"
        ) from None


def validate_any(obj: dict[str, Any]) -> None:
    if obj.get("kind") == "PyTorchJob":
        validate_pytorchjob(obj)
    elif obj.get("kind") in TRAINER_CRDS:
        validate_trainer_object(obj)
    else:
        validate_core(obj)


def find_helm() -> str:
    """The helm binary: $SHARDCTL_HELM, PATH, then where scripts/install-helm puts it."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    installed = cache / "shardctl" / "bin" / "helm"
    helm = (
        os.environ.get("SHARDCTL_HELM")
        or shutil.which("helm")
        or (str(installed) if installed.is_file() else None)
    )
    if not helm or not os.access(helm, os.X_OK):
        pytest.skip(
            "no helm binary: run scripts/install-helm and put it on PATH or in $SHARDCTL_HELM"
        )
    return helm
