"""The PyTorchJob and ConfigMap renderer (orchestrator/clusters/k8s/).

Every rendered object is validated: the PyTorchJob against the training
operator's CRD schema (strict), each pod template and the ConfigMap against
kubernetes-validate.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest
import yaml
from helpers.k8s_schemas import validate_core, validate_pytorchjob, validate_trainer_object
from helpers.render_util import LAUNCH_WRAPPER
from shardctl.orchestrator.clusters.k8s import objects as render_k8s
from shardctl.orchestrator.clusters.k8s import pods
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.spec import JobSpec, load_spec, parse_spec

BASE: dict[str, Any] = {
    "name": "k8s-test",
    "resources": {"nodes": 2, "procs_per_node": 2, "device": "cpu"},
    "train": {
        "model": {"llama": {"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 1}},
        "data": {"builtin": "python-stdlib"},
        "steps": 4,
    },
    "checkpoint": {"every_steps": 2, "dir": "/somewhere/on/my/laptop/ckpt"},
    "k8s": {"namespace": "ml", "image": "registry.example/shardctl:1", "pvc": "runs"},
}


def make(**overrides: Any) -> JobSpec:
    data = copy.deepcopy(BASE)
    for dotted, value in overrides.items():
        node = data
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return parse_spec(data)


def container(job: dict[str, Any], replica: str = "Master") -> dict[str, Any]:
    return job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]


def pod(job: dict[str, Any], replica: str = "Master") -> dict[str, Any]:
    return job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]


VARIANTS = {
    "two-nodes-cpu": {},
    "one-node": {"resources__nodes": 1},
    # Checkpoints in a bucket: no PVC, the S3 credentials from a named Secret.
    "s3-one-node-no-pvc": {
        "resources__nodes": 1,
        "checkpoint__dir": "s3://team-ckpt/runs/k8s-test",
        "k8s__pvc": None,
        "k8s__env_from_secrets": ["s3-credentials"],
    },
    "s3-two-nodes-no-pvc": {
        "checkpoint__dir": "s3://team-ckpt/runs/k8s-test",
        "k8s__pvc": None,
        "k8s__env_from_secrets": ["s3-credentials"],
    },
    "cuda-elastic-everything": {
        "resources__device": "cuda",
        "resources__procs_per_node": 8,
        "resources__nodes": 3,
        "resources__memory": "500G",
        "k8s__elastic": {"min_nodes": 2, "max_nodes": 4, "max_restarts": 2},
        "k8s__node_selector": {"nvidia.com/gpu.product": "H100"},
        "k8s__tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "spot", "value": "yes", "effect": "NoExecute", "tolerationSeconds": 60},
        ],
        "k8s__priority_class": "training-high",
        "k8s__image_pull_secrets": ["regcred"],
        "k8s__env_from_config_maps": ["team-env"],
        "k8s__env_from_secrets": ["wandb-key"],
        "k8s__restart_policy": "OnFailure",  # not the default: the chart must carry it
        "k8s__ttl_seconds_after_finished": 0,
        "k8s__active_deadline_seconds": 172800,
        "k8s__suspend": True,
        "k8s__clean_pod_policy": "All",
    },
    "hostile-strings": {
        "env": {"WEIRD": 'it\'s "$(rm -rf /)" `id`\n  indented: {x} # ü ☃', "EMPTY": ""},
        "k8s__node_selector": {"example.com/pool": "a: b # 'c' \"d\""},
        "train__data": {"text": "/data/my corpus/it's here.txt"},
    },
    "no-pvc-one-node-writable-root": {
        "resources__nodes": 1,
        "k8s__pvc": None,
        "k8s__read_only_root_filesystem": False,
    },
    # What k8s users ask for: Kueue's queue label, a gang scheduler, affinity, volumes,
    # AMD GPUs, a longer grace period for large saves, setup lines.
    "queue-scheduler-affinity-volumes-amd": {
        "resources__device": "cuda",
        "resources__procs_per_node": 8,
        "k8s__gpu_resource": "amd.com/gpu",
        "k8s__labels": {"kueue.x-k8s.io/queue-name": "team-a", "team": "nlp"},
        "k8s__annotations": {"example.com/owner": 'it\'s me: "quoted" # not a comment'},
        "k8s__scheduler_name": "volcano",
        "k8s__affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "gpu", "operator": "In", "values": ["mi300x"]}
                            ]
                        }
                    ]
                }
            },
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 50,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app": "other"}},
                        },
                    }
                ]
            },
        },
        "k8s__volumes": [
            {"name": "datasets", "mount_path": "/data", "pvc": "datasets", "read_only": True},
            {"name": "hf-token", "mount_path": "/secrets/hf", "secret": "hf-token"},
            {"name": "scratch", "mount_path": "/scratch", "empty_dir": True},
            {"name": "nfs-models", "mount_path": "/models", "nfs": "nfs.example:/export/models"},
            {"name": "local-cache", "mount_path": "/cache", "host_path": "/mnt/nvme/cache"},
            {"name": "conf", "mount_path": "/conf", "config_map": "team-conf", "sub_path": "a/b"},
        ],
        "k8s__termination_grace_s": 900,
        "k8s__setup": ["python -m pip install --user 'shardctl[train]'", "echo ready"],
    },
    "accelerate-deepspeed": {
        "launcher": "accelerate",
        "strategy": {"backend": "deepspeed", "zero_stage": 2},
    },
    "deepspeed-launcher-cuda": {
        "launcher": "deepspeed",
        "resources__device": "cuda",
        "strategy": {"backend": "deepspeed", "zero_stage": 3},
    },
}


# The same pods as a Kubeflow Trainer v2 TrainJob (k8s.api: trainjob).
TRAINJOB_VARIANTS: dict[str, dict[str, Any]] = {
    "trainjob-two-nodes": {"k8s__api": "trainjob"},
    # envFrom reaches a TrainJob's pods through a runtime of shardctl's own.
    "trainjob-s3-one-node-no-pvc": {
        **VARIANTS["s3-one-node-no-pvc"],
        "k8s__api": "trainjob",
        "k8s__runtime": "shardctl-torch",
    },
    "trainjob-s3-two-nodes-no-pvc": {
        **VARIANTS["s3-two-nodes-no-pvc"],
        "k8s__api": "trainjob",
        "k8s__runtime": "shardctl-torch",
    },
    "trainjob-one-node-no-pvc-suspended-deadline": {
        "k8s__api": "trainjob",
        "resources__nodes": 1,
        "k8s__pvc": None,
        "k8s__suspend": True,
        "k8s__active_deadline_seconds": 3600,
    },
    "trainjob-hostile-strings": {**VARIANTS["hostile-strings"], "k8s__api": "trainjob"},
    "trainjob-queue-scheduler-affinity-volumes-amd": {
        **VARIANTS["queue-scheduler-affinity-volumes-amd"],
        "k8s__api": "trainjob",
        # schedulerName is for the runtime: a stock one cannot carry it.
        "k8s__runtime": "shardctl-torch",
    },
    "trainjob-namespaced-runtime-everything": {
        "k8s__api": "trainjob",
        "k8s__runtime": "team-torch",
        "k8s__runtime_kind": "TrainingRuntime",
        "k8s__priority_class": "training-high",
        "k8s__env_from_config_maps": ["team-env"],
        "k8s__env_from_secrets": ["wandb-key"],
        "k8s__image_pull_policy": "Always",
        "k8s__image_pull_secrets": ["regcred"],
        "k8s__backoff_limit": 2,
        "k8s__node_selector": {"pool": "train"},
        "k8s__tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "trainjob-deepspeed-launcher-cuda": {
        **VARIANTS["deepspeed-launcher-cuda"],
        "k8s__api": "trainjob",
    },
}


@pytest.fixture(params=sorted(VARIANTS), name="variant")
def _variant(request: pytest.FixtureRequest) -> JobSpec:
    return make(**VARIANTS[request.param])


def test_every_variant_validates_against_crd_and_core_schemas(variant: JobSpec) -> None:
    objects = render_k8s.k8s_objects(variant)
    validate_pytorchjob(objects["pytorchjob"])
    validate_core(objects["configmap"])


def test_crd_validation_is_strict_about_misspelt_keys() -> None:
    job = render_k8s.pytorchjob(make())
    job["spec"]["runPolicy"]["backofLimit"] = 3
    with pytest.raises(AssertionError, match="backofLimit"):
        validate_pytorchjob(job)


def test_master_and_workers() -> None:
    job = render_k8s.pytorchjob(make(resources__nodes=4))
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    assert replicas["Worker"]["replicas"] == 3
    assert job["spec"]["nprocPerNode"] == "2"
    assert (
        "Worker"
        not in render_k8s.pytorchjob(make(resources__nodes=1))["spec"]["pytorchReplicaSpecs"]
    )
    # The two templates are equal but independent objects.
    assert replicas["Master"]["template"] == replicas["Worker"]["template"]
    container(job)["image"] = "changed"
    assert container(job, "Worker")["image"] == "registry.example/shardctl:1"


def test_container_runs_the_launch_script_with_operator_rank_removed() -> None:
    spec = make()
    objects = render_k8s.k8s_objects(spec)
    c = container(objects["pytorchjob"])
    # RANK/WORLD_SIZE from the operator are node-level; they must not reach torchrun.
    assert c["command"] == [
        "env", "-u", "RANK", "-u", "WORLD_SIZE", "bash", "/etc/shardctl/launch.sh",
    ]  # fmt: skip
    script = objects["configmap"]["data"]["launch.sh"]
    for var in ("PET_NODE_RANK", "PET_NNODES", "PET_NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT"):
        assert "${" + var in script
    assert "/etc/shardctl/job.yaml" in script
    assert c["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]


def test_launch_script_runs_with_operator_env(tmp_path: Any) -> None:
    """Execute the rendered command line as the pod would, with torchrun replaced by echo."""
    objects = render_k8s.k8s_objects(make())
    folder = tmp_path / "etc"
    folder.mkdir()
    for name, text in objects["configmap"]["data"].items():
        # Without the node agent above the launcher: it puts its own interpreter's
        # launchers first on PATH, the real torchrun (the agent's own tests:
        # test_k8s_policy.py, test_k8s_pods.py).
        agent = (
            f'"${{SHARDCTL_PYTHON:-python3}}" -m {render_k8s.NODE_AGENT_MODULE} --watch-hangs '
            "-- \\\n    "
        )
        assert name != "launch.sh" or agent in text
        (folder / name).write_text(text.replace(agent, ""))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text('#!/usr/bin/env bash\necho "RANK=${RANK:-unset} WS=${WORLD_SIZE:-unset} $*"\n')
    fake.chmod(0o755)
    command = container(objects["pytorchjob"])["command"]
    command = [w.replace("/etc/shardctl", str(folder)) for w in command]
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SHARDCTL_PYTHON": sys.executable,
        "RANK": "1",
        "WORLD_SIZE": "2",
        "PET_NODE_RANK": "1",
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "2",
        "MASTER_ADDR": "k8s-test-master-0",
        "MASTER_PORT": "23456",
    }
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("RANK=unset WS=unset ")
    # The operator's values reach torchrun (node count, the master's rendezvous address).
    assert "--nnodes 2 " in out.stdout
    assert "--rdzv-endpoint k8s-test-master-0:23456" in out.stdout


def test_checkpoints_live_on_the_pvc() -> None:
    spec = make()
    objects = render_k8s.k8s_objects(spec)
    inside = yaml.safe_load(objects["configmap"]["data"]["job.yaml"])
    assert inside["checkpoint"]["dir"] == "/shardctl/runs/k8s-test/checkpoints"
    assert inside["run_dir"] == "/shardctl/runs/k8s-test"
    # Everything else is the user's spec, unchanged.
    mine = {"checkpoint": spec.checkpoint, "run_dir": spec.run_dir}
    assert parse_spec(inside).model_copy(update=mine) == spec
    p = pod(objects["pytorchjob"])
    runs = next(v for v in p["volumes"] if v["name"] == "runs")
    assert runs["persistentVolumeClaim"] == {"claimName": "runs"}
    mounts = {m["name"]: m for m in container(objects["pytorchjob"])["volumeMounts"]}
    assert mounts["runs"]["mountPath"] == "/shardctl/runs"
    assert mounts["spec"] == {"name": "spec", "mountPath": "/etc/shardctl", "readOnly": True}
    without = pod(render_k8s.pytorchjob(make(k8s__pvc=None, resources__nodes=1)))
    assert next(v for v in without["volumes"] if v["name"] == "runs") == {
        "name": "runs",
        "emptyDir": {},
    }


def test_secure_by_default() -> None:
    job = render_k8s.pytorchjob(make())
    p, c = pod(job), container(job)
    assert p["securityContext"]["runAsNonRoot"] is True
    assert p["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert p["automountServiceAccountToken"] is False
    assert p["serviceAccountName"] == "shardctl-trainer"
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    # With a read-only root, every place a rank writes is a volume.
    mounted = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/tmp", "/dev/shm", "/shardctl/cache", "/shardctl/runs"} <= mounted
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["HOME"].startswith("/shardctl/cache")
    assert env["TRITON_CACHE_DIR"].startswith("/shardctl/cache")
    shm = next(v for v in p["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}


def test_resources_gpus_and_memory() -> None:
    job = render_k8s.pytorchjob(
        make(
            resources__device="cuda",
            resources__procs_per_node=4,
            resources__memory="64G",
            resources__cpus_per_proc=3,
        )
    )
    res = container(job)["resources"]
    assert res["limits"] == {"cpu": "12", "memory": "64Gi", "nvidia.com/gpu": "4"}
    assert res["requests"] == res["limits"]
    cpu_only = container(render_k8s.pytorchjob(make(k8s__cpu="1500m")))["resources"]
    assert cpu_only["limits"] == {"cpu": "1500m"}


@pytest.mark.parametrize(
    ("given", "quantity"),
    [("64G", "64Gi"), ("512M", "512Mi"), ("4096", "4096Mi"), ("2T", "2Ti"), ("8Gi", "8Gi")],
)
def test_memory_quantity(given: str, quantity: str) -> None:
    res = container(render_k8s.pytorchjob(make(resources__memory=given)))["resources"]
    assert res["limits"]["memory"] == quantity


def test_scheduling_and_env_refs_never_inline_secrets() -> None:
    spec = make(**VARIANTS["cuda-elastic-everything"])
    job = render_k8s.pytorchjob(spec)
    p, c = pod(job), container(job)
    assert p["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert p["tolerations"][1] == {
        "key": "spot",
        "operator": "Equal",
        "value": "yes",
        "effect": "NoExecute",
        "tolerationSeconds": 60,
    }
    assert p["priorityClassName"] == "training-high"
    assert p["imagePullSecrets"] == [{"name": "regcred"}]
    assert c["envFrom"] == [
        {"configMapRef": {"name": "team-env"}},
        {"secretRef": {"name": "wandb-key"}},
    ]
    assert job["spec"]["elasticPolicy"] == {
        "minReplicas": 2,
        "maxReplicas": 4,
        "maxRestarts": 2,
        "rdzvBackend": "c10d",
    }
    assert job["spec"]["runPolicy"] == {
        "backoffLimit": 6,
        "cleanPodPolicy": "All",
        "suspend": True,
        "ttlSecondsAfterFinished": 0,
        "activeDeadlineSeconds": 172800,
    }
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "OnFailure"


def test_launcher_files_travel_in_the_configmap() -> None:
    acc = render_k8s.configmap(make(**VARIANTS["accelerate-deepspeed"]))["data"]
    assert {"accelerate_config.yaml", "ds_config.json"} <= set(acc)
    assert "/etc/shardctl/accelerate_config.yaml" in acc["launch.sh"] or (
        "${SHARDCTL_RENDER_DIR}" in acc["launch.sh"]
    )
    ds = render_k8s.configmap(make(**VARIANTS["deepspeed-launcher-cuda"]))["data"]
    assert "hostfile" in ds
    plain = render_k8s.configmap(make())["data"]
    assert set(plain) == {"job.yaml", "launch.sh"}


@pytest.mark.parametrize("variant_name", ["accelerate-deepspeed", "deepspeed-launcher-cuda"])
def test_pods_get_the_files_shardctl_render_writes(variant_name: str) -> None:
    from shardctl.orchestrator.clusters import render_artifacts

    spec = make(**VARIANTS[variant_name])
    files = render_artifacts(spec, "k8s")
    data = render_k8s.configmap(spec)["data"]
    for name, text in data.items():
        assert files[name] == text, name


def test_names_are_cut_to_63() -> None:
    assert render_k8s.cut_name("a" * 70) == "a" * 63
    assert render_k8s.cut_name("a" * 62 + "-b") == "a" * 62
    longest = "x" * 50
    assert render_k8s.configmap_name(longest) == longest + "-spec"
    assert pods.DNS_LABEL_RE.match(render_k8s.configmap_name(longest))


def test_deterministic_and_sorted() -> None:
    a = render_k8s.k8s_artifacts(make())
    b = render_k8s.k8s_artifacts(make())
    assert a == b
    assert set(a) == {"pytorchjob.yaml", "configmap.yaml", "values.yaml"}
    job = yaml.safe_load(a["pytorchjob.yaml"])
    assert list(job) == sorted(job)
    assert "&id" not in a["pytorchjob.yaml"]  # no YAML anchors: readable for kubectl users
    assert yaml.safe_load(a["configmap.yaml"]) == render_k8s.configmap(make())


def test_dry_run_prints_the_manifests(tmp_path: Any) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE))
    cli = [sys.executable, "-m", "shardctl.orchestrator.cli"]
    out = subprocess.run(
        [*cli, "submit", str(path), "--cluster", "k8s", "--dry-run"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    assert docs[1] == render_k8s.pytorchjob(load_spec(path))


def test_what_k8s_users_ask_for_reaches_the_job_and_its_pods() -> None:
    objects = render_k8s.k8s_objects(make(**VARIANTS["queue-scheduler-affinity-volumes-amd"]))
    job = objects["pytorchjob"]
    for meta in (
        job["metadata"],
        job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"],
    ):
        # Kueue reads the queue from the job's labels; shardctl's own labels stay.
        assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert meta["labels"]["app.kubernetes.io/name"] == "shardctl"
        assert meta["annotations"] == {"example.com/owner": 'it\'s me: "quoted" # not a comment'}
    p, c = pod(job), container(job)
    assert p["schedulerName"] == "volcano"
    assert p["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["mi300x"]}]}
        ]
    }
    assert p["terminationGracePeriodSeconds"] == 900
    assert c["resources"]["limits"]["amd.com/gpu"] == "8"
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    volumes = {v["name"]: v for v in p["volumes"]}
    assert volumes["datasets"] == {
        "name": "datasets",
        "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True},
    }
    assert volumes["nfs-models"]["nfs"] == {
        "server": "nfs.example",
        "path": "/export/models",
        "readOnly": False,
    }
    assert volumes["hf-token"]["secret"] == {"secretName": "hf-token"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["datasets"] == {"name": "datasets", "mountPath": "/data", "readOnly": True}
    assert mounts["conf"]["subPath"] == "a/b"
    # k8s.setup runs in every pod, before the launcher.
    launch = objects["configmap"]["data"]["launch.sh"]
    assert launch.index("python -m pip install --user 'shardctl[train]'") < launch.index(
        f"{render_k8s.NODE_AGENT_MODULE} --watch-hangs -- \\\n    " + LAUNCH_WRAPPER + "torchrun"
    )


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_a_multi_node_job_without_a_shared_volume_is_refused(api: str) -> None:
    """Checkpoints on a path need one volume every pod mounts: one line naming k8s.pvc
    and what is accepted instead (tests/test_s3_k8s.py: an s3:// dir needs none)."""
    kind = {"k8s__api": api, "k8s__runtime": "shardctl-torch"} if api == "trainjob" else {}
    with pytest.raises(SpecError, match=r"k8s.pvc is required for a 2-node job") as err:
        render_k8s.k8s_objects(make(k8s__pvc=None, **kind))
    (line,) = err.value.problems
    assert "ReadWriteMany" in line and "\n" not in line
    assert "checkpoint.dir on a path" in line and "Accepted without a PVC: an s3://" in line
    # One pod: its emptyDir survives container restarts, which is all one pod needs.
    render_k8s.k8s_objects(make(k8s__pvc=None, resources__nodes=1))


def test_no_default_image_that_cannot_start() -> None:
    with pytest.raises(SpecError, match=r"k8s\.image is required") as err:
        render_k8s.k8s_objects(make(k8s__image=None))
    assert "Containerfile" in str(err.value) and "k8s.setup" in str(err.value)


@pytest.mark.parametrize(
    ("k8s", "message"),
    [
        ({"labels": {"bad key!": "x"}}, "k8s.labels: 'bad key!' is not a Kubernetes label key"),
        ({"labels": {"team": "a b"}}, "label team: 'a b' is not a label value"),
        ({"annotations": {"/x": "y"}}, "is not a Kubernetes annotation key"),
        ({"gpu_resource": "gpu"}, "k8s.gpu_resource: 'gpu' is not an extended resource name"),
        ({"scheduler_name": "Volcano"}, "k8s.scheduler_name: 'Volcano' is not a Kubernetes name"),
        ({"termination_grace_s": 5}, "k8s.termination_grace_s"),
        ({"termination_grace_s": 1e30}, "k8s.termination_grace_s"),
        (
            {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpresions": []}]}}}},
            "did you mean 'matchExpressions'",
        ),
        (
            {"affinity": {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 500, "podAffinityTerm": {"topologyKey": "zone"}}]}}},
            "weight",
        ),
        ({"volumes": [{"name": "runs", "mount_path": "/x", "empty_dir": True}]}, "shardctl mounts"),
        ({"volumes": [{"name": "a", "mount_path": "/shardctl/runs/x", "empty_dir": True}]},
         "overlaps /shardctl/runs"),
        ({"volumes": [{"name": "a", "mount_path": "rel", "empty_dir": True}]}, "absolute path"),
        ({"volumes": [{"name": "a", "mount_path": "/a"}]}, "names 0 sources"),
        ({"volumes": [{"name": "a", "mount_path": "/a", "pvc": "x", "secret": "y"}]},
         "names 2 sources (pvc, secret)"),
        ({"volumes": [{"name": "a", "mount_path": "/a", "nfs": "server-only"}]}, "NFS export"),
        ({"volumes": [{"name": "a", "mount_path": "/a", "empty_dir": True},
                      {"name": "a", "mount_path": "/b", "empty_dir": True}]}, "used twice: a"),
        ({"volumes": [{"name": "a", "mount_path": "/a", "empty_dir": True},
                      {"name": "b", "mount_path": "/a/b", "empty_dir": True}]}, "overlap"),
        ({"volumes": [{"name": "a", "mount_path": "/a", "pvc": "x", "sub_path": "../etc"}]},
         "relative path inside the volume"),
        ({"setup": ["echo a\necho b"]}, "one shell line per list item"),
    ],
)  # fmt: skip
def test_bad_k8s_settings_name_field_value_and_what_is_accepted(
    k8s: dict[str, Any], message: str
) -> None:
    data = copy.deepcopy(BASE)
    data["k8s"].update(k8s)
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    assert message in str(err.value)


