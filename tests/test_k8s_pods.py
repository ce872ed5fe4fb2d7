"""Two PyTorchJob or TrainJob pods on this host: deleted mid-run, restarted, resumed
from the "PVC".

Each "pod" is the container command of the rendered job, run with the environment
the operator injects (PyTorchJob: PET_*, MASTER_ADDR/PORT, and the node-level
RANK/WORLD_SIZE the command must drop; TrainJob: the torch plugin's PET_* including
PET_MASTER_ADDR/PORT), with the files of the
rendered ConfigMap where the pod mounts them. Paths are the only change:
/etc/shardctl and /shardctl/runs are folders of the test. Deleting a pod sends
SIGTERM to its main process, as the kubelet does; the restarted pods find the
checkpoint on the shared run folder and continue.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardctl.orchestrator.clusters.k8s import objects as render_k8s
from shardctl.orchestrator.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pods:
    """The pods of one rendered job, started as process groups of this test."""

    def __init__(self, spec: Any, root: Path) -> None:
        self.spec = spec
        self.etc = root / "etc-shardctl"
        self.runs = root / "runs"
        self.cache = root / "cache"
        for folder in (self.etc, self.runs, self.cache):
            folder.mkdir(parents=True)
        objects = render_k8s.k8s_objects(spec)
        self.api = spec.k8s.api
        if self.api == "trainjob":
            # The pod Trainer builds: the runtime patch's pod, its container "node"
            # completed by the trainer block (image, command, env); the image's WORKDIR.
            job = objects["trainjob"]
            rjob = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
            pod_spec = rjob["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            pod_spec["containers"][0].update(
                command=job["spec"]["trainer"]["command"],
                env=job["spec"]["trainer"]["env"],
                workingDir=render_k8s.RUNS_MOUNT,
            )
        else:
            pod_spec = objects["pytorchjob"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"][
                "spec"
            ]
        # The ConfigMap volume's items put keys at paths (an entrypoint's code folder).
        volume = next(v for v in pod_spec["volumes"] if v["name"] == "spec")["configMap"]
        paths = {i["key"]: i["path"] for i in volume.get("items", [])}
        for name, text in objects["configmap"]["data"].items():
            target = self.etc / paths.get(name, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(self._local(text))
        self.container = pod_spec["containers"][0]
        self.port = _free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def _local(self, text: str) -> str:
        return text.replace(render_k8s.SPEC_DIR, str(self.etc)).replace(
            render_k8s.RUNS_MOUNT, str(self.runs)
        )

    def start(self, attempt: int) -> None:
        nodes = self.spec.resources.nodes
        self.procs, self.logs = [], []
        for node in reversed(range(nodes)):
            env = {
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin",
                # The container's own env, with the cache paths of this test.
                **{
                    e["name"]: e["value"].replace(render_k8s.CACHE_MOUNT, str(self.cache))
                    for e in self.container["env"]
                },
                # What the operator injects into every pod.
                "PET_NNODES": str(nodes),
                "PET_NODE_RANK": str(node),
                "PET_NPROC_PER_NODE": str(self.spec.resources.procs_per_node),
            }
            if self.api == "trainjob":  # Trainer v2's torch plugin
                env["PET_MASTER_ADDR"] = "127.0.0.1"
                env["PET_MASTER_PORT"] = str(self.port)
            else:  # the training operator v1
                env["MASTER_ADDR"] = "127.0.0.1"
                env["MASTER_PORT"] = str(self.port)
                env["RANK"] = str(node)  # node-level: the command must not let ranks see it
                env["WORLD_SIZE"] = str(nodes)
            env["TMPDIR"] = str(self.cache)
            command = [self._local(word) for word in self.container["command"]]
            log = self.runs.parent / f"pod{node}-attempt{attempt}.log"
            with log.open("w") as fh:
                self.procs.append(
                    subprocess.Popen(
                        command,
                        env=env,
                        cwd=self._local(self.container["workingDir"]),
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            self.logs.append(log)

    def delete(self) -> list[int]:
        """What the kubelet does to a deleted pod: SIGTERM to the main process, then wait."""
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        return [self._wait(proc, 240) for proc in self.procs]

    def wait(self, timeout: float) -> list[int]:
        return [self._wait(proc, timeout) for proc in self.procs]

    def _wait(self, proc: subprocess.Popen[bytes], timeout: float) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("a pod did not finish in time:\n" + self.tail()) from None

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:  # only the groups this test started
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def tail(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in self.logs)


def _complete_steps(checkpoints: Path) -> list[int]:
    if not checkpoints.is_dir():
        return []
    return sorted(
        int(p.name.split("-")[1])
        for p in checkpoints.iterdir()
        if p.name.startswith("step-") and not p.name.endswith(".tmp")
        and (p / "manifest.json").is_file()
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", ["k8s", "k8s-trainjob"])
def test_deleted_pods_restart_and_resume_from_the_volume(tmp_path: Path, example: str) -> None:
    """A PyTorchJob and a TrainJob: pod deletion (SIGTERM) → every rank saves together →
    the recreated pods resume from that step on the volume and finish."""
    data = load_spec(ROOT / "examples" / f"{example}.yaml").to_yaml_dict()
    # Long enough that the pods are surely still training when they are deleted.
    data["train"]["steps"] = 60
    data["checkpoint"]["every_steps"] = 10
    spec = parse_spec(data)
    pods = Pods(spec, tmp_path)
    checkpoints = pods.runs / spec.name / "checkpoints"
    try:
        pods.start(attempt=1)
        deadline = time.monotonic() + 400
        while not _complete_steps(checkpoints):
            assert time.monotonic() < deadline, "no checkpoint in time:\n" + pods.tail()
            assert all(p.poll() is None for p in pods.procs), "a pod ended:\n" + pods.tail()
            time.sleep(0.5)
        pods.delete()
        saved = _complete_steps(checkpoints)
        assert saved and saved[-1] < 60, pods.tail()
        assert not (pods.runs / spec.name / "DONE").exists()

        pods.start(attempt=2)  # the operator recreates the deleted pods
        codes = pods.wait(timeout=480)
        assert codes == [0, 0], pods.tail()
    finally:
        pods.kill()
    assert (pods.runs / spec.name / "DONE").is_file()
    assert _complete_steps(checkpoints)[-1] == 60
    second = "\n".join(log.read_text() for log in pods.logs)
    assert f"resumed at step {saved[-1]}" in second, pods.tail()
    # The job.yaml the ranks read put the run dir on the volume.
    pod_spec = yaml.safe_load((pods.etc / "job.yaml").read_text())
    assert pod_spec["checkpoint"]["dir"] == str(checkpoints)


@pytest.mark.slow
def test_your_script_travels_in_the_configmap_and_counts_its_restarts(tmp_path: Path) -> None:
    """An entrypoint with a code folder: the pods run the shipped script (which imports
    its neighbour module), get the run contract, and a restarted pod is attempt 1."""
    code = ROOT / "tests" / "data" / "usercode"
    data = load_spec(ROOT / "examples" / "k8s.yaml").to_yaml_dict()
    del data["train"]
    args = ["--x", "it's $(id)", "a\nb"]
    data["entrypoint"] = {"script": str(code / "train.py"), "code_dir": str(code), "args": args}
    spec = parse_spec(data)
    pods = Pods(spec, tmp_path)
    assert (pods.etc / "code" / "lib" / "util.py").is_file()
    try:
        for attempt in (0, 1):
            pods.start(attempt=attempt)
            assert pods.wait(timeout=240) == [0, 0], pods.tail()
            seen = [
                yaml.safe_load(line)
                for log in pods.logs
                for line in log.read_text().splitlines()
                if line.startswith("{")
            ]
            assert len(seen) == 4, pods.tail()  # 2 pods x 2 ranks
            for rank in seen:
                assert rank["argv"] == args
                c = rank["contract"]
                assert c["SHARDCTL_ATTEMPT"] == str(attempt)
                assert c["SHARDCTL_RUN_DIR"] == str(pods.runs / spec.name)
    finally:
        pods.kill()


YOUR_SCRIPTS = {
    # script, its args, what a logged step prints, how it says it resumed from step N
    "fsdp2": (
        "fsdp2_script.py", ["--steps", "400", "--log-every", "1"], " loss ",
        "resumed at step {step}",
    ),
    "hf-trainer": (
        "hf_trainer_script.py", ["--max-steps", "400", "--save-steps", "1000"], "'loss'",
        "resuming from {checkpoints}/checkpoint-{step}",
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", sorted(YOUR_SCRIPTS))
def test_your_script_resumes_when_its_pods_are_deleted_and_restarted(
    tmp_path: Path, script: str
) -> None:
    """examples/fsdp2_script.py and examples/hf_trainer_script.py as a PyTorchJob: pod
    deletion (SIGTERM) → every rank saves → the restarted pods resume from that step
    (checkpoints on the volume)."""
    file, args, progress, resumed = YOUR_SCRIPTS[script]
    data = load_spec(ROOT / "examples" / "k8s.yaml").to_yaml_dict()
    del data["train"]
    data["entrypoint"] = {"script": str(ROOT / "examples" / file), "args": args}
    data["checkpoint"]["every_steps"] = 5
    spec = parse_spec(data)
    pods = Pods(spec, tmp_path)
    try:
        pods.start(attempt=1)
        deadline = time.monotonic() + 300
        while sum(log.read_text().count(progress) for log in pods.logs) < 3:
            assert time.monotonic() < deadline, "no step in time:\n" + pods.tail()
            assert all(p.poll() is None for p in pods.procs), "a pod ended:\n" + pods.tail()
            time.sleep(0.5)
        pods.delete()  # torchrun ends 1 after SIGTERM; the operator recreates deleted pods
        marker = yaml.safe_load((pods.runs / spec.name / "PREEMPTED").read_text())
        saved = int(marker["step"])
        pods.start(attempt=2)
        time.sleep(1)
        deadline = time.monotonic() + 300
        text = ""
        expected = resumed.format(step=saved, checkpoints=pods.runs / spec.name / "checkpoints")
        while expected not in text:
            text = "\n".join(log.read_text() for log in pods.logs)
            assert time.monotonic() < deadline, "no resume in time:\n" + pods.tail()
            time.sleep(0.5)
    finally:
        pods.kill()
