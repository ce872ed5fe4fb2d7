"""`--cluster k8s`: a Kubeflow PyTorchJob or TrainJob created through the `kubernetes` client.

`dryrun` renders the ConfigMap and the job (objects.py) and contacts nothing;
`schedule` sends exactly those two objects. What differs between the two APIs (the
job's resource, its states, its pods, what must exist before it) is asked of its
`JobKind` (jobkind.py; `apis.job_kind` picks it from `k8s.api` or the job record):
pytorchjob.py and trainjob.py, each with its own state table.

Which cluster: the kubeconfig the `kubernetes` client finds (`$KUBECONFIG`,
else ~/.kube/config), overridden by `$SHARDCTL_KUBECONFIG` and
`$SHARDCTL_KUBE_CONTEXT`; inside a pod without a kubeconfig, the in-cluster
service account. The client is imported only here, only when a call needs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ...assets import manifest
from ...errors import ClusterError, JobNotFoundError, MissingDependencyError
from ...launch import EnvLine, entry_words
from ...launcher_output import LauncherReport, readable
from ...render import common_artifacts
from ...spec import JobSpec
from ..base import Cluster, DryRun, FinishedRun, JobRef, JobState, JobStatus, NodeView
from . import objects as k8s_render
from .apis import job_kind
from .jobkind import JobKind, Prerequisite
from .logstreams import LOG_STREAMS, LogNotReady, LogStreams, PodLog
from .pods import RUNS_MOUNT, SPEC_FILE, configmap_name
from .preflight import k8s_checks
from .section import K8sSection

if TYPE_CHECKING:
    from ...doctor import Check, Preflight

T = TypeVar("T")

REQUEST_TIMEOUT_S = 30
# How long `logs -f` waits for the pods' streams to end once the job has ended.
STREAM_DRAIN_S = 30.0
REPLACE_TIMEOUT_S = 180.0


def rbac_hint() -> str:
    return f"the Role in {manifest('rbac.yaml')} grants what shardctl needs"


def kind_of(ref: JobRef) -> JobKind:
    return job_kind(ref.extra.get("api"))


class K8sCluster(Cluster):
    name = "k8s"

    spec_section = K8sSection
    # Each pod's first process: the launch script execs the node agent (node_agent.py).
    node_agent = k8s_render.NODE_AGENT_MODULE

    def run_problems(self, spec: JobSpec) -> list[str]:
        # The section's rules and its API's; `render_from` refuses the same list.
        return k8s_render.run_problems(spec)

    def submit_problems(self, spec: JobSpec) -> list[str]:
        # `dryrun` checks the spec as given (`render_from`), not the pods' view of it.
        return self.run_problems(spec)

    def preflight(self, spec: JobSpec) -> Preflight:
        from ...doctor import Preflight

        return Preflight(k8s_checks(spec, self))

    def preemption_budget(self, spec: JobSpec) -> tuple[int, str] | None:
        return spec.k8s.termination_grace_s, "k8s.termination_grace_s"

    def network_check(self, spec: JobSpec, var: str) -> Check | None:
        from ...doctor import Check

        chosen = spec.env.get(var)
        detail = (
            f"{var}={chosen}"
            if chosen
            else (
                f"{var} is not set: pods have one interface (eth0) unless the network plugin "
                f"adds more (Multus, RDMA); then set env.{var}"
            )
        )
        return Check("network interface", "ok", detail)

    def next_step_for(self, spec: JobSpec) -> str:
        return job_kind(spec.k8s.api).next_step(spec)

    can_follow = True
    supports_replace = True
    run_dir_here = False
    # `status` and `logs` read the API and the job's ConfigMap, never the run dir, which
    # is on the PVC or, with checkpoints in a bucket and no PVC, each pod's own emptyDir.
    run_dir_elsewhere = (
        "the run dir is in the job's pods (its PersistentVolumeClaim, or without one each "
        "pod's emptyDir), not on this machine"
    )

    def __init__(self, replace: bool | None = None, api_client: Any = None) -> None:
        # --replace (or SHARDCTL_K8S_REPLACE=1): delete a job of the same name first.
        if replace is None:
            replace = os.environ.get("SHARDCTL_K8S_REPLACE", "") not in ("", "0", "false")
        self.replace = replace
        self._api_client = api_client

    # ----------------------------------------------------------------- submit

    def runtime_env(self, spec: JobSpec) -> list[EnvLine]:
        return k8s_render.runtime_env(spec)

    def node_view(self, spec: JobSpec) -> NodeView:
        return k8s_render.node_view(spec)

    def own_artifacts(self, node: NodeView, common: dict[str, str]) -> dict[str, str]:
        return k8s_render.render_from(node.spec, node, common).files

    def dryrun(self, spec: JobSpec) -> DryRun:
        # Computed once: the node files, the chart values, the objects, their texts.
        node = self.node_view(spec)
        common = common_artifacts(
            node.spec, node.spec_path, self.name, self.runtime_env(node.spec),
            node_agent=self.node_agent,
        )  # fmt: skip
        rendered = k8s_render.render_from(spec, node, common)
        return DryRun(
            cluster=self.name,
            spec=spec,
            artifacts=dict(sorted({**common, **rendered.files}.items())),
            request=rendered.objects,
            text=rendered.manifests,
        )

    def schedule(self, dryrun: DryRun) -> JobRef:
        spec = dryrun.spec
        kind = job_kind(spec.k8s.api)
        cm, job = dryrun.request["configmap"], dryrun.request[kind.api]
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        core, custom = self._core(), self._custom()
        need = kind.prerequisite(spec)
        if need is not None:
            self._check_prerequisite(custom, need, ns)
        if self.replace:
            self._delete_everything(kind, ns, name, wait=True)
        self._create_configmap(kind, core, custom, cm, ns, name)
        try:
            created = self._job_call(
                "create",
                kind,
                ns,
                custom.create_namespaced_custom_object,
                job,
                not_found=f"the cluster does not serve {kind.plural}.{kind.group}/{kind.version} "
                f"(the {kind.kind} CRD is not installed); {kind.install_hint}",
                conflict=_exists_message(kind, ns, name),
                rejected=kind.rejection(spec),
            )
        except ClusterError:
            # Leave nothing behind from a submission that did not happen; a failing
            # clean-up must not hide the reason the submission failed.
            with contextlib.suppress(ClusterError):
                self._delete_configmap(core, ns, cm["metadata"]["name"])
            raise
        uid = ((created or {}).get("metadata") or {}).get("uid")
        return JobRef(
            cluster=self.name,
            job_id=f"{ns}/{name}",
            name=spec.name,
            run_dir=f"{RUNS_MOUNT}/{spec.name}",
            extra={"namespace": ns, "job": name, "pvc": spec.k8s.pvc, "uid": uid,
                   "api": kind.api},
        )  # fmt: skip

    def finished_run(self, dryrun: DryRun) -> FinishedRun | None:
        # The run dir is on the volume, not here: a job of the same name that succeeded
        # (every pod's watchdog said done) and the job.yaml its ConfigMap gave the pods
        # say what was finished. A job deleted since (its TTL) tells nothing.
        kind = job_kind(dryrun.spec.k8s.api)
        ns, name = _where_new(dryrun, kind)
        try:
            job = self._get_job(kind, self._custom(), ns, name)
            if kind.state_of(job).state is not JobState.SUCCEEDED:
                return None
            cm = self._call(
                "get",
                "configmaps",
                ns,
                lambda: self._core().read_namespaced_config_map(
                    configmap_name(name), ns, _request_timeout=REQUEST_TIMEOUT_S
                ),
            )
        except JobNotFoundError:
            return None
        except ClusterError as exc:
            # A role without `get` on ConfigMaps (an older manifests/rbac.yaml): unknown,
            # and the submit goes on as it did before (a job that exists is refused).
            if "forbidden" not in str(exc):
                raise
            return None
        ran = _spec_from_text((getattr(cm, "data", None) or {}).get(SPEC_FILE))
        if ran is None:
            return None
        where = (
            f"{kind.kind} {ns}/{name} succeeded; its run dir is {RUNS_MOUNT}/{ran.name} on "
            f"PVC {dryrun.spec.k8s.pvc}"
        )
        step = ran.train.steps if ran.train is not None and ran.entrypoint is None else None
        return FinishedRun(where, step=step, command=entry_words(ran))

    def _check_prerequisite(self, custom: Any, need: Prerequisite, ns: str) -> None:
        """The job names an object (a TrainJob's runtime) that must exist: say which
        and how to get it."""
        if need.namespaced:
            get = lambda: custom.get_namespaced_custom_object(  # noqa: E731
                need.group, need.version, ns, need.plural, need.name,
                _request_timeout=REQUEST_TIMEOUT_S,
            )  # fmt: skip
        else:
            get = lambda: custom.get_cluster_custom_object(  # noqa: E731
                need.group, need.version, need.plural, need.name,
                _request_timeout=REQUEST_TIMEOUT_S,
            )  # fmt: skip
        try:
            self._call("get", need.plural, ns, get, not_found=need.missing)
        except JobNotFoundError as exc:
            raise ClusterError(str(exc)) from None
        except ClusterError as exc:
            # Reading it may be forbidden to job submitters; then the API server's
            # admission webhook is the check (see `JobKind.rejection`).
            if "forbidden" not in str(exc):
                raise

    def _create_configmap(
        self, kind: JobKind, core: Any, custom: Any, cm: dict[str, Any], ns: str, name: str
    ) -> None:
        cm_name = cm["metadata"]["name"]

        def create(**errors: str) -> None:  # `_call`'s messages for this attempt
            self._call(
                "create",
                "configmaps",
                ns,
                lambda: core.create_namespaced_config_map(
                    ns, cm, _request_timeout=REQUEST_TIMEOUT_S
                ),
                **errors,
            )

        try:
            create(
                not_found=f"namespace {ns!r} does not exist (k8s.namespace); create it with "
                f"`kubectl apply -f {manifest('namespace.yaml')}` or `kubectl create namespace "
                f"{ns}`",
            )
        except _Conflict:
            if self._job_exists(kind, custom, ns, name):
                raise ClusterError(_exists_message(kind, ns, name)) from None
            # A ConfigMap left from a job that is gone (deleted by hand, TTL cleanup):
            # ours to renew. Delete and create rather than merge, so no stale file stays.
            self._call(
                "delete",
                "configmaps",
                ns,
                lambda: core.delete_namespaced_config_map(
                    cm_name, ns, _request_timeout=REQUEST_TIMEOUT_S
                ),
            )
            create(conflict=f"ConfigMap {ns}/{cm_name} was re-created by someone else meanwhile")

    def _job_exists(self, kind: JobKind, custom: Any, ns: str, name: str) -> bool:
        try:
            self._get_job(kind, custom, ns, name)
        except JobNotFoundError:
            return False
        return True

    # ------------------------------------------------------------- follow-up

    def status(self, ref: JobRef) -> JobStatus:
        ns, name = _where(ref)
        kind = kind_of(ref)
        try:
            job = self._get_job(kind, self._custom(), ns, name)
        except JobNotFoundError:
            return JobStatus(
                JobState.UNKNOWN,
                "NotFound",
                f"{kind.kind} {name} is gone from namespace {ns} "
                "(cancelled, deleted, or cleaned up after it finished)",
            )
        return kind.state_of(job)

    def wait(
        self,
        ref: JobRef,
        timeout_s: float | None = None,
        poll_s: float = 5.0,
        on_change: Callable[[JobStatus], None] | None = None,
    ) -> JobStatus:
        """Poll until the job succeeded or failed (or disappeared); ClusterError on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last: JobStatus | None = None
        while True:
            st = self.status(ref)
            if on_change is not None and (last is None or st != last):
                on_change(st)
            last = st
            if st.state.is_terminal or st.native_state == "NotFound":
                return st
            if deadline is not None and time.monotonic() >= deadline:
                raise ClusterError(
                    f"{kind_of(ref).kind} {ref.job_id} still {st.state.value} "
                    f"[{st.native_state}] after {timeout_s:g} s"
                )
            time.sleep(poll_s)

    def follow(
        self, ref: JobRef, write: Callable[[str], None] | None = None, poll_s: float = 5.0
    ) -> int:
        """`submit --wait`: report each state change until the job ends; 0 if it succeeded."""
        out = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))

        def report(st: JobStatus) -> None:
            detail = f" — {st.detail}" if st.detail else ""
            out(f"{ref.name}: {st.state.value} [{st.native_state}]{detail}\n")

        final = self.wait(ref, poll_s=poll_s, on_change=report)
        return 0 if final.state is JobState.SUCCEEDED else 1

    def pods(self, ref: JobRef) -> list[dict[str, Any]]:
        """The job's pods (found by the operator's labels), master / node 0 first."""
        ns, name = _where(ref)
        kind = kind_of(ref)
        core = self._core()
        found = self._call(
            "list",
            "pods",
            ns,
            lambda: core.list_namespaced_pod(
                ns, label_selector=f"{kind.pod_label}={name}", _request_timeout=REQUEST_TIMEOUT_S,
                # The API's JSON as it is: `logs -f` lists every tick, and the client's
                # models cost ~1 ms of CPU per pod to build and turn back into dicts.
                _preload_content=False,
            ),
        )  # fmt: skip
        try:
            items = json.loads(found.data).get("items") or []
        except (ValueError, AttributeError) as exc:
            raise ClusterError(f"list pods in namespace {ns!r}: not a pod list: {exc}") from None
        pods = [p for p in items if isinstance(p, dict) and isinstance(p.get("metadata"), dict)]
        # Filter again: the selector is the server's job, but a pod of another job
        # must never be reported under this one.
        pods = [p for p in pods if (p["metadata"].get("labels") or {}).get(kind.pod_label) == name]
        return sorted(pods, key=kind.pod_order)

    def logs(self, ref: JobRef, tail: int | None = None) -> str:
        ns, name = _where(ref)
        kind = kind_of(ref)
        core = self._core()
        pods = self.pods(ref)
        if not pods:
            return f"(no pods of {kind.kind} {name} in namespace {ns} yet)\n"
        out: list[str] = []
        for pod in pods:
            pod_name = pod["metadata"]["name"]
            out.append(f"==> {pod_name} ({kind.role(pod)}) <==\n")
            try:
                text = self._call(
                    "get",
                    "pods/log",
                    ns,
                    lambda pod_name=pod_name: core.read_namespaced_pod_log(
                        pod_name,
                        ns,
                        container=kind.container,
                        tail_lines=tail,
                        _request_timeout=REQUEST_TIMEOUT_S,
                    ),
                    bad_request_ok=True,
                )
            except _BadRequest as exc:  # e.g. the container is still being created
                text = f"(no log yet: {exc})\n"
            else:
                # The launcher's own report of a run that stopped becomes one line that
                # says where the whole of it is (the pod's log keeps it).
                text = readable(text or "", _full_log(ns, pod_name, kind.container))
            if text and not text.endswith("\n"):
                text += "\n"
            out.append(text or "")
        return "".join(out)

    def has_ended(self, ref: JobRef, st: JobStatus) -> bool:
        return st.state.is_terminal or st.native_state == "NotFound"

    def procs_per_node(self, ref: JobRef) -> int | None:
        ns, name = _where(ref)
        kind = kind_of(ref)
        try:
            return kind.procs_per_node(self._get_job(kind, self._custom(), ns, name))
        except JobNotFoundError:
            return None

    def follow_logs(
        self,
        ref: JobRef,
        write: Callable[[str], None],
        *,
        node: int | None = None,
        tail: int | None = None,
        poll_s: float | None = None,
        streams: int = LOG_STREAMS,
    ) -> None:
        """`logs -f`: the training container of every pod, streamed (`follow=True`), each
        line prefixed `[pod/NAME/CONTAINER]` like `kubectl logs --prefix`. At most
        `streams` streams (threads, connections) are open at once; a wider job's pods
        take turns (logstreams.py). Pods that appear later (a restart, a recreated pod)
        join; one status and one pod list per tick; the command ends when the job has
        ended and the streams drained (at most STREAM_DRAIN_S)."""
        ns, _ = _where(ref)
        kind = kind_of(ref)
        core = self._core()
        lock = threading.Lock()
        wait = self.poll_s if poll_s is None else poll_s

        def emit(text: str) -> None:
            with lock:
                write(text)

        def open_stream(log: PodLog, since_s: int | None, read_timeout: float | None) -> Any:
            def read() -> Any:
                try:
                    return core.read_namespaced_pod_log(
                        log.pod, ns, container=kind.container, follow=True,
                        tail_lines=log.tail if since_s is None else None,
                        since_seconds=since_s, timestamps=True if log.resumable else None,
                        _preload_content=False,
                        _request_timeout=(
                            None if read_timeout is None else (REQUEST_TIMEOUT_S, read_timeout)
                        ),
                    )  # fmt: skip
                except _urllib3_errors() as exc:
                    # A resumable stream's answer did not start within its turn (a slow
                    # server): its turn again later, rather than "cannot reach".
                    if _timed_out(exc):
                        raise LogNotReady(str(exc)) from None
                    raise

            try:
                return self._call("get", "pods/log", ns, read, bad_request_ok=True)
            except _BadRequest as exc:  # the container is still being created
                raise LogNotReady(str(exc)) from None

        pool = LogStreams(open_stream, emit, streams=streams, retry_s=self.poll_s)
        seen: set[tuple[str, int]] = set()
        while True:
            ended = self.has_ended(ref, self.status(ref))
            listed = [p for p in self.pods(ref) if node is None or kind.node(p) == node]
            # Decided per pod when it is first seen: a pod of a job wider than the pool
            # is streamed with timestamps so that it can give its stream up and resume.
            wide = len(listed) > streams
            for pod in listed:
                key = (str(pod["metadata"].get("uid") or pod["metadata"]["name"]),
                       _restarts(pod, kind.container))  # fmt: skip
                if key in seen:
                    continue
                seen.add(key)
                name = pod["metadata"]["name"]
                pool.add(
                    PodLog(
                        pod=name,
                        prefix=f"[pod/{name}/{kind.container}] ",
                        report=LauncherReport(_full_log(ns, name, kind.container)),
                        resumable=wide,
                        tail=tail,
                    )
                )
            if ended:
                break
            time.sleep(wait)
        pool.drain(STREAM_DRAIN_S)

    def cancel(self, ref: JobRef) -> None:
        ns, name = _where(ref)
        self._delete_everything(kind_of(ref), ns, name, wait=False, missing_ok=False)

    # ---------------------------------------------------------------- helpers

    def _delete_everything(
        self, kind: JobKind, ns: str, name: str, wait: bool, missing_ok: bool = True
    ) -> None:
        """Delete the job (its pods first: Foreground) and its ConfigMap."""
        custom, core = self._custom(), self._core()
        try:
            self._job_call(
                "delete",
                kind,
                ns,
                custom.delete_namespaced_custom_object,
                name,
                options={"propagation_policy": "Foreground"},
                not_found=f"no {kind.kind} {name} in namespace {ns} (already deleted or never "
                "created)",
            )
        except JobNotFoundError:
            if not missing_ok:
                raise
        self._delete_configmap(core, ns, configmap_name(name))
        if wait:
            # Foreground deletion keeps the job visible until its pods are gone;
            # a new job of the same name can only be created after that.
            deadline = time.monotonic() + REPLACE_TIMEOUT_S
            while self._job_exists(kind, custom, ns, name):
                if time.monotonic() >= deadline:
                    raise ClusterError(
                        f"{kind.kind} {ns}/{name} is still being deleted after "
                        f"{REPLACE_TIMEOUT_S:g} s; try again when "
                        f"`kubectl -n {ns} get {kind.kind.lower()} {name}` finds nothing"
                    )
                time.sleep(1.0)

    def _delete_configmap(self, core: Any, ns: str, cm_name: str) -> None:
        """Delete a ConfigMap; one that is already gone is fine."""
        self._ignore_missing(
            lambda: self._call(
                "delete",
                "configmaps",
                ns,
                lambda: core.delete_namespaced_config_map(
                    cm_name, ns, _request_timeout=REQUEST_TIMEOUT_S
                ),
            )
        )

    def _get_job(self, kind: JobKind, custom: Any, ns: str, name: str) -> dict[str, Any]:
        return self._job_call(
            "get",
            kind,
            ns,
            custom.get_namespaced_custom_object,
            name,
            not_found=f"no {kind.kind} {name} in namespace {ns}",
        )

    @staticmethod
    def _ignore_missing(fn: Callable[[], Any]) -> None:
        with contextlib.suppress(JobNotFoundError):  # what `_call` makes of a 404
            fn()

    def _job_call(
        self,
        verb: str,
        kind: JobKind,
        ns: str,
        method: Callable[..., T],
        *args: Any,
        options: dict[str, Any] | None = None,
        not_found: str | None = None,
        conflict: str | None = None,
        rejected: Callable[[str], str | None] | None = None,
    ) -> T:
        """One `CustomObjectsApi.*_namespaced_custom_object` call on `kind`'s objects in
        `ns`: the client wants group, version, namespace and plural first, then `args`
        (the body or the name), then `options`; `_call` says what a failure means."""
        return self._call(
            verb,
            kind.plural,
            ns,
            lambda: method(
                kind.group,
                kind.version,
                ns,
                kind.plural,
                *args,
                **(options or {}),
                _request_timeout=REQUEST_TIMEOUT_S,
            ),
            not_found=not_found,
            conflict=conflict,
            rejected=rejected,
        )

    def _call(
        self,
        verb: str,
        resource: str,
        ns: str,
        fn: Callable[[], T],
        not_found: str | None = None,
        conflict: str | None = None,
        bad_request_ok: bool = False,
        rejected: Callable[[str], str | None] | None = None,
    ) -> T:
        """Run one API call; turn the client's exceptions into messages that say what to do."""
        ApiException = kubernetes_module("kubernetes.client.exceptions").ApiException

        try:
            return fn()
        except ApiException as exc:
            reason = _server_message(exc)
            better = rejected(reason) if rejected is not None else None
            if better:  # an admission webhook said why, in its own words
                raise ClusterError(better) from None
            if exc.status == 404:
                raise JobNotFoundError(not_found or f"{resource} not found: {reason}") from None
            if exc.status == 409:
                if conflict is None:
                    raise _Conflict(reason) from None
                raise ClusterError(conflict) from None
            if exc.status == 403:
                raise ClusterError(
                    f"forbidden: the credentials in use may not {verb!r} {resource!r} in "
                    f"namespace {ns!r} (the RBAC rule missing: verb {verb}, resource "
                    f"{resource}); {rbac_hint()}. Server said: {reason}"
                ) from None
            if exc.status == 401:
                raise ClusterError(
                    f"unauthorized: the API server rejected the credentials of the kubeconfig "
                    f"({reason}); refresh them (e.g. log in again) or set SHARDCTL_KUBECONFIG"
                ) from None
            if exc.status == 400 and bad_request_ok:
                raise _BadRequest(reason) from None
            if exc.status == 422:
                raise ClusterError(f"the API server rejected the {resource}: {reason}") from None
            raise ClusterError(
                f"{verb} {resource} in namespace {ns!r} failed: HTTP {exc.status} {reason}"
            ) from None
        except (OSError, _urllib3_errors()) as exc:
            host = getattr(getattr(self._api(), "configuration", None), "host", "?")
            raise ClusterError(f"cannot reach the Kubernetes API server at {host}: {exc}") from None

    # The client is built on first use, so dryrun never touches kubeconfig or network.
    def _api(self) -> Any:
        if self._api_client is None:
            self._api_client = load_api_client()
        return self._api_client

    def _custom(self) -> Any:
        return kubernetes_module("kubernetes.client").CustomObjectsApi(self._api())

    def _core(self) -> Any:
        return kubernetes_module("kubernetes.client").CoreV1Api(self._api())


