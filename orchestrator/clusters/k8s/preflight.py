"""`shardctl doctor --cluster k8s`: through the API, the operator's CRD, a TrainJob's
runtime, the service account and the PVC."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...doctor import Check
from ...errors import ClusterError, JobNotFoundError
from ...spec import JobSpec
from ...storage import is_object_url
from .apis import job_kind

if TYPE_CHECKING:
    from . import K8sCluster


def k8s_checks(spec: JobSpec, backend: K8sCluster) -> list[Check]:
    """`backend` is the cluster `doctor` runs for (its API client, its calls)."""
    k = spec.k8s
    checks = [
        Check(
            "master address",
            "ok",
            "the operator's headless service name, resolved inside the cluster",
        )
    ]
    try:
        core, custom = backend._core(), backend._custom()
    except ClusterError as exc:
        return [*checks, Check("cluster", "skip", str(exc))]

    def probe(
        name: str, call: Any, ok: str | Callable[[Any], str], missing: str, fix: str
    ) -> Check:
        try:
            found = call()
        except JobNotFoundError:
            return Check(name, "fail", missing, fix)
        except ClusterError as exc:
            return Check(name, "skip", str(exc))
        return Check(name, "ok", ok if not callable(ok) else ok(found))

    ns = k.namespace
    kind = job_kind(k.api)
    group, version, plural, hint = kind.group, kind.version, kind.plural, kind.install_hint
    checks.append(
        probe(
            "operator",
            lambda: backend._call(
                "list",
                plural,
                ns,
                lambda: custom.list_namespaced_custom_object(
                    group, version, ns, plural, limit=1, _request_timeout=30
                ),
            ),
            f"the cluster serves {plural}.{group}/{version}",
            f"the cluster does not serve {plural}.{group}/{version}",
            hint,
        )
    )
    need = kind.prerequisite(spec)
    if need is not None:
        try:
            backend._check_prerequisite(custom, need, ns)
            checks.append(Check(need.what, "ok", f"{need.kind} {need.name} exists"))
        except ClusterError as exc:
            checks.append(
                Check(need.what, "fail", str(exc).split(";")[0], str(exc).split("; ", 1)[-1])
            )
    checks.append(
        probe(
            "service account",
            lambda: backend._call(
                "get",
                "serviceaccounts",
                ns,
                lambda: core.read_namespaced_service_account(
                    k.service_account, ns, _request_timeout=30
                ),
            ),
            f"{ns}/{k.service_account} exists",
            f"no service account {k.service_account!r} in namespace {ns!r}",
            "kubectl apply -f the serviceaccount.yaml of the manifests `shardctl --version` lists",
        )
    )
    if k.pvc is None and is_object_url(spec.checkpoint_dir):
        # Each pod uploads its own ranks' files from its emptyDir: no shared volume.
        each = " (each pod's own)" if spec.resources.nodes > 1 else ""
        checks.append(
            Check(
                "checkpoint dir",
                "ok",
                f"checkpoints in {spec.checkpoint_dir}; no k8s.pvc: the run dir's logs and "
                f"markers live in the pod{each} (k8s.env_from_secrets gives the S3 credentials)",
            )
        )
        return checks
    if k.pvc is None:
        checks.append(
            Check(
                "checkpoint dir",
                "warn" if spec.resources.nodes == 1 else "fail",
                "no k8s.pvc: checkpoints live in the pod and die with it",
                "set k8s.pvc to a ReadWriteMany PersistentVolumeClaim, or checkpoint.dir "
                "to an s3:// URL",
            )
        )
        return checks

    def pvc_detail(found: Any) -> str:
        modes = list(getattr(getattr(found, "spec", None), "access_modes", None) or [])
        return f"PVC {k.pvc} exists ({', '.join(modes) or 'no access modes'})"

    pvc = probe(
        "checkpoint dir",
        lambda: backend._call(
            "get",
            "persistentvolumeclaims",
            ns,
            lambda: core.read_namespaced_persistent_volume_claim(k.pvc, ns, _request_timeout=30),
        ),
        pvc_detail,
        f"no PersistentVolumeClaim {k.pvc!r} in namespace {ns!r}",
        "create it (the pvc.yaml of the manifests `shardctl --version` lists is an example)",
    )
    if pvc.status == "ok" and spec.resources.nodes > 1 and "ReadWriteMany" not in pvc.detail:
        pvc = Check(
            "checkpoint dir",
            "fail",
            pvc.detail + f": {spec.resources.nodes} pods on different nodes cannot all mount it",
            "use a ReadWriteMany claim (NFS, CephFS, a cloud file store)",
        )
    checks.append(pvc)
    return checks
