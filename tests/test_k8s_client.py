"""`--cluster k8s` through the real `kubernetes` client against a real HTTP API (kmock).

The emulator stores objects like an API server; the tests play the training
operator: they patch the PyTorchJob's status conditions, create pods with the
operator's labels and serve their logs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
from helpers.kmock_server import PYTORCHJOBS, KMockServer, kube_api
from shardctl.orchestrator.clusters import k8s as k8s_backend
from shardctl.orchestrator.clusters.base import JobState
from shardctl.orchestrator.clusters.k8s import objects as render_k8s
from shardctl.orchestrator.clusters.k8s.pytorchjob import CONDITION_STATES
from shardctl.orchestrator.errors import ClusterError, JobNotFoundError
from test_k8s_render import BASE, make

NS = BASE["k8s"]["namespace"]
NAME = BASE["name"]


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KMockServer]:
    with kube_api(tmp_path, monkeypatch) as srv:
        yield srv


def operator_api(server: KMockServer) -> tuple[Any, Any]:
    """Clients for the test's own operator role (not the code under test)."""
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = server.url
    api = client.ApiClient(cfg)
    return client.CustomObjectsApi(api), client.CoreV1Api(api)


def set_conditions(server: KMockServer, *conditions: tuple[str, str]) -> None:
    custom, _ = operator_api(server)
    body = {
        "status": {
            "conditions": [
                {"type": t, "status": s, "reason": f"PyTorchJob{t}", "message": f"job is {t}"}
                for t, s in conditions
            ]
        }
    }
    custom.patch_namespaced_custom_object_status(
        "kubeflow.org", "v1", NS, "pytorchjobs", NAME, body
    )


def create_pod(server: KMockServer, metadata: dict[str, Any], container: str) -> None:
    """A pod in NS as an operator makes it: `metadata` (name, labels), one container."""
    _, core = operator_api(server)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": container, "image": "x"}]},
    }
    core.create_namespaced_pod(NS, pod)


def add_pod(server: KMockServer, name: str, job: str, rtype: str, index: int) -> None:
    labels = {
        "training.kubeflow.org/job-name": job,
        "training.kubeflow.org/replica-type": rtype,
        "training.kubeflow.org/replica-index": str(index),
    }
    create_pod(server, {"name": name, "labels": labels}, "pytorch")


# ------------------------------------------------------------------ submit


def test_submit_creates_exactly_the_rendered_objects(server: KMockServer) -> None:
    spec = make()
    ref = k8s_backend.K8sCluster().submit(spec)
    expected = render_k8s.k8s_objects(spec)
    assert server.objects(PYTORCHJOBS) == {(NS, NAME): expected["pytorchjob"]}
    assert server.objects("v1/configmaps") == {(NS, f"{NAME}-spec"): expected["configmap"]}
    assert ref.cluster == "k8s" and ref.job_id == f"{NS}/{NAME}" and ref.name == NAME
    assert ref.run_dir == f"/shardctl/runs/{NAME}"
    assert ref.extra["pvc"] == "runs"
    # The ConfigMap goes first: pods mount it the moment the operator creates them.
    posts = [r.resource.plural for r in server.requests() if r.method == kmock.method.POST]
    assert posts == ["configmaps", "pytorchjobs"]


def test_existing_job_is_a_clear_conflict_and_replace_works(server: KMockServer) -> None:
    k8s_backend.K8sCluster().submit(make())
    with pytest.raises(ClusterError, match="already exists") as err:
        k8s_backend.K8sCluster().submit(make())
    assert "--replace" in str(err.value)
    # --replace deletes the old job (pods first) and submits the new one.
    changed = make(train__steps=6)
    k8s_backend.K8sCluster(replace=True).submit(changed)
    job = server.objects(PYTORCHJOBS)[(NS, NAME)]
    assert job == render_k8s.pytorchjob(changed)
    cm = server.objects("v1/configmaps")[(NS, f"{NAME}-spec")]
    assert "steps: 6" in cm["data"]["job.yaml"]
    deletes = [r for r in server.requests() if r.method == kmock.method.DELETE]
    assert deletes[0].resource.plural == "pytorchjobs"
    assert deletes[0].params["propagationPolicy"] == "Foreground"


