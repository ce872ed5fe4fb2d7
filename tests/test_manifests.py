"""manifests/: every object validates, the example is in sync, the RBAC fits the client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from helpers.k8s_schemas import validate_any
from helpers.kmock_server import KMockServer, kube_api
from shardctl.orchestrator.clusters.k8s import K8sCluster
from shardctl.orchestrator.clusters.k8s import objects as render_k8s
from shardctl.orchestrator.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
EXAMPLE_SPEC = ROOT / "examples" / "k8s.yaml"
EXAMPLE = MANIFESTS / "example-pytorchjob.yaml"
FILES = ["namespace.yaml", "serviceaccount.yaml", "rbac.yaml", "pvc.yaml", EXAMPLE.name]


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def all_objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for name in FILES for d in docs(name)}


@pytest.mark.parametrize("name", FILES)
def test_every_manifest_validates(name: str) -> None:
    objects = docs(name)
    assert objects, f"{name} holds no object"
    for obj in objects:
        validate_any(obj)


def test_example_is_rendered_from_examples_k8s_yaml() -> None:
    spec = load_spec(EXAMPLE_SPEC)
    expected = render_k8s.manifests(spec)
    actual = EXAMPLE.read_text()
    body = actual[actual.index("---") :]
    assert body == expected, (
        "manifests/example-pytorchjob.yaml is out of date; regenerate it with:\n"
        "  shardctl submit examples/k8s.yaml --cluster k8s --dry-run "
        "> manifests/example-pytorchjob.yaml"
    )


def test_manifests_fit_together() -> None:
    objects = all_objects()
    job = objects[("PyTorchJob", "k8s-tiny")]
    ns = job["metadata"]["namespace"]
    assert objects[("Namespace", ns)]
    for obj in objects.values():
        if obj["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] == ns, obj["metadata"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert ("ServiceAccount", pod["serviceAccountName"]) in objects
    claim = next(v for v in pod["volumes"] if v["name"] == "runs")["persistentVolumeClaim"]
    pvc = objects[("PersistentVolumeClaim", claim["claimName"])]
    # Two nodes write into one checkpoint folder.
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    binding = objects[("RoleBinding", "shardctl-submitter")]
    assert binding["roleRef"]["name"] == "shardctl-submitter"
    for subject in binding["subjects"]:
        assert ("ServiceAccount", subject["name"]) in objects
    cluster_binding = objects[("ClusterRoleBinding", "shardctl-runtime-reader")]
    assert ("ClusterRole", cluster_binding["roleRef"]["name"]) in objects
    assert cluster_binding["subjects"] == binding["subjects"]


def test_pods_meet_the_restricted_pod_security_standard() -> None:
    """The namespace enforces `restricted`; the example's pods must pass it."""
    objects = all_objects()
    assert (
        objects[("Namespace", "shardctl")]["metadata"]["labels"][
            "pod-security.kubernetes.io/enforce"
        ]
        == "restricted"
    )
    job = objects[("PyTorchJob", "k8s-tiny")]
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        allowed_volumes = {"configMap", "emptyDir", "persistentVolumeClaim", "secret"}
        for volume in pod["volumes"]:
            assert set(volume) - {"name"} <= allowed_volumes, volume
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "add" not in sc["capabilities"]
            assert not any("hostPort" in p for p in c.get("ports", []))


# ----------------------------------------------------- RBAC against real use

VERBS = {
    kmock.action.CREATE: "create",
    kmock.action.FETCH: "get",
    kmock.action.LIST: "list",
    kmock.action.WATCH: "watch",
    kmock.action.DELETE: "delete",
}


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KMockServer]:
    with kube_api(tmp_path, monkeypatch) as srv:
        yield srv


