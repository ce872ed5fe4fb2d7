"""A Kubernetes job at width in kmock: many pods, their logs played like a kubelet, and
the CLI's `status`, `logs -f` and `cancel` measured from outside their process.

Shared by tests/test_k8s_width.py and benchmarks/k8s_width.py. The emulator
(helpers/kmock_server.py) runs in this process; the command under measure runs as
a child process (`python -m shardctl.orchestrator.cli`), so its threads and its
TCP connections to the emulator are its own and are read from /proc (psutil)
while it runs. The test plays the operator and the kubelets: it creates the job's
pods with the operator's labels, serves every pod's log from one handler that
honours `follow`, `timestamps`, `sinceTime` and `tailLines` like a kubelet, and
marks the job ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kmock
import psutil
from helpers.kmock_server import PYTORCHJOBS, TRAINJOBS, KMockServer

SHARDCTL = [sys.executable, "-m", "shardctl.orchestrator.cli"]
TOKEN = "test-token"  # the kubeconfig's (helpers/kmock_server.py): the CLI's requests carry it
NS = "ml"

# The operator's pod labels (kept here rather than imported from the code under test:
# they are the operator's and JobSet's interface, not shardctl's choice).
PYTORCHJOB_LABELS = ("training.kubeflow.org/job-name", "training.kubeflow.org/replica-type",
                     "training.kubeflow.org/replica-index")  # fmt: skip
JOBSET_LABELS = ("jobset.sigs.k8s.io/jobset-name", "jobset.sigs.k8s.io/replicatedjob-name",
                 "batch.kubernetes.io/job-completion-index")  # fmt: skip


def spec_data(name: str, api: str, nodes: int) -> dict[str, Any]:
    """A job spec of `nodes` nodes; a TrainJob on a runtime the test installs."""
    k8s: dict[str, Any] = {"namespace": NS, "image": "registry.example/shardctl:1",
                           "pvc": "runs", "api": api}  # fmt: skip
    if api == "trainjob":
        k8s["runtime"] = "width-runtime"
    return {
        "name": name,
        "resources": {"nodes": nodes, "procs_per_node": 1, "device": "cpu"},
        "train": {
            "model": {"llama": {"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 1}},
            "data": {"builtin": "python-stdlib"},
            "steps": 4,
        },
        "checkpoint": {"every_steps": 2},
        "k8s": k8s,
    }


def pod_names(name: str, api: str, nodes: int) -> list[str]:
    """The pods' names in node order (node 0 first), as the operator / JobSet names them."""
    if api == "trainjob":
        return [f"{name}-node-0-{i}-x{i:04d}" for i in range(nodes)]
    return [f"{name}-master-0", *(f"{name}-worker-{i}" for i in range(nodes - 1))]