def test_stale_configmap_of_a_gone_job_is_updated(server: KMockServer) -> None:
    _, core = operator_api(server)
    stale = render_k8s.configmap(make())
    stale["data"]["job.yaml"] = "old"
    core.create_namespaced_config_map(NS, stale)
    k8s_backend.K8sCluster().submit(make())
    cm = server.objects("v1/configmaps")[(NS, f"{NAME}-spec")]
    assert cm == render_k8s.configmap(make())


def test_missing_crd_names_the_operator_and_leaves_nothing(server: KMockServer) -> None:
    server.fail("post", PYTORCHJOBS, 404, "the server could not find the requested resource")
    with pytest.raises(ClusterError) as err:
        k8s_backend.K8sCluster().submit(make())
    text = str(err.value)
    assert "pytorchjobs.kubeflow.org/v1" in text and "training operator" in text
    assert server.objects("v1/configmaps") == {}  # rolled back


def test_forbidden_names_the_missing_rbac_verb_and_resource(server: KMockServer) -> None:
    server.fail(
        "post",
        PYTORCHJOBS,
        403,
        'pytorchjobs.kubeflow.org is forbidden: User "dev" cannot create resource "pytorchjobs"',
    )
    with pytest.raises(ClusterError) as err:
        k8s_backend.K8sCluster().submit(make())
    text = str(err.value)
    assert "verb create, resource pytorchjobs" in text
    assert "manifests/rbac.yaml" in text
    assert 'User "dev" cannot create' in text


def test_missing_namespace(server: KMockServer) -> None:
    server.fail("post", "v1/configmaps", 404, f'namespaces "{NS}" not found')
    with pytest.raises(ClusterError, match=f"namespace '{NS}' does not exist"):
        k8s_backend.K8sCluster().submit(make())
    assert server.objects(PYTORCHJOBS) == {}


# ------------------------------------------------------------------ status


@pytest.mark.parametrize(
    ("conditions", "state", "native"),
    [
        ((), JobState.PENDING, "Pending"),
        ((("Created", "True"),), JobState.PENDING, "Created"),
        ((("Created", "True"), ("Running", "True")), JobState.RUNNING, "Running"),
        ((("Running", "False"), ("Restarting", "True")), JobState.PREEMPTED, "Restarting"),
        ((("Restarting", "False"), ("Running", "True")), JobState.RUNNING, "Running"),
        ((("Running", "False"), ("Succeeded", "True")), JobState.SUCCEEDED, "Succeeded"),
        ((("Succeeded", "True"), ("Running", "True")), JobState.SUCCEEDED, "Succeeded"),
        ((("Running", "False"), ("Failed", "True")), JobState.FAILED, "Failed"),
        ((("Created", "True"), ("Suspended", "True")), JobState.PENDING, "Suspended"),
        ((("Frobnicated", "True"),), JobState.UNKNOWN, "Frobnicated"),
    ],
)
def test_status_from_conditions(
    server: KMockServer, conditions: tuple[tuple[str, str], ...], state: JobState, native: str
) -> None:
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(make())
    if conditions:
        set_conditions(server, *conditions)
    st = backend.status(ref)
    assert (st.state, st.native_state) == (state, native)
    if conditions and state is not JobState.UNKNOWN:
        assert st.detail == f"job is {native}"


def test_every_operator_condition_is_in_the_table() -> None:
    operator_conditions = {"Created", "Running", "Restarting", "Succeeded", "Failed", "Suspended"}
    assert operator_conditions <= set(CONDITION_STATES)


def test_wait_returns_when_the_operator_finishes(server: KMockServer) -> None:
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(make())
    set_conditions(server, ("Running", "True"))
    seen: list[str] = []
    timer = threading.Timer(
        0.3, set_conditions, (server, ("Running", "False"), ("Succeeded", "True"))
    )
    timer.start()
    try:
        st = backend.wait(
            ref, timeout_s=60, poll_s=0.05, on_change=lambda s: seen.append(s.native_state)
        )
    finally:
        timer.cancel()
    assert st.state is JobState.SUCCEEDED
    assert seen == ["Running", "Succeeded"]


def test_follow_reports_changes_and_returns_the_exit_code(server: KMockServer) -> None:
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(make())
    set_conditions(server, ("Running", "False"), ("Failed", "True"))
    lines: list[str] = []
    assert backend.follow(ref, write=lines.append, poll_s=0.05) == 1
    assert lines == [f"{NAME}: FAILED [Failed] — job is Failed\n"]
    set_conditions(server, ("Running", "False"), ("Succeeded", "True"))
    assert backend.follow(ref, write=lines.append, poll_s=0.05) == 0