class _Conflict(ClusterError):
    """409 where the caller decides what it means."""


class _BadRequest(ClusterError):
    """400 where the caller has a better message (a log that does not exist yet)."""


def _urllib3_errors() -> type[Exception]:
    import urllib3.exceptions

    return urllib3.exceptions.HTTPError


def _timed_out(exc: Exception) -> bool:
    """A read timeout of urllib3, retried or not."""
    import urllib3.exceptions

    errors = urllib3.exceptions
    reason = getattr(exc, "reason", None) if isinstance(exc, errors.MaxRetryError) else exc
    return isinstance(reason, errors.ReadTimeoutError)


def _restarts(pod: dict[str, Any], container: str) -> int:
    """How often the training container of a pod restarted (a new log each time)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container:
            return int(cs.get("restartCount") or 0)
    return 0


def _full_log(ns: str, pod: str, container: str) -> str:
    """Where a pod's whole log is, for the launcher report's one line."""
    return f"the pod's log (kubectl logs -n {ns} {pod} -c {container})"


def _where_new(dryrun: DryRun, kind: JobKind) -> tuple[str, str]:
    """The namespace and name of the job a dry run would create."""
    meta = dryrun.request[kind.api]["metadata"]
    return meta["namespace"], meta["name"]


def _spec_from_text(text: Any) -> JobSpec | None:
    """A job.yaml as the pods read it; None when it is missing or no longer reads (a
    spec another version wrote): then nothing is known finished."""
    from ...errors import ShardctlError
    from ...spec import parse_spec
    from ...yamlio import parse_yaml_text

    if not isinstance(text, str):
        return None
    try:
        return parse_spec(parse_yaml_text(text, SPEC_FILE, written=True), SPEC_FILE)
    except ShardctlError:
        return None


def _where(ref: JobRef) -> tuple[str, str]:
    ns = ref.extra.get("namespace")
    name = ref.extra.get("job")
    if not ns or not name:
        ns, _, name = ref.job_id.partition("/")
    return ns, name


def _exists_message(kind: JobKind, ns: str, name: str) -> str:
    return (
        f"a {kind.kind} named {name!r} already exists in namespace {ns!r}; replace it with "
        f"`shardctl submit SPEC --cluster k8s --replace` (deletes it and its pods first; "
        f"checkpoints on the PVC stay and the new job resumes from them), or rename the job "
        f"(the spec's name)"
    )


def _server_message(exc: Any) -> str:
    """The `message` of the API server's Status body, else the HTTP reason."""
    try:
        body = json.loads(exc.body or "{}")
        if isinstance(body, dict) and body.get("message"):
            return str(body["message"])
    except (TypeError, ValueError):
        pass
    return str(exc.reason or exc.status)