def rfc3339nano(ns: int) -> str:
    """A kubelet's timestamp: RFC 3339 with nanoseconds, trailing zeros trimmed."""
    whole = datetime.fromtimestamp(ns // 1_000_000_000, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    frac = f"{ns % 1_000_000_000:09d}".rstrip("0")
    return f"{whole}{'.' + frac if frac else ''}Z"


@dataclass
class LogPlayer:
    """Every pod's log as a kubelet serves it: pod `p` writes `lines` lines, one every
    `period_s` from `start` (wall clock), then its container ends. A request sees the
    lines written so far (after `sinceTime`, then the last `tailLines`), and with
    `follow=true` the rest as they are written, the stream closing when the container
    ends; `timestamps=true` puts each line's write time first. (`sinceSeconds` is
    measured on this machine's clock, which is the "kubelet's" here.)"""

    pods: list[str]
    lines: int
    period_s: float
    start_ns: int = field(default_factory=time.time_ns)
    served: int = 0  # log requests answered
    killed_ns: int | None = None

    def text(self, pod: str, j: int) -> str:
        return f"{pod} says line {j}"

    def written_at(self, j: int) -> int:
        return self.start_ns + int(j * self.period_s * 1e9)

    def install(self, server: KMockServer) -> None:
        slot = server.handler[
            kmock.method.GET, kmock.resource("v1/pods"), kmock.subresource("log")
        ]  # fmt: skip
        slot << (lambda request: self.serve(request))

    def serve(self, request: Any) -> bytes | AsyncIterator[bytes]:
        self.served += 1
        params = request.params
        stamps = params.get("timestamps") == "true"
        since = params.get("sinceSeconds")
        tail = int(params["tailLines"]) if "tailLines" in params else None
        now = time.time_ns()

        def line(j: int) -> bytes:
            stamp = f"{rfc3339nano(self.written_at(j))} " if stamps else ""
            return f"{stamp}{self.text(request.name, j)}\n".encode()

        written = [j for j in range(self.lines) if self.is_written(j, now)]
        later = range(len(written), self.lines)
        if tail is not None:  # the kubelet seeks back `tail` lines, then applies since
            written = written[-tail:] if tail else []
        if since is not None:
            written = [j for j in written if self.written_at(j) >= now - int(since) * 10**9]
        if params.get("follow") != "true" or not later:
            # (kmock answers an empty stream with 404: an empty log is an empty body)
            return b"".join(line(j) for j in written)

        async def stream() -> AsyncIterator[bytes]:
            if written:
                yield b"".join(line(j) for j in written)
            for j in later:
                await asyncio.sleep(max(0.0, (self.written_at(j) - time.time_ns()) / 1e9))
                if not self.is_written(j, time.time_ns()):
                    return  # the container was killed
                yield line(j)

        return stream()

    def is_written(self, j: int, now_ns: int) -> bool:
        at = self.written_at(j)
        return at <= now_ns and (self.killed_ns is None or at < self.killed_ns)

    def kill(self) -> None:
        """Every container is killed now (a cancel): no line is written after this."""
        self.killed_ns = time.time_ns()

    def expected(self) -> dict[str, list[str]]:
        """Each pod's lines written so far, in order."""
        now = time.time_ns()
        return {p: [self.text(p, j) for j in range(self.lines) if self.is_written(j, now)]
                for p in self.pods}  # fmt: skip

    @property
    def ends_at(self) -> float:
        """When the last container ends, in `time.time()` seconds."""
        return self.written_at(self.lines - 1) / 1e9


@dataclass
class Peaks:
    """What a process used at most while it ran, sampled from outside."""

    threads: int = 0
    connections: int = 0  # established TCP connections to the API server
    samples: int = 0


def _sample(proc: psutil.Process, port: int, peaks: Peaks, done: threading.Event) -> None:
    while not done.is_set():
        try:
            threads = proc.num_threads()
            conns = sum(
                1
                for c in proc.net_connections(kind="tcp")
                if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
            )
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            return
        peaks.threads = max(peaks.threads, threads)
        peaks.connections = max(peaks.connections, conns)
        peaks.samples += 1
        done.wait(0.02)


@dataclass
class Measured:
    args: list[str]
    wall_s: float
    code: int
    stdout: str
    stderr: str
    peaks: Peaks
    requests: dict[str, int]  # API requests during the command, by kind
    cpu_s: float  # user + system CPU of the process (and of any other child ended meanwhile)


def _kind(request: Any) -> str:
    if request.subresource == "log":
        return "log"
    action = request.action.value if request.action is not None else str(request.method)
    plural = request.resource.plural if request.resource is not None else "?"
    return f"{action} {plural}"


class Width:
    """One job of `nodes` pods in a kmock server, and the CLI run against it."""

    def __init__(self, server: KMockServer, home: Path, api: str, nodes: int, name: str) -> None:
        self.server, self.home, self.api, self.nodes, self.name = server, home, api, nodes, name
        self.pods = pod_names(name, api, nodes)
        self.env = {
            **os.environ,
            "KUBECONFIG": str(server.kubeconfig(home)),
            "SHARDCTL_STATE_DIR": str(home / "state"),
            "PYTHONUNBUFFERED": "1",
        }
        for var in ("SHARDCTL_KUBECONFIG", "SHARDCTL_KUBE_CONTEXT", "SHARDCTL_K8S_REPLACE",
                    "KUBERNETES_SERVICE_HOST"):  # fmt: skip
            self.env.pop(var, None)
        port = server.url.rsplit(":", 1)[1]
        self.port = int(port)

    def operator(self) -> tuple[Any, Any]:
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.server.url
        api = client.ApiClient(cfg)
        return client.CustomObjectsApi(api), client.CoreV1Api(api)

    def submit(self) -> None:
        """`shardctl submit` of the job (in a child process, like a user)."""
        import yaml

        if self.api == "trainjob":
            custom, _ = self.operator()
            body = {
                "apiVersion": "trainer.kubeflow.org/v1alpha1",
                "kind": "ClusterTrainingRuntime",
                "metadata": {"name": "width-runtime"},
                "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}},
            }
            with contextlib.suppress(Exception):  # installed by an earlier job of the server
                custom.create_cluster_custom_object(
                    "trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", body
                )
        path = self.home / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(spec_data(self.name, self.api, self.nodes)))
        out = self.run("submit", str(path), "--cluster", "k8s", timeout=120)
        assert out.code == 0, out.stderr

    def add_pods(self) -> None:
        """What the operator (PyTorchJob) or JobSet (TrainJob) creates: one pod per node
        (created by 8 threads: one by one, 128 pods took 4-7 s of the tests' budget)."""
        from concurrent.futures import ThreadPoolExecutor

        _, core = self.operator()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: core.create_namespaced_pod(NS, self.pod(i)), range(self.nodes)))

    def pod(self, i: int) -> dict[str, Any]:
        """Node `i`'s pod, labelled as its operator labels it, its container running."""
        if self.api == "trainjob":
            job_l, role_l, index_l = JOBSET_LABELS
            labels = {job_l: self.name, role_l: "node", index_l: str(i),
                      "jobset.sigs.k8s.io/job-index": "0"}  # fmt: skip
            container = "node"
        else:
            job_l, role_l, index_l = PYTORCHJOB_LABELS
            role, index = ("master", 0) if i == 0 else ("worker", i - 1)
            labels = {job_l: self.name, role_l: role, index_l: str(index)}
            container = "pytorch"
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": self.pods[i], "labels": labels},
            "spec": {"containers": [{"name": container, "image": "x"}]},
            "status": {"phase": "Running", "containerStatuses": [
                {"name": container, "restartCount": 0, "ready": True, "image": "x",
                 "imageID": "", "started": True}]},
        }  # fmt: skip

    def set_state(self, state: str) -> None:
        """The operator's view of the job: "Running", "Succeeded" or "Failed"."""
        custom, _ = self.operator()
        if self.api == "trainjob":
            if state == "Running":  # JobSet's jobs all active and ready
                jobs = {"name": "node", "active": self.nodes, "ready": self.nodes, "failed": 0,
                        "succeeded": 0}  # fmt: skip
                status: dict[str, Any] = {"jobsStatus": [jobs]}
            else:
                end = "Complete" if state == "Succeeded" else "Failed"
                status = {"conditions": [{"type": end, "status": "True", "reason": state,
                                          "message": state}]}  # fmt: skip
            group, version, plural = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
        else:
            cond = {"type": state, "status": "True", "reason": f"PyTorchJob{state}",
                    "message": f"job is {state}"}  # fmt: skip
            status = {"conditions": [cond]}
            group, version, plural = "kubeflow.org", "v1", "pytorchjobs"
        custom.patch_namespaced_custom_object_status(
            group, version, NS, plural, self.name, {"status": status}
        )

    def job_exists(self) -> bool:
        resource = TRAINJOBS if self.api == "trainjob" else PYTORCHJOBS
        return (NS, self.name) in self.server.objects(resource)

    def run(self, *args: str, timeout: float) -> Measured:
        """The CLI in a child process: wall time, exit code, output, peak threads and
        connections (sampled every 20 ms), the API requests it made."""
        before = len(self.server.requests())
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [*SHARDCTL, *args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        peaks, done = Peaks(), threading.Event()
        sampler = threading.Thread(
            target=_sample, args=(psutil.Process(proc.pid), self.port, peaks, done), daemon=True
        )
        sampler.start()
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            stdout, stderr = proc.communicate(timeout=10)
            stderr += f"\n(killed after {timeout:g} s)"
        finally:
            done.set()
            sampler.join(5)
        wall = time.monotonic() - t0
        now = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
        counts: dict[str, int] = {}
        for request in self.server.requests()[before:]:
            if request.headers.get("Authorization") != f"Bearer {TOKEN}":
                continue  # the test's own, playing the operator
            kind = _kind(request)
            counts[kind] = counts.get(kind, 0) + 1
        return Measured(list(args), wall, proc.returncode, stdout, stderr, peaks, counts, cpu)

    @contextlib.contextmanager
    def started(self, *args: str, timeout: float) -> Iterator[Follow]:
        """The CLI started in a child process, measured until `Follow.result()`."""
        follow = Follow(self, list(args), timeout)
        try:
            yield follow
        finally:
            follow.cleanup()


class Follow:
    """A CLI command running in the background (`logs -f`), measured like `Width.run`."""

    def __init__(self, width: Width, args: list[str], timeout: float) -> None:
        self.width, self.args, self.timeout = width, args, timeout
        self.result_: Measured | None = None
        self._thread = threading.Thread(target=self._run, name="follow", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.result_ = self.width.run(*self.args, timeout=self.timeout)

    def result(self) -> Measured:
        self._thread.join(self.timeout + 30)
        assert self.result_ is not None, f"{self.args} did not return"
        return self.result_

    def cleanup(self) -> None:
        self._thread.join(self.timeout + 30)


def stop_group(proc: subprocess.Popen[str]) -> None:
    """End the process group this harness started (by its id), if it still runs."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_until(check: Any, timeout: float, what: str, every: float = 0.05) -> None:
    """Poll `check()` until true; AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(every)


def serve(with_crd: bool = True) -> KMockServer:
    return KMockServer(with_crd=with_crd).start()