def test_wait_times_out(server: KMockServer) -> None:
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(make())
    set_conditions(server, ("Running", "True"))
    with pytest.raises(ClusterError, match="still RUNNING"):
        backend.wait(ref, timeout_s=0.2, poll_s=0.05)


# -------------------------------------------------------------- logs, cancel


def test_logs_of_master_and_workers_by_operator_labels(server: KMockServer) -> None:
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(make(resources__nodes=3))
    add_pod(server, f"{NAME}-worker-1", NAME, "worker", 1)
    add_pod(server, f"{NAME}-master-0", NAME, "master", 0)
    add_pod(server, f"{NAME}-worker-0", NAME, "worker", 0)
    add_pod(server, "other-master-0", "other", "master", 0)
    server.serve_log(f"{NAME}-master-0", "step 1 loss 5.5\nstep 2 loss 5.1\n")
    server.serve_log(f"{NAME}-worker-0", "worker zero\n")
    server.fail(
        "get", "v1/pods", 400, "container is waiting to start: ContainerCreating",
        name=f"{NAME}-worker-1", subresource="log",
    )  # fmt: skip
    text = backend.logs(ref, tail=50)
    assert text == (
        f"==> {NAME}-master-0 (master 0) <==\nstep 1 loss 5.5\nstep 2 loss 5.1\n"
        f"==> {NAME}-worker-0 (worker 0) <==\nworker zero\n"
        f"==> {NAME}-worker-1 (worker 1) <==\n"
        "(no log yet: container is waiting to start: ContainerCreating)\n"
    )
    lists = [r for r in server.requests() if r.action == kmock.action.LIST]
    assert lists[-1].params["labelSelector"] == f"training.kubeflow.org/job-name={NAME}"
    log_reads = [r for r in server.requests() if r.subresource == "log"]
    assert {r.params["tailLines"] for r in log_reads} == {"50"}
    assert {r.params["container"] for r in log_reads} == {"pytorch"}


# torchrun 2.13 under a cancel (SIGTERM): 73 lines, three chained tracebacks.
CANCELLED = (Path(__file__).parent / "data" / "torchrun-cancelled.txt").read_text()


def test_a_stopped_launchers_report_is_one_line_in_logs_and_logs_f(server: KMockServer) -> None:
    """A pod's torchrun report (a cancel, a rank that failed) is the one line every
    cluster shows, naming where the whole of it is; the pod's log itself is untouched."""
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(make(resources__nodes=2))
    add_pod(server, f"{NAME}-master-0", NAME, "master", 0)
    server.serve_log(f"{NAME}-master-0", "step 1 loss 5.5\n" + CANCELLED)
    where = f"the pod's log (kubectl logs -n {NS} {NAME}-master-0 -c pytorch)"
    one = (
        "[shardctl] the launcher received SIGTERM and stopped its ranks (not a crash; "
        f"its full report is in {where})"
    )
    assert backend.logs(ref) == f"==> {NAME}-master-0 (master 0) <==\nstep 1 loss 5.5\n{one}\n"

    # `logs -f` (on the worker's pod: the emulator serves one log per pod and route).
    stream_log(server, f"{NAME}-worker-0", b"step 1 loss 5.5\n", CANCELLED.encode())
    add_pod(server, f"{NAME}-worker-0", NAME, "worker", 0)
    set_conditions(server, ("Running", "True"))
    timer = threading.Timer(1.0, set_conditions, (server, ("Running", "False"), ("Failed", "True")))
    timer.start()
    out: list[str] = []
    try:
        backend.follow_logs(ref, out.append, node=1, poll_s=0.05)
    finally:
        timer.cancel()
    prefix = f"[pod/{NAME}-worker-0/pytorch] "
    one = one.replace("master-0", "worker-0")
    assert "".join(out) == f"{prefix}step 1 loss 5.5\n{prefix}{one}\n"


def test_logs_before_any_pod(server: KMockServer) -> None:
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(make())
    assert "no pods" in backend.logs(ref)


