"""`--cluster k8s` with `k8s.api: trainjob`: Kubeflow Trainer v2 TrainJobs through the real
`kubernetes` client against kmock.

The tests play Trainer's controller and JobSet: they create the runtimes, patch
the TrainJob's conditions and jobsStatus, create pods with JobSet's labels and
serve their logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from helpers.kmock_server import TRAINJOBS, KMockServer
from shardctl.orchestrator.clusters import k8s as k8s_backend
from shardctl.orchestrator.clusters.base import JobState
from shardctl.orchestrator.clusters.k8s import objects as render_k8s
from shardctl.orchestrator.clusters.k8s import trainjob as v2
from shardctl.orchestrator.errors import ClusterError, JobNotFoundError
from test_k8s_client import create_pod, operator_api, shardctl
from test_k8s_client import server as kmock_api
from test_k8s_render import BASE, make

server = kmock_api  # the fixture: a kmock API server, the kubeconfig pointed at it
NS = BASE["k8s"]["namespace"]
NAME = BASE["name"]
# Trainer v2.3's stock runtime, the parts these tests install (kept here: they never skip).
STOCK_RUNTIME = Path(__file__).resolve().parent / "data" / "k8s" / "torch-distributed-runtime.yaml"
# Where the full reference files live when at hand (outside the project).
SHARED = Path(__file__).resolve().parents[2] / "shared" / "k8s" / "trainer-v2.3"


def install_runtime(server: KMockServer, name: str = "torch-distributed") -> None:
    """What `helm install kubeflow-trainer ... runtimes.defaultEnabled=true` leaves."""
    custom, _ = operator_api(server)
    # The stock runtime is Trainer's own file, never an invented stand-in; a runtime of
    # another name is the user's own and its contents do not matter to these tests.
    spec = (
        stock_runtime()["spec"]
        if name == "torch-distributed"
        else {"mlPolicy": {"numNodes": 1, "torch": {}}}
    )
    body = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name},
        "spec": spec,
    }
    custom.create_cluster_custom_object("trainer.kubeflow.org", "v1alpha1",
                                        "clustertrainingruntimes", body)  # fmt: skip


def stock_runtime() -> dict[str, Any]:
    """Trainer v2.3's stock `torch-distributed` runtime, as far as these tests need it
    (tests/data/k8s; `test_the_kept_runtime_is_trainers_own` compares it with Trainer's)."""
    return yaml.safe_load(STOCK_RUNTIME.read_text())


def _within(kept: Any, stock: Any, where: str = "") -> list[str]:
    """Where `kept` says something `stock` does not (a mapping may leave keys out)."""
    if isinstance(kept, dict) and isinstance(stock, dict):
        found: list[str] = []
        for key, value in kept.items():
            here = f"{where}.{key}"
            found += _within(value, stock[key], here) if key in stock else [here]
        return found
    if isinstance(kept, list) and isinstance(stock, list) and len(kept) == len(stock):
        pairs = enumerate(zip(kept, stock, strict=True))
        return [p for i, (a, b) in pairs for p in _within(a, b, f"{where}[{i}]")]
    return [] if kept == stock else [where]


def test_the_kept_runtime_is_trainers_own() -> None:
    """The copy in tests/data is Trainer's stock file with parts left out, nothing
    changed or added. Trainer's file is reference data outside the project."""
    path = SHARED / "torch_distributed.yaml"
    if not path.is_file():
        pytest.skip(f"Trainer v2.3's stock runtime is not at {path} to compare the kept copy with")
    stock = yaml.safe_load(path.read_text())
    kept = stock_runtime()
    assert _within(kept, stock) == []
    assert kept["metadata"]["name"] == v2.DEFAULT_RUNTIME
    [job] = kept["spec"]["template"]["spec"]["replicatedJobs"]
    [container] = job["template"]["spec"]["template"]["spec"]["containers"]
    assert (job["name"], container["name"]) == ("node", "node")


def trainjob(**overrides: Any) -> Any:
    return make(k8s__api="trainjob", **overrides)


def set_status(server: KMockServer, status: dict[str, Any]) -> None:
    custom, _ = operator_api(server)
    custom.patch_namespaced_custom_object_status(
        "trainer.kubeflow.org", "v1alpha1", NS, "trainjobs", NAME, {"status": status}
    )


def add_pod(server: KMockServer, name: str, jobset: str, index: int, rjob: str = "node") -> None:
    labels = {
        "jobset.sigs.k8s.io/jobset-name": jobset,
        "jobset.sigs.k8s.io/replicatedjob-name": rjob,
        "jobset.sigs.k8s.io/job-index": "0",
        "batch.kubernetes.io/job-completion-index": str(index),
    }
    annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
    create_pod(server, {"name": name, "labels": labels, "annotations": annotations}, "node")


# ------------------------------------------------------------------ submit


def test_submit_creates_exactly_the_rendered_trainjob(server: KMockServer) -> None:
    install_runtime(server)
    spec = trainjob()
    ref = k8s_backend.K8sCluster().submit(spec)
    expected = render_k8s.k8s_objects(spec)
    assert server.objects(TRAINJOBS) == {(NS, NAME): expected["trainjob"]}
    assert server.objects("v1/configmaps") == {(NS, f"{NAME}-spec"): expected["configmap"]}
    assert ref.extra["api"] == "trainjob" and ref.job_id == f"{NS}/{NAME}"
    # The runtime was looked up where the TrainJob says it is.
    gets = [r for r in server.requests() if r.method == kmock.method.GET]
    assert gets[0].resource.plural == "clustertrainingruntimes" and gets[0].name == (
        "torch-distributed"
    )


def test_a_missing_stock_runtime_names_it_and_how_to_install_trainer(server: KMockServer) -> None:
    with pytest.raises(ClusterError) as err:
        k8s_backend.K8sCluster().submit(trainjob())
    text = str(err.value)
    assert "the ClusterTrainingRuntime 'torch-distributed' (k8s.runtime) does not exist" in text
    assert "helm install kubeflow-trainer" in text and "runtimes.defaultEnabled=true" in text
    assert server.objects(TRAINJOBS) == {} and server.objects("v1/configmaps") == {}


def test_a_missing_own_runtime_says_how_to_render_and_install_it(server: KMockServer) -> None:
    with pytest.raises(ClusterError) as err:
        k8s_backend.K8sCluster().submit(
            trainjob(k8s__runtime="team-torch", k8s__runtime_kind="TrainingRuntime")
        )
    text = str(err.value)
    assert (
        f"the TrainingRuntime 'team-torch' (k8s.runtime) does not exist in namespace '{NS}'" in text
    )
    gets = [r for r in server.requests() if r.method == kmock.method.GET]
    assert gets[0].resource.plural == "trainingruntimes" and gets[0].namespace == NS
    assert "trainingruntime.yaml" in text and "kubectl apply --server-side" in text


def test_admission_webhook_refusal_is_explained(server: KMockServer) -> None:
    # Reading runtimes is forbidden to this user: the webhook is the check.
    server.fail("get", "trainer.kubeflow.org/v1alpha1/clustertrainingruntimes", 403, "forbidden")
    server.fail(
        "post", TRAINJOBS, 422,
        'admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: '
        'spec.RuntimeRef: Invalid value: clustertrainingruntimes.trainer.kubeflow.org '
        '"torch-distributed" not found: specified clusterTrainingRuntime must be created '
        "before the TrainJob is created",
    )  # fmt: skip
    with pytest.raises(ClusterError) as err:
        k8s_backend.K8sCluster().submit(trainjob())
    text = str(err.value)
    assert text.startswith("the ClusterTrainingRuntime 'torch-distributed' (k8s.runtime)")
    assert "Server said: admission webhook" in text
    assert server.objects("v1/configmaps") == {}  # rolled back


def test_missing_trainer_crd_names_how_to_install_it(server: KMockServer) -> None:
    install_runtime(server)
    server.fail("post", TRAINJOBS, 404, "the server could not find the requested resource")
    with pytest.raises(ClusterError) as err:
        k8s_backend.K8sCluster().submit(trainjob())
    assert "trainjobs.trainer.kubeflow.org/v1alpha1" in str(err.value)
    assert "Kubeflow Trainer v2.3" in str(err.value)


def test_existing_trainjob_is_a_conflict_and_replace_works(server: KMockServer) -> None:
    install_runtime(server)
    k8s_backend.K8sCluster().submit(trainjob())
    with pytest.raises(ClusterError, match="a TrainJob named 'k8s-test' already exists"):
        k8s_backend.K8sCluster().submit(trainjob())
    k8s_backend.K8sCluster(replace=True).submit(trainjob())
    assert set(server.objects(TRAINJOBS)) == {(NS, NAME)}


# ------------------------------------------------------------------ status

RUNNING_JOBS = [{"name": "node", "active": 1, "ready": 1, "failed": 0, "succeeded": 0}]


@pytest.mark.parametrize(
    ("status", "state", "native"),
    [
        ({}, JobState.PENDING, "Pending"),
        ({"jobsStatus": [{"name": "node", "active": 0, "ready": 0}]}, JobState.PENDING,
         "Created"),
        ({"jobsStatus": [{"name": "node", "active": 1, "ready": 0}]}, JobState.PENDING,
         "Starting"),
        ({"jobsStatus": RUNNING_JOBS}, JobState.RUNNING, "Running"),
        ({"jobsStatus": [{"name": "node", "active": 0, "failed": 1}]}, JobState.PREEMPTED,
         "Restarting"),
        ({"conditions": [{"type": "Suspended", "status": "True", "reason": "Suspended"}]},
         JobState.PENDING, "Suspended"),
        ({"conditions": [{"type": "Suspended", "status": "False", "reason": "Resumed"}],
          "jobsStatus": RUNNING_JOBS}, JobState.RUNNING, "Running"),
        ({"conditions": [{"type": "Complete", "status": "True", "reason": "AllJobsCompleted",
                          "message": "jobset completed successfully"}]},
         JobState.SUCCEEDED, "Complete"),
        ({"conditions": [{"type": "Failed", "status": "True", "reason": "FailedJobs",
                          "message": "jobset failed due to one or more job failures"}],
          "jobsStatus": RUNNING_JOBS}, JobState.FAILED, "Failed"),
        ({"conditions": [{"type": "Created", "status": "True"},
                         {"type": "Running", "status": "True"}]}, JobState.RUNNING, "Running"),
    ],
)  # fmt: skip
def test_status_from_conditions_then_the_jobsets_jobs(
    server: KMockServer, status: dict[str, Any], state: JobState, native: str
) -> None:
    install_runtime(server)
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(trainjob())
    if status:
        set_status(server, status)
    st = backend.status(ref)
    assert (st.state, st.native_state) == (state, native)
    if native == "Failed":
        assert st.detail == "FailedJobs: jobset failed due to one or more job failures"


def test_every_native_state_is_in_the_one_table() -> None:
    assert set(v2.TRAINJOB_STATES) == {
        "Pending", "Created", "Starting", "Suspended", "Running", "Restarting", "Complete",
        "Failed",
    }  # fmt: skip
    assert all(s in JobState.__members__ for s in v2.TRAINJOB_STATES.values())


def test_follow_ends_with_the_trainjob(server: KMockServer) -> None:
    install_runtime(server)
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(trainjob())
    done = {"type": "Complete", "status": "True", "reason": "AllJobsCompleted", "message": "done"}
    set_status(server, {"conditions": [done]})
    lines: list[str] = []
    assert backend.follow(ref, write=lines.append, poll_s=0.05) == 0
    assert lines == [f"{NAME}: SUCCEEDED [Complete] — AllJobsCompleted: done\n"]


# -------------------------------------------------------------- logs, cancel


def test_logs_by_jobset_labels_in_node_rank_order(server: KMockServer) -> None:
    install_runtime(server)
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(trainjob(resources__nodes=3))
    add_pod(server, f"{NAME}-node-0-2-abcde", NAME, 2)
    add_pod(server, f"{NAME}-node-0-0-fghij", NAME, 0)
    add_pod(server, f"{NAME}-node-0-1-klmno", NAME, 1)
    add_pod(server, "other-node-0-0-xxxxx", "other", 0)
    for i, suffix in enumerate(("fghij", "klmno", "abcde")):
        server.serve_log(f"{NAME}-node-0-{i}-{suffix}", f"rank block {i}\n")
    text = backend.logs(ref, tail=10)
    assert text == "".join(
        f"==> {NAME}-node-0-{i}-{s} (node {i}) <==\nrank block {i}\n"
        for i, s in enumerate(("fghij", "klmno", "abcde"))
    )
    lists = [r for r in server.requests() if r.action == kmock.action.LIST]
    assert lists[-1].params["labelSelector"] == f"jobset.sigs.k8s.io/jobset-name={NAME}"
    reads = [r for r in server.requests() if r.subresource == "log"]
    assert {r.params["container"] for r in reads} == {"node"}


def test_cancel_deletes_trainjob_and_configmap(server: KMockServer) -> None:
    install_runtime(server)
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(trainjob())
    backend.cancel(ref)
    assert server.objects(TRAINJOBS) == {} and server.objects("v1/configmaps") == {}
    st = backend.status(ref)
    assert (st.state, st.native_state) == (JobState.UNKNOWN, "NotFound")
    assert "TrainJob k8s-test is gone" in st.detail
    with pytest.raises(JobNotFoundError, match="no TrainJob"):
        backend.cancel(ref)


def test_cli_submit_status_logs_cancel_for_a_trainjob(server: KMockServer, tmp_path: Path) -> None:
    install_runtime(server)
    data = {**BASE, "k8s": {**BASE["k8s"], "api": "trainjob"}}
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(data))
    out = shardctl("submit", str(spec), "--cluster", "k8s")
    assert f"as {NS}/{NAME}" in out.stdout
    set_status(server, {"jobsStatus": RUNNING_JOBS})
    assert "RUNNING [Running]" in shardctl("status", NAME).stdout
    add_pod(server, f"{NAME}-node-0-0-aaaaa", NAME, 0)
    server.serve_log(f"{NAME}-node-0-0-aaaaa", "hello from node 0\n")
    assert "hello from node 0" in shardctl("logs", NAME).stdout
    shardctl("cancel", NAME)
    assert server.objects(TRAINJOBS) == {}