# ------------------------------------------------------------------ TrainJob


def trainer(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["trainer"]


def patched_pod(job: dict[str, Any]) -> dict[str, Any]:
    (patch,) = job["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node"
    return rjob["template"]["spec"]["template"]


@pytest.mark.parametrize("case", sorted(TRAINJOB_VARIANTS))
def test_every_trainjob_and_its_runtime_validate_against_the_v2_3_crds(case: str) -> None:
    rendered = render_k8s.render(make(**TRAINJOB_VARIANTS[case]))
    assert set(rendered.objects) == {"configmap", "trainjob"}
    validate_trainer_object(rendered.objects["trainjob"])
    validate_trainer_object(rendered.runtime)
    validate_core(rendered.objects["configmap"])
    # The patched pod, merged over the stock runtime's, is a valid Pod.
    pod = patched_pod(rendered.objects["trainjob"])["spec"]
    container = {**pod["containers"][0], "image": trainer(rendered.objects["trainjob"])["image"]}
    validate_core(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
         "spec": {**pod, "containers": [container]}}
    )  # fmt: skip


def test_trainjob_carries_the_same_pods_as_the_pytorchjob() -> None:
    overrides = VARIANTS["queue-scheduler-affinity-volumes-amd"]
    v1 = render_k8s.k8s_objects(make(**overrides))["pytorchjob"]
    v2 = render_k8s.k8s_objects(make(**overrides, k8s__api="trainjob", k8s__runtime="own"))[
        "trainjob"
    ]
    pod1, pod2 = pod(v1), patched_pod(v2)["spec"]
    c1, c2 = container(v1), pod2["containers"][0]
    t = trainer(v2)
    # What the trainer block carries.
    assert t["image"] == c1["image"] and t["command"] == c1["command"]
    assert t["env"] == c1["env"]
    assert t["resourcesPerNode"] == c1["resources"]
    assert (t["numNodes"], t["numProcPerNode"]) == (2, 8)
    # What the runtime patch carries: the container named "node" of the job "node".
    assert c2["name"] == "node"
    assert c2["volumeMounts"] == c1["volumeMounts"]
    assert c2["securityContext"] == c1["securityContext"]
    for key in ("volumes", "securityContext", "affinity", "serviceAccountName",
                "terminationGracePeriodSeconds"):  # fmt: skip
        assert pod2[key] == pod1[key], key
    assert patched_pod(v2)["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert v2["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert v2["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "own",
    }


def test_trainjob_pods_read_the_torch_plugins_variables() -> None:
    spec = make(k8s__api="trainjob")
    launch = render_k8s.k8s_objects(spec)["configmap"]["data"]["launch.sh"]
    for var in ("PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR",
                "PET_MASTER_PORT"):  # fmt: skip
        assert f"${{{var}:?set by the torch plugin of Kubeflow Trainer in TrainJob pods}}" in launch
    # bash parses the script (a quote in a message once broke it).
    done = subprocess.run(["bash", "-n"], input=launch, text=True, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_the_admin_runtime_restarts_every_pod_and_carries_what_patches_cannot() -> None:
    rendered = render_k8s.render(
        make(**TRAINJOB_VARIANTS["trainjob-namespaced-runtime-everything"])
    )
    runtime = rendered.runtime
    assert runtime["kind"] == "TrainingRuntime"
    assert runtime["metadata"] == {
        "name": "team-torch",
        "namespace": "ml",
        "labels": {
            "trainer.kubeflow.org/framework": "torch",
            "app.kubernetes.io/name": "shardctl",
            "app.kubernetes.io/component": "training",
            "app.kubernetes.io/part-of": "shardctl",
        },
    }
    spec = runtime["spec"]["template"]["spec"]
    policy = spec["failurePolicy"]
    assert (policy["maxRestarts"], policy["restartStrategy"]) == (2, "Recreate")
    # Its rule for exit 78 and the other stops: tests/test_k8s_policy.py.
    (rjob,) = spec["replicatedJobs"]
    assert rjob["template"]["metadata"]["labels"] == {
        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"
    }
    assert rjob["template"]["spec"]["backoffLimit"] == 0
    pod_spec = rjob["template"]["spec"]["template"]["spec"]
    assert pod_spec["restartPolicy"] == "Never"
    assert pod_spec["priorityClassName"] == "training-high"
    assert pod_spec["automountServiceAccountToken"] is False
    (c,) = pod_spec["containers"]
    assert c["name"] == "node" and c["imagePullPolicy"] == "Always"
    assert c["envFrom"] == [
        {"configMapRef": {"name": "team-env"}},
        {"secretRef": {"name": "wandb-key"}},
    ]
    assert "trainingruntime.yaml" in rendered.files
    assert rendered.files["trainingruntime.yaml"].startswith("# A Kubeflow Trainer v2.3")
    # A stock runtime: the file is the suggestion, named shardctl-torch.
    stock = render_k8s.render(make(k8s__api="trainjob")).runtime
    assert stock["metadata"]["name"] == "shardctl-torch"
    assert stock["kind"] == "ClusterTrainingRuntime" and "namespace" not in stock["metadata"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"k8s__scheduler_name": "volcano"},
         "k8s.scheduler_name: a TrainJob cannot set schedulerName on the stock runtime "
         "'torch-distributed'"),
        ({"k8s__priority_class": "high"}, "k8s.priority_class: a TrainJob cannot set"),
        ({"k8s__env_from_secrets": ["s"]}, "k8s.env_from_secrets: a TrainJob cannot set envFrom"),
        ({"k8s__backoff_limit": 1}, "shardctl render SPEC --cluster k8s` then writes"),
        ({"k8s__runtime": "deepspeed-distributed"}, "runs the command in one launcher pod"),
        ({"name": "9lives"}, "must start with a letter"),
        ({"name": "a" * 50, "resources__nodes": 12}, "at most 47 characters"),
    ],
)  # fmt: skip
def test_trainjobs_the_runtime_cannot_run_are_refused(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpecError) as err:
        render_k8s.render(make(k8s__api="trainjob", **overrides))
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("k8s", "message"),
    [
        ({"api": "trainjob", "elastic": {"min_nodes": 1, "max_nodes": 2}},
         "elastic (Trainer v2.3 has no elastic policy in the TrainJob API)"),
        ({"api": "trainjob", "clean_pod_policy": "All"}, "clean_pod_policy"),
        ({"api": "trainjob", "restart_policy": "OnFailure"}, "JobSet failure policy"),
        ({"api": "trainjob", "master_port": 30000}, "29500"),
        ({"runtime": "torch-distributed"}, "k8s.runtime applies to k8s.api: trainjob only"),
        ({"api": "jobset"}, "k8s.api"),
    ],
)  # fmt: skip
def test_fields_of_the_other_api_are_refused_not_ignored(k8s: dict[str, Any], message: str) -> None:
    data = copy.deepcopy(BASE)
    data["k8s"].update(k8s)
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    assert message in str(err.value)