def test_cancel_deletes_job_and_configmap(server: KMockServer) -> None:
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(make())
    backend.cancel(ref)
    assert server.objects(PYTORCHJOBS) == {}
    assert server.objects("v1/configmaps") == {}
    delete = next(r for r in server.requests() if r.method == kmock.method.DELETE)
    assert delete.params["propagationPolicy"] == "Foreground"
    st = backend.status(ref)
    assert (st.state, st.native_state) == (JobState.UNKNOWN, "NotFound")
    with pytest.raises(JobNotFoundError, match="no PyTorchJob"):
        backend.cancel(ref)


# ------------------------------------------------------------- configuration


def test_no_kubeconfig_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDCTL_KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ClusterError, match=r"no kubeconfig: .* does not exist"):
        k8s_backend.K8sCluster().status(k8s_backend.JobRef("k8s", "ns/x", "x", "/r"))


def test_in_cluster_without_a_service_account_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("SHARDCTL_KUBECONFIG", "KUBECONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ClusterError, match="in-cluster Kubernetes config is unusable"):
        k8s_backend.load_api_client()


def test_rejected_credentials(server: KMockServer) -> None:
    server.fail("post", "v1/configmaps", 401, "Unauthorized")
    with pytest.raises(ClusterError, match="unauthorized: the API server rejected"):
        k8s_backend.K8sCluster().submit(make())


def test_unreachable_server_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = KMockServer().start()
    path = srv.kubeconfig(tmp_path)
    srv.stop()  # nothing listens on that port any more
    monkeypatch.setenv("SHARDCTL_KUBECONFIG", str(path))
    with pytest.raises(ClusterError, match="cannot reach the Kubernetes API server"):
        k8s_backend.K8sCluster().submit(make())


# ------------------------------------------------------------------- the CLI


def shardctl(*args: str, check: bool = True) -> Any:
    """The CLI in this process (click's runner): same code path, no interpreter start-up."""
    from click.testing import CliRunner
    from shardctl.orchestrator.cli import cli

    result = CliRunner().invoke(cli, list(args))
    if check:
        assert result.exit_code == 0, result.output + result.stderr
    return result


def write_spec(tmp_path: Path) -> Path:
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE))
    return path