def test_follow_logs_of_a_trainjob_by_node_and_rank(server: KMockServer) -> None:
    from test_k8s_client import stream_log

    install_runtime(server)
    backend = k8s_backend.K8sCluster()
    spec = trainjob(resources__nodes=3)
    ref = backend.submit(spec)
    pods = {i: f"{NAME}-node-0-{i}-{s}" for i, s in enumerate(("fghij", "klmno", "abcde"))}
    for i, pod in pods.items():
        add_pod(server, pod, NAME, i)
        stream_log(server, pod, f"node {i} says hi\n".encode(), b"bye\n", pause_s=0.1)
    done = {"type": "Complete", "status": "True", "reason": "AllJobsCompleted", "message": "done"}
    set_status(server, {"conditions": [done]})
    out: list[str] = []
    backend.follow_logs(ref, out.append, poll_s=0.05)
    assert sorted("".join(out).splitlines()) == sorted(
        f"[pod/{pod}/node] {text}" for i, pod in pods.items()
        for text in (f"node {i} says hi", "bye")
    )  # fmt: skip
    # --rank R → the node whose block holds it (numProcPerNode from the TrainJob).
    per_node = backend.procs_per_node(ref)
    assert per_node == spec.resources.procs_per_node
    only: list[str] = []
    backend.follow_logs(ref, only.append, node=2, poll_s=0.05)
    assert "".join(only) == f"[pod/{pods[2]}/node] node 2 says hi\n[pod/{pods[2]}/node] bye\n"
