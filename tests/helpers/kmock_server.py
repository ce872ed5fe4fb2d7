"""A real HTTP Kubernetes API emulator (kmock) on loopback, for the k8s client tests.

kmock's KubernetesEmulator keeps objects in memory and serves create / get /
list / watch / patch / delete like an API server. It runs on its own asyncio
loop in a daemon thread of the test process; `stop()` ends the loop and joins
the thread with a timeout. Tests play the training operator: they patch job
status conditions and create pods with the operator's labels, and declare each
pod's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

PYTORCHJOBS = "kubeflow.org/v1/pytorchjobs"
TRAINJOBS = "trainer.kubeflow.org/v1alpha1/trainjobs"
CLUSTER_RUNTIMES = "trainer.kubeflow.org/v1alpha1/clustertrainingruntimes"
RUNTIMES = "trainer.kubeflow.org/v1alpha1/trainingruntimes"


class KMockServer:
    def __init__(self, with_crd: bool = True) -> None:
        self.with_crd = with_crd
        self.handler: Any = None
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)

    def start(self, timeout: float = 30.0) -> KMockServer:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"kmock did not start within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"kmock failed to start: {self._error!r}")
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start() instead of dying silently
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        async with kmock.KubernetesEmulator() as handler, kmock.Server(handler) as server:
            self.handler = handler
            handler.resources["v1/pods"] = {}
            handler.resources["v1/configmaps"] = {}
            if self.with_crd:
                handler.resources[PYTORCHJOBS] = {}
                # Kubeflow Trainer v2: TrainJobs and the runtimes they reference.
                handler.resources[TRAINJOBS] = {}
                handler.resources[CLUSTER_RUNTIMES] = {}
                handler.resources[RUNTIMES] = {}
            self.url = str(server.url).rstrip("/")
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("kmock thread did not stop")

    # ------------------------------------------------------------ for tests

    def kubeconfig(self, folder: Path, namespace: str = "default") -> Path:
        """A kubeconfig file pointing at this server (token auth, plain HTTP on loopback)."""
        path = folder / "kubeconfig"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                    "users": [{"name": "tester", "user": {"token": "test-token"}}],
                    "contexts": [
                        {
                            "name": "kmock",
                            "context": {
                                "cluster": "kmock",
                                "user": "tester",
                                "namespace": namespace,
                            },
                        }
                    ],
                    "current-context": "kmock",
                }
            )
        )
        return path

    def requests(self) -> list[Any]:
        """Every request the server has seen, in order."""
        return list(self.handler)

    def objects(self, resource: str) -> dict[tuple[str | None, str], dict[str, Any]]:
        """Live objects of a resource ('v1/pods', PYTORCHJOBS ...): (namespace, name) → object."""
        out: dict[tuple[str | None, str], dict[str, Any]] = {}
        res = kmock.resource(resource)
        for (r, ns, name), obj in list(self.handler.objects.items()):
            if r == res and not obj.deleted:
                out[(ns, name)] = obj.raw
        return out

    def fail(self, method: str, resource: str, status: int, message: str, **criteria: Any) -> None:
        """Answer `method` on `resource` with an API Status error, as a real server would.

        `criteria`: `name=` and/or `subresource=` narrow it to one object or subresource.
        """
        extra = []
        if "name" in criteria:
            extra.append(kmock.name(criteria["name"]))
        if "subresource" in criteria:
            extra.append(kmock.subresource(criteria["subresource"]))
        status_body = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "code": status,
            "message": message,
        }
        slot = self.handler[kmock.method(method.upper()), kmock.resource(resource), *extra]
        slot << status << status_body

    def serve_log(self, pod: str, text: str) -> None:
        """The log of `pod` (GET .../pods/<pod>/log) as text/plain."""
        slot = self.handler[
            kmock.method.GET, kmock.resource("v1/pods"), kmock.name(pod), kmock.subresource("log")
        ]
        slot << kmock.text(text)


# What would point the kubernetes client, or shardctl, elsewhere than the emulator.
OTHER_KUBE_SETTINGS = (
    "SHARDCTL_KUBECONFIG", "SHARDCTL_KUBE_CONTEXT", "SHARDCTL_K8S_REPLACE",
    "KUBERNETES_SERVICE_HOST",
)  # fmt: skip


@contextlib.contextmanager
def kube_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KMockServer]:
    """A started emulator that the kubernetes client reaches through KUBECONFIG (written
    in `tmp_path`), nothing else of the environment pointing elsewhere; stopped on
    leaving."""
    server = KMockServer().start()
    try:
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path)))
        for var in OTHER_KUBE_SETTINGS:
            monkeypatch.delenv(var, raising=False)
        yield server
    finally:
        server.stop()
