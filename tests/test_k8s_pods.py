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

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardctl.orchestrator.clusters.k8s import objects as render_k8s
from shardctl.orchestrator.proctree import Proc, alive, descendants
from shardctl.orchestrator.rundir import EXIT_HUNG, HUNG_FILE
from shardctl.orchestrator.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent


def example_job(**entrypoint: Any) -> dict[str, Any]:
    """The example's Kubernetes job (examples/k8s.yaml) as data; with `entrypoint`
    (script=..., args=..., code_dir=...) it runs that instead of the built-in loop."""
    data = load_spec(ROOT / "examples" / "k8s.yaml").to_yaml_dict()
    if entrypoint:
        del data["train"]
        data["entrypoint"] = entrypoint
    return data


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

    def start(self, attempt: int, only: int | None = None) -> None:
        """Start every node's pod, or `only` that node's (a pod with folders of its own:
        each `Pods` then holds one node, test_k8s_s3_restarts.py)."""
        nodes = self.spec.resources.nodes
        self.procs, self.logs = [], []
        for node in reversed(range(nodes)) if only is None else [only]:
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

    def wait_until(self, done: Callable[[], Any], what: str, timeout: float, poll_s: float) -> None:
        """Poll `done` until it is true while every pod keeps running: a pod that ends,
        or `timeout` seconds without `what`, fails the test with the pods' logs."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"no {what} in time:\n" + self.tail()
            assert all(p.poll() is None for p in self.procs), "a pod ended:\n" + self.tail()
            time.sleep(poll_s)

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
        pods.wait_until(lambda: _complete_steps(checkpoints), "checkpoint", 400, poll_s=0.5)
        # A deleted pod's TERM is Kubernetes' preemption: every pod exits 170 (128 +
        # 42), a code the ExitCode policy restarts.
        assert pods.delete() == [170, 170], pods.tail()
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
    args = ["--x", "it's $(id)", "a\nb"]
    data = example_job(script=str(code / "train.py"), code_dir=str(code), args=args)
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
    data = example_job(script=str(ROOT / "examples" / file), args=args)
    data["checkpoint"]["every_steps"] = 5
    spec = parse_spec(data)
    pods = Pods(spec, tmp_path)
    try:
        pods.start(attempt=1)
        steps = lambda: sum(log.read_text().count(progress) for log in pods.logs)  # noqa: E731
        pods.wait_until(lambda: steps() >= 3, "step", 300, poll_s=0.5)
        pods.delete()  # torchrun ends 1 after SIGTERM; the operator recreates deleted pods
        marker = yaml.safe_load((pods.runs / spec.name / "PREEMPTED").read_text())
        saved = int(marker["step"])
        pods.start(attempt=2)
        deadline = time.monotonic() + 400
        text = ""
        expected = resumed.format(step=saved, checkpoints=pods.runs / spec.name / "checkpoints")
        while expected not in text:
            text = "\n".join(log.read_text() for log in pods.logs)
            assert time.monotonic() < deadline, "no resume in time:\n" + pods.tail()
            time.sleep(0.5)
    finally:
        pods.kill()


# Exits with the code written in the run dir's `exit-code`, on every rank.
EXIT_FROM_RUN_DIR = """\
import os, sys
path = os.path.join(os.environ["SHARDCTL_RUN_DIR"], "exit-code")
print(f"attempt {os.environ['SHARDCTL_ATTEMPT']} rank {os.environ['RANK']}", flush=True)
sys.exit(int(open(path).read()))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_exit_78_stops_the_pytorchjob_and_a_crash_restarts_within_the_bound(
    tmp_path: Path,
) -> None:
    """Two pods of the example's PyTorchJob under restartPolicy ExitCode, with a script
    that exits 78 on every rank: both pods exit 78, which the operator does not restart
    (1-127). The same pods with a crash (exit 3) and `k8s.backoff_limit` 1: 131 (128 +
    3, restarted), then 3 (the job fails). The operator itself is not here: its rule
    is `code >= 128` (tests/test_k8s_policy.py)."""
    script = tmp_path / "exit_from_run_dir.py"
    script.write_text(EXIT_FROM_RUN_DIR)
    data = example_job(script=str(script))
    data["k8s"]["backoff_limit"] = 1
    spec = parse_spec(data)
    assert spec.k8s.restart_policy == "ExitCode"
    pods = Pods(spec, tmp_path / "job")
    run_dir = pods.runs / spec.name
    run_dir.mkdir(parents=True)
    try:
        (run_dir / "exit-code").write_text("78")
        pods.start(attempt=0)
        assert pods.wait(timeout=240) == [78, 78], pods.tail()
        (run_dir / "exit-code").write_text("3")
        for attempt, codes in ((1, [131, 131]), (2, [3, 3])):
            pods.start(attempt=attempt)
            assert pods.wait(timeout=240) == codes, pods.tail()
    finally:
        pods.kill()


HANG_TIMEOUT_S = 15