def kubernetes_module(name: str) -> Any:
    """A module of the kubernetes client (an optional extra), or the error naming it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise MissingDependencyError("kubernetes", "k8s", "--cluster k8s") from None


def load_api_client() -> Any:
    """An ApiClient from the kubeconfig (or in-cluster config), never touching globals."""
    client = kubernetes_module("kubernetes.client")
    config = kubernetes_module("kubernetes.config")
    import yaml
    from kubernetes.config.config_exception import ConfigException

    # Read KUBECONFIG now: the client captures it once, when it is first imported.
    # (A `a:b` list is merged by the client like kubectl does.)
    config_file = os.environ.get("SHARDCTL_KUBECONFIG") or os.environ.get("KUBECONFIG") or None
    context = os.environ.get("SHARDCTL_KUBE_CONTEXT") or None
    kubeconfig_known = bool(config_file) or os.path.exists(os.path.expanduser("~/.kube/config"))
    configuration = client.Configuration()
    # Room in urllib3's pool for every log stream of `logs -f` and the status and list
    # calls beside them (the default, 5 per CPU, is 10 on a 2-core laptop): a connection
    # handed back to a full pool is closed, and the next request opens a new one.
    configuration.connection_pool_maxsize = max(
        configuration.connection_pool_maxsize or 0, LOG_STREAMS + 4
    )
    if not kubeconfig_known and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException as exc:
            raise ClusterError(f"in-cluster Kubernetes config is unusable: {exc}") from None
        return client.ApiClient(configuration)
    missing = _missing_kubeconfig(config_file)
    if missing is not None:
        raise ClusterError(missing)
    try:
        return config.new_client_from_config(
            config_file=config_file, context=context, client_configuration=configuration
        )
    except (ConfigException, OSError) as exc:
        raise _kubeconfig_error(config_file, str(exc)) from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise _kubeconfig_error(config_file, f"not a YAML text file: {_one_line(exc)}") from None
    except (TypeError, AttributeError, KeyError, ValueError) as exc:
        # The client indexes the parsed YAML as it expects it: garbage that is valid
        # YAML (a list, a bare word) surfaces here as a lookup error.
        # Python's own words for a lookup ("'str' object does not support item
        # assignment") say nothing to the user; a missing key does.
        missing = f": no {_one_line(exc)}" if isinstance(exc, KeyError) else ""
        raise _kubeconfig_error(
            config_file, f"not a kubeconfig (a mapping with clusters, users and contexts){missing}"
        ) from None


def _missing_kubeconfig(config_file: str | None) -> str | None:
    """The line that says no kubeconfig exists where one was looked for (the client
    would call it "invalid"), or None when one of them exists."""
    named = "SHARDCTL_KUBECONFIG" if os.environ.get("SHARDCTL_KUBECONFIG") else "KUBECONFIG"
    paths = [p for p in (config_file or "").split(os.pathsep) if p] or ["~/.kube/config"]
    if any(os.path.lexists(os.path.expanduser(p)) for p in paths):
        return None
    where = (
        f"{named}={config_file}, and {' nor '.join(paths)} does not exist"
        if config_file
        else "~/.kube/config, the default, does not exist and neither SHARDCTL_KUBECONFIG "
        "nor KUBECONFIG is set"
    )
    return (
        f"no kubeconfig: shardctl looks for it in SHARDCTL_KUBECONFIG, else KUBECONFIG, else "
        f"~/.kube/config; here {where}. Point KUBECONFIG (or SHARDCTL_KUBECONFIG) at your "
        "cluster's kubeconfig (the file kubectl uses; your cluster's admin or cloud CLI "
        "writes one, e.g. `aws eks update-kubeconfig`, `gcloud container clusters "
        "get-credentials`), or run inside the cluster"
    )


def _kubeconfig_error(config_file: str | None, why: str) -> ClusterError:
    where = config_file or "~/.kube/config"
    return ClusterError(
        f"no usable kubeconfig ({where}): {why}; point KUBECONFIG or SHARDCTL_KUBECONFIG "
        "at one (and SHARDCTL_KUBE_CONTEXT at its context), or run inside the cluster"
    )


def _one_line(exc: BaseException) -> str:
    """An exception's text on one line (a YAML error spans several)."""
    return " ".join(str(exc).split()) or type(exc).__name__