def test_role_grants_exactly_what_the_client_uses(server: KMockServer) -> None:
    """Both job kinds, every command; the operator's own requests (runtime, pods) aside."""
    operator: list[int] = []  # indices of the requests the test made as the operator

    def as_operator(action: Any) -> None:
        before = len(server.requests())
        action()
        operator.extend(range(before, len(server.requests())))

    core, custom = _operator_core(server), _operator_custom(server)
    as_operator(
        lambda: custom.create_cluster_custom_object(
            "trainer.kubeflow.org",
            "v1alpha1",
            "clustertrainingruntimes",
            {"metadata": {"name": "torch-distributed"}, "spec": {}},
        )
    )
    flows = {
        EXAMPLE_SPEC: {
            "training.kubeflow.org/job-name": "k8s-tiny",
            "training.kubeflow.org/replica-type": "master",
            "training.kubeflow.org/replica-index": "0",
        },
        EXAMPLE_SPEC.with_name("k8s-trainjob.yaml"): {
            "jobset.sigs.k8s.io/jobset-name": "k8s-tiny-v2",
            "batch.kubernetes.io/job-completion-index": "0",
        },
    }
    for path, pod_labels in flows.items():
        spec = load_spec(path)
        backend = K8sCluster()
        ref = backend.submit(spec)
        K8sCluster(replace=True).submit(spec)
        backend.status(ref)
        # The job succeeded: a second submit of the same spec finds it complete (the
        # job and the job.yaml of its ConfigMap) and starts nothing.
        as_operator(lambda spec=spec: _succeeded(custom, spec))
        assert backend.complete_run(backend.dryrun(spec)) is not None
        pod = f"{spec.name}-pod-0"
        body = {
            "metadata": {"name": pod, "labels": pod_labels},
            "spec": {"containers": [{"name": "x", "image": "x"}]},
        }
        as_operator(
            lambda body=body, ns=ref.extra["namespace"]: core.create_namespaced_pod(ns, body)
        )
        server.serve_log(pod, "step 1\n")
        assert "step 1" in backend.logs(ref, tail=10)
        backend.cancel(ref)
    used: set[tuple[str, str, str]] = set()
    for i, request in enumerate(server.requests()):
        if i in operator:
            continue
        res = request.resource
        assert res is not None and request.action in VERBS, request
        plural = res.plural + (f"/{request.subresource}" if request.subresource else "")
        used.add((res.group, plural, VERBS[request.action]))
    granted: set[tuple[str, str, str]] = set()
    for role in (d for d in docs("rbac.yaml") if d["kind"] in ("Role", "ClusterRole")):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted |= {(group, resource, verb) for verb in rule["verbs"]}
    missing = used - granted
    assert not missing, f"the client needs RBAC the Roles do not grant: {sorted(missing)}"
    # Beyond use only what `kubectl get pytorchjobs -w`, `kubectl logs POD` and a
    # namespaced TrainingRuntime (examples use the cluster-wide stock one) need.
    extra = granted - used
    assert extra <= {
        ("kubeflow.org", "pytorchjobs", "list"),
        ("kubeflow.org", "pytorchjobs", "watch"),
        ("trainer.kubeflow.org", "trainjobs", "list"),
        ("trainer.kubeflow.org", "trainjobs", "watch"),
        ("trainer.kubeflow.org", "trainingruntimes", "get"),
        ("", "pods", "get"),
        # shardctl doctor (tests/test_doctor.py)
        ("", "serviceaccounts", "get"),
        ("", "persistentvolumeclaims", "get"),
    }, extra


def _succeeded(custom: Any, spec: Any) -> None:
    """The operator's word that the job of `spec` succeeded (its kind's condition)."""
    ns, name = spec.k8s.namespace, spec.name
    if spec.k8s.api == "trainjob":
        group, version, plural, word = "trainer.kubeflow.org", "v1alpha1", "trainjobs", "Complete"
    else:
        group, version, plural, word = "kubeflow.org", "v1", "pytorchjobs", "Succeeded"
    condition = {"type": word, "status": "True", "reason": word, "message": "done"}
    status = {"status": {"conditions": [condition]}}
    custom.patch_namespaced_custom_object_status(group, version, ns, plural, name, status)


def _operator_custom(server: KMockServer) -> Any:
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = server.url
    return client.CustomObjectsApi(client.ApiClient(cfg))


def _operator_core(server: KMockServer) -> Any:
    """The test's own client, playing the operator (its requests are not the client's)."""
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = server.url
    return client.CoreV1Api(client.ApiClient(cfg))