def _rank_proc(pods: Pods, rank: int) -> tuple[int, Proc]:
    """(pod index, process) of global rank `rank`: the shallowest process below a pod whose
    environment torchrun gave RANK=`rank` (the pod's own RANK is node-level and dropped).
    c10d rendezvous assigns node ranks in arrival order, so any pod may hold it."""
    wanted = f"RANK={rank}".encode()
    for index, pod in enumerate(pods.procs):
        for p in descendants(pod.pid):
            try:
                env = (Path("/proc") / str(p.pid) / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if wanted in env and any(w.startswith(b"LOCAL_RANK=") for w in env):
                return index, p
    raise AssertionError(f"no process with RANK={rank}:\n" + pods.tail())


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_hung_pods_exit_124_and_the_restarted_pods_resume(tmp_path: Path) -> None:
    """A PyTorchJob (2 pods x 2 ranks), rank 1 stopped (SIGSTOP) after the first
    checkpoint: both pods exit 124 within the hang timeout, HUNG names rank 1 and its
    pod's report holds the stacks of both its ranks; the pods started again (what the
    operator does under restartPolicy OnFailure) resume from the newest complete
    checkpoint on the volume and finish. The restarted pods import torch and
    transformers under the start-up allowance, not the 15 s hang timeout: on a loaded
    machine that takes longer (it was declared hung while importing, once). Waits are
    deadline-bounded polls sized for a loaded machine."""
    steps = 30
    data = example_job()
    data["train"]["steps"] = steps
    data["checkpoint"]["every_steps"] = 4
    data["watchdog"] = {"hang_timeout_s": HANG_TIMEOUT_S}
    spec = parse_spec(data)
    pods = Pods(spec, tmp_path)
    run_dir = pods.runs / spec.name
    checkpoints = run_dir / "checkpoints"
    stopped: list[Proc] = []
    try:
        pods.start(attempt=1)
        pods.wait_until(lambda: _complete_steps(checkpoints), "checkpoint", 480, poll_s=0.3)
        pod, rank1 = _rank_proc(pods, 1)
        below = [p for pod_proc in pods.procs for p in descendants(pod_proc.pid)]
        os.kill(rank1.pid, signal.SIGSTOP)
        stopped.append(rank1)
        began = time.monotonic()
        # The timeout, a poll, the stacks (≤ 2 × 5 s), the kill, on a loaded machine;
        # far below the start-up allowance (900 s): the ranks were past their first step.
        codes = pods.wait(timeout=HANG_TIMEOUT_S + 120)
        took = time.monotonic() - began
        # 124 as the pods' code for the operator: a hang to restart (128 + 124).
        assert codes == [128 + EXIT_HUNG] * 2, pods.tail()
        assert took < HANG_TIMEOUT_S + 120, took
        # Launchers and ranks ended: SIGKILLed by the watchdog before it exited, but on a
        # loaded machine a killed process can take a moment to be gone.
        deadline = time.monotonic() + 30
        while survivors := [p for p in below if alive(p.pid, p.ticks)]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not survivors, [(p, _cmdline(p.pid)) for p in survivors]

        # The stuck pod's report: both its ranks' stacks, rank 1 named as stopped first.
        reports = [r.read_text() for r in (run_dir / "logs").glob("hang-attempt0-node*.txt")]
        stuck = [text for text in reports if f"rank 1 (pid {rank1.pid})" in text]
        assert len(stuck) == 1, reports
        assert stuck[0].count("Python stack, most recent call first") == 2, stuck[0]
        named = f"rank 1 (pid {rank1.pid}): last at step "
        line = next(line for line in stuck[0].splitlines() if named in line)
        assert "stopped (SIGSTOP)" in line and "stopped advancing first" in line, line
        marker = json.loads((run_dir / HUNG_FILE).read_text())
        assert marker["attempt"] == 0  # the pods' own count of their starts (on the PVC)
        # Every node whose ranks all wait declares the hang too; the marker keeps the
        # stuck pod's, which names the culprit.
        assert marker["first"] == [1], (marker, pods.tail())
        assert Path(marker["report"]).read_text() == stuck[0]
        assert "HUNG" in pods.logs[pod].read_text()  # the pod's log has the report too
        newest = _complete_steps(checkpoints)[-1]
        # The stopped rank, continued for its stack, finished no step: the other ranks
        # of its pod were frozen first.
        assert newest <= marker["step"] and not (run_dir / "DONE").exists()

        pods.start(attempt=2)  # restartPolicy ExitCode: the operator restarts both
        assert pods.wait(timeout=480) == [0, 0], pods.tail()
    finally:
        for p in stopped:  # by PID (and start time): continue and end what was stopped
            if alive(p.pid, p.ticks):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
        pods.kill()
    second = "\n".join(log.read_text() for log in pods.logs)
    assert f"resumed at step {newest}" in second, pods.tail()
    assert json.loads((run_dir / "DONE").read_text())["step"] == steps
    # Each restarted pod's watchdog held start-up to its own allowance.
    assert second.count("start-up allowance 900 s") == 2, pods.tail()


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return "(gone)"