def test_cli_dry_run_contacts_nothing_and_imports_no_client(
    server: KMockServer, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path)
    code = (
        "import sys\n"
        "from shardctl.orchestrator.cli import cli\n"
        f"cli(['submit', {str(spec)!r}, '--cluster', 'k8s', '--dry-run'], standalone_mode=False)\n"
        "imported = 'kubernetes' in sys.modules\n"
        "print('KUBERNETES-IMPORTED' if imported else 'clean', file=sys.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env=os.environ.copy(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().endswith("clean")
    assert "kind: PyTorchJob" in out.stdout and "kind: ConfigMap" in out.stdout
    assert server.requests() == []


def test_cli_submit_status_logs_cancel(server: KMockServer, tmp_path: Path) -> None:
    spec = write_spec(tmp_path)
    out = shardctl("submit", str(spec), "--cluster", "k8s")
    assert f"as {NS}/{NAME}" in out.stdout
    again = shardctl("submit", str(spec), "--cluster", "k8s", check=False)
    assert again.exit_code == 1 and "--replace" in again.stderr
    shardctl("submit", str(spec), "--cluster", "k8s", "--replace")
    set_conditions(server, ("Created", "True"), ("Running", "True"))
    assert "RUNNING [Running]" in shardctl("status", NAME).stdout
    add_pod(server, f"{NAME}-master-0", NAME, "master", 0)
    server.serve_log(f"{NAME}-master-0", "hello from rank 0\n")
    assert "hello from rank 0" in shardctl("logs", NAME).stdout
    shardctl("cancel", NAME)
    assert server.objects(PYTORCHJOBS) == {}


# ------------------------------------------------------------------- logs -f, ls


def stream_log(server: KMockServer, pod: str, *chunks: bytes, pause_s: float = 0.3) -> None:
    """Serve `pod`'s log as a real stream: raw bytes (text/plain, as an API server sends
    them), chunk by chunk with pauses, the connection closing after the last one (the
    container ended). `kmock.text` would send a JSON string instead."""
    import asyncio

    async def gen() -> Any:
        for i, chunk in enumerate(chunks):
            if i:
                await asyncio.sleep(pause_s)
            yield chunk

    slot = server.handler[
        kmock.method.GET, kmock.resource("v1/pods"), kmock.name(pod), kmock.subresource("log")
    ]
    slot << (lambda: gen())


def test_follow_logs_streams_every_pod_with_a_prefix_until_the_job_ends(
    server: KMockServer,
) -> None:
    backend = k8s_backend.K8sCluster()
    ref = backend.submit(make(resources__nodes=2))
    set_conditions(server, ("Running", "True"))
    add_pod(server, f"{NAME}-master-0", NAME, "master", 0)
    add_pod(server, f"{NAME}-worker-0", NAME, "worker", 0)
    add_pod(server, "other-master-0", "other", "master", 0)
    # A line split across chunks, and no newline at the very end.
    stream_log(server, f"{NAME}-master-0", b"step 1 loss 5.5\nstep 2", b" loss 5.1")
    stream_log(server, f"{NAME}-worker-0", b"worker zero\n")
    stream_log(server, "other-master-0", b"not ours\n")
    timer = threading.Timer(
        1.0, set_conditions, (server, ("Running", "False"), ("Succeeded", "True"))
    )
    timer.start()
    out: list[str] = []
    try:
        backend.follow_logs(ref, out.append, poll_s=0.05)
    finally:
        timer.cancel()
    lines = "".join(out).splitlines()
    assert sorted(lines) == sorted([
        f"[pod/{NAME}-master-0/pytorch] step 1 loss 5.5",
        f"[pod/{NAME}-master-0/pytorch] step 2 loss 5.1",
        f"[pod/{NAME}-worker-0/pytorch] worker zero",
    ])  # fmt: skip
    reads = [r for r in server.requests() if r.subresource == "log"]
    assert {r.params["follow"] for r in reads} == {"true"}
    assert len(reads) == 2  # one stream per pod, not one per poll
    # A job no wider than the pool of streams: each held to its end, never resumed.
    assert not any("timestamps" in r.params or "sinceSeconds" in r.params for r in reads)

    only: list[str] = []
    backend.follow_logs(ref, only.append, node=1, poll_s=0.05)  # worker 0 is node 1
    assert "".join(only) == f"[pod/{NAME}-worker-0/pytorch] worker zero\n"
    assert backend.procs_per_node(ref) == make().resources.procs_per_node


def test_cli_logs_follow_rank_and_ls_on_k8s(server: KMockServer, tmp_path: Path) -> None:
    import json

    spec = write_spec(tmp_path)
    shardctl("submit", str(spec), "--cluster", "k8s")
    set_conditions(server, ("Created", "True"), ("Running", "True"))
    res = shardctl("ls", "-o", "json")
    (row,) = json.loads(res.stdout)["jobs"]
    assert (row["name"], row["cluster"], row["state"], row["stale"]) == (
        NAME,
        "k8s",
        "RUNNING",
        False,
    )
    assert row["progress"] is None and "PersistentVolumeClaim" in row["why"]
    assert "RUNNING" in shardctl("ls", "--cluster", "k8s").stdout
    add_pod(server, f"{NAME}-master-0", NAME, "master", 0)
    stream_log(server, f"{NAME}-master-0", b"hello from rank 0\n")
    set_conditions(server, ("Running", "False"), ("Succeeded", "True"))
    res = shardctl("logs", NAME, "-f", "--rank", "0")
    assert res.stdout == f"[pod/{NAME}-master-0/pytorch] hello from rank 0\n"
    assert "rank 0 runs on node 0" in res.stderr
    res = shardctl("status", NAME, "--watch")
    assert "SUCCEEDED" in res.stdout
    shardctl("cancel", NAME)
    res = shardctl("ls", "-o", "json")
    (row,) = json.loads(res.stdout)["jobs"]
    assert row["stale"] and "no longer knows the job" in row["why_stale"]


def test_cli_status_watch_follows_the_operator_to_the_end(
    server: KMockServer, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path)
    shardctl("submit", str(spec), "--cluster", "k8s")
    set_conditions(server, ("Created", "True"), ("Running", "True"))
    timer = threading.Timer(1.0, set_conditions, (server, ("Running", "False"), ("Failed", "True")))
    timer.start()
    try:
        res = shardctl("status", NAME, "--watch", "--interval", "0.1", check=False)
    finally:
        timer.cancel()
    lines = res.stdout.splitlines()
    assert "RUNNING [Running]" in lines[0] and "FAILED [Failed]" in lines[-1], res.stdout
    assert res.exit_code == 1  # like submit --wait: the job failed
