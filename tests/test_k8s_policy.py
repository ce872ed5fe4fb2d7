"""Kubernetes under shardctl's policy: a pod's exit code carries the decision, and the
rendered PyTorchJob and TrainJob make the operator act on it (exit 78 stops; a crash
and a hang restart within `k8s.backoff_limit`; a preemption resumes).

The operators are not here. What they do with a pod's code is their documented rule:
the training operator's `ExitCode` policy restarts 128-255 and fails the job on 1-127
(`IsRetryableExitCode`: code >= 128); shardctl's TrainJob runtime fails its Job on
1-127 by a pod failure policy and its JobSet by the rule for that reason. The pods'
side runs for real: the node agent with Kubernetes' adapter
(`python -m shardctl.orchestrator.clusters.k8s`) over a stand-in launcher,
as the rendered launch script execs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.k8s_schemas import validate_pytorchjob, validate_trainer_object
from helpers.render_util import LAUNCH_WRAPPER
from shardctl.orchestrator.clusters.k8s import objects as render_k8s
from test_k8s_render import make

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 60.0  # a loaded machine starts two interpreters slowly
NODE_AGENT = "shardctl.orchestrator.clusters.k8s"

# A stand-in launcher: exits as told, or kills itself, or writes the PREEMPTED marker
# the ranks write (their save on SIGTERM) and exits 1 as torchrun does.
STAND_IN = r"""
import json, os, signal, sys, time
run_dir = os.environ["SHARDCTL_RUN_DIR"]
token = os.environ.get("SHARDCTL_ATTEMPT_TOKEN")
mode = sys.argv[1]
def write(name, marker):
    with open(os.path.join(run_dir, name), "w") as f:
        json.dump({**marker, "token": token}, f)
def preempted(*_):
    write("PREEMPTED", {"kind": "preempted", "step": 8, "signal": "SIGTERM", "reason": "saved"})
    sys.exit(1)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "saved":  # another pod's TERM: every rank of the job saved, this one too
    preempted()
if mode == "term":  # this pod is deleted: the watchdog passes TERM on
    signal.signal(signal.SIGTERM, preempted)
    open(os.path.join(run_dir, "ready"), "w").close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
if mode == "failed78":  # a rank exited 78 (its FAILED marker); torchrun exits 1
    write("FAILED", {"kind": "failed", "code": 78, "rank": 1})
    sys.exit(1)
if mode == "done":
    write("DONE", {"kind": "done", "step": 8})
    sys.exit(0)
sys.exit(int(mode))
"""


def operator_restarts(code: int) -> bool:
    """The training operator's ExitCode rule (and shardctl's TrainJob runtime's)."""
    return code >= 128


class Pod:
    """One node's agent over the stand-in launcher, with a run dir on the "PVC"."""

    def __init__(
        self, tmp_path: Path, *, bound: int = 2, kubernetes: bool = True,
        counts: str | None = None,
    ) -> None:  # fmt: skip
        self.run_dir = tmp_path / "runs" / "job"
        self.run_dir.mkdir(parents=True)
        self.script = tmp_path / "stand_in.py"
        self.script.write_text(STAND_IN)
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "TMPDIR": str(tmp_path),
            "SHARDCTL_RUN_DIR": str(self.run_dir),
            "SHARDCTL_NODE_RANK": "0",
            "SHARDCTL_NNODES": "1",
            "SHARDCTL_HANG_TIMEOUT_S": "600",
            "SHARDCTL_JOB_NAME": "job",
            "SHARDCTL_POD_RESTARTS": str(bound),
            # As rendered with a PVC: the counts in the run dir on the volume.
            "SHARDCTL_POD_COUNTS": str(self.run_dir / ".attempts") if counts is None else counts,
        }
        if kubernetes:
            self.env["SHARDCTL_EXIT_CODES"] = "kubernetes"

    def command(self, mode: str) -> list[str]:
        launcher = [sys.executable, str(self.script), mode]
        return [sys.executable, "-m", NODE_AGENT, "--", *launcher]

    def run(self, mode: str, *, keep_markers: bool = False) -> int:
        """One start of the pod: the code it exits with."""
        for name in () if keep_markers else ("PREEMPTED", "DONE", "FAILED"):
            (self.run_dir / name).unlink(missing_ok=True)
        done = subprocess.run(
            self.command(mode), env=self.env, capture_output=True, text=True, timeout=WAIT_S
        )
        self.log = done.stdout + done.stderr  # the agent says its decision on stdout
        return done.returncode


@pytest.mark.parametrize(
    ("mode", "code"),
    [
        ("78", 78),  # the script said do not retry: stays permanent
        ("failed78", 78),  # a rank said it under torchrun, which exits 1
        ("1", 129),  # a crash within the bound: restarted
        ("3", 131),
        ("kill", 137),  # the launcher killed (OOM, SIGKILL): restarted
        ("saved", 170),  # another pod's TERM: every rank saved, a preemption
        ("124", 252),  # a hang (another node's watchdog's code passed on)
        ("done", 0),
    ],
)
def test_the_pod_exits_with_the_policy_s_decision(tmp_path: Path, mode: str, code: int) -> None:
    pod = Pod(tmp_path)
    assert pod.run(mode) == code, pod.log
    assert operator_restarts(code) == (mode not in ("78", "failed78", "done"))


def test_without_kubernetes_codes_the_launcher_s_code_is_kept(tmp_path: Path) -> None:
    """Other clusters read the launcher's own code and the markers."""
    pod = Pod(tmp_path, kubernetes=False)
    assert [pod.run(mode) for mode in ("78", "1", "42", "kill")] == [78, 1, 42, 137]


def test_a_crash_restarts_within_the_bound_then_stops(tmp_path: Path) -> None:
    """`k8s.backoff_limit` 2: two restarts of this node (counted in the run dir, on the
    volume, so a recreated pod sees them), then the crash's own code: the job fails."""
    pod = Pod(tmp_path, bound=2)
    codes = [pod.run("1") for _ in range(3)]
    assert codes == [129, 129, 1], pod.log
    assert [operator_restarts(c) for c in codes] == [True, True, False]
    assert "the job stops" in pod.log
    # The ledger (attempts.jsonl, what goodput and the no-progress rule read) records
    # the pod's decision: the operator's retry, then the stop; each start its token.
    lines = (pod.run_dir / "attempts.jsonl").read_text().splitlines()
    ledger = [json.loads(line) for line in lines]
    assert [(e["kind"], e["decision"], e["token"]) for e in ledger] == [
        ("failed", "retry", "k8s-job-0"), ("failed", "retry", "k8s-job-1"),
        ("failed", "stop", "k8s-job-2"),
    ]  # fmt: skip
    # A preemption is never counted against the bound: it resumes past it too.
    assert pod.run("saved") == 170, pod.log


def test_no_restart_without_a_volume_to_count_them(tmp_path: Path) -> None:
    """Bound 0 (no k8s.pvc, no bucket): a crash stops at once, a preemption still resumes."""
    pod = Pod(tmp_path, bound=0, counts="")
    assert [pod.run("1"), pod.run("kill"), pod.run("saved")] == [1, 1, 170], pod.log


def test_a_deleted_pod_s_term_is_a_preemption_that_resumes(tmp_path: Path) -> None:
    """The kubelet's SIGTERM reaches the watchdog, which passes it on; the ranks save
    and the launcher exits 1: the pod exits 170, which the operator restarts."""
    pod = Pod(tmp_path)
    proc = subprocess.Popen(
        pod.command("term"), env=pod.env, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + WAIT_S
        while not (pod.run_dir / "ready").exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the stand-in never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=WAIT_S)
    log = proc.stderr.read() if proc.stderr else ""
    assert code == 170, log
    assert json.loads((pod.run_dir / "PREEMPTED").read_text())["signal"] == "SIGTERM"


def test_each_start_of_a_pod_has_its_own_attempt_token(tmp_path: Path) -> None:
    """A pod's start claims `k8s-<job>-<start>` (its starts counted on the volume) and
    its ranks get it; the agent reads only that token's markers. A start that ends
    in the same second as the one before, with that start's FAILED (code 78) still
    there, is judged by its own end: a crash, restarted (129), not the old 78."""
    pod = Pod(tmp_path)
    assert pod.run("failed78") == 78, pod.log
    failed = pod.run_dir / "FAILED"
    assert json.loads(failed.read_text())["token"] == "k8s-job-0"
    # The same second as the next start, whatever the machine's pace: by file time
    # the old FAILED would be the next start's own.
    later = time.time() + 30
    os.utime(failed, (later, later))
    assert pod.run("1", keep_markers=True) == 129, pod.log
    assert json.loads((pod.run_dir / "CURRENT_ATTEMPT").read_text())["token"] == "k8s-job-1"
    assert (pod.run_dir / ".attempts" / "node-0").read_text().strip() == "1"


def test_without_a_pvc_the_bucket_keeps_a_pod_s_starts_and_restarts(
    tmp_path: Path, s3_server: Any
) -> None:
    """A one-node job with `checkpoint.dir: s3://...` and no PVC: every pod starts on
    a fresh emptyDir (nothing of the last pod's run dir is left), and its counts live
    beside the checkpoints in the bucket, so a crash restarts within the bound and
    then stops, as on a volume."""
    bucket = s3_server.make_bucket("k8s-pod-counts")
    url = f"s3://{bucket}/runs/job"
    codes, logs = [], []
    for start in range(3):
        pod = Pod(tmp_path / f"pod-{start}", bound=2, counts=f"{url}/.attempts")
        pod.env.update(s3_server.env(), SHARDCTL_CHECKPOINT_DIR=url)
        codes.append(pod.run("1"))
        logs.append(pod.log)
        claim = json.loads((pod.run_dir / "CURRENT_ATTEMPT").read_text())
        assert claim["token"] == f"k8s-job-{start}", logs
    assert codes == [129, 129, 1], logs
    client = s3_server.boto3_client()
    for name, count in (("restarts-node-0", b"2\n"), ("node-0", b"2\n")):
        body = client.get_object(Bucket=bucket, Key=f"runs/job/.attempts/{name}")["Body"]
        assert body.read() == count, name


def test_a_count_the_bucket_cannot_keep_is_said_in_one_line(tmp_path: Path) -> None:
    """An endpoint that does not answer: the pod still runs and exits with its
    decision, and its log says which count could not be read or kept, and where. With
    no count to bound them, a crash stops (no endless restarts); a preemption resumes."""
    pod = Pod(tmp_path, bound=2, counts="s3://nowhere/runs/job/.attempts")
    pod.env.update(
        AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_ACCESS_KEY_ID="x",
        AWS_SECRET_ACCESS_KEY="y", AWS_DEFAULT_REGION="us-east-1", AWS_MAX_ATTEMPTS="1",
    )  # fmt: skip
    assert [pod.run("78"), pod.run("1"), pod.run("saved")] == [78, 1, 170], pod.log
    lines = [line for line in pod.log.splitlines() if "s3://nowhere/runs/job/.attempts" in line]
    assert lines and all(line.startswith("[shardctl] cannot ") for line in lines), pod.log
    assert "Traceback" not in pod.log


FAKE_LAUNCHER = ROOT / "tests" / "data" / "watchdog" / "fake_launcher.py"


@pytest.mark.timeout(300)
def test_the_node_agent_ends_a_hung_pod_s_ranks_and_the_pod_restarts(tmp_path: Path) -> None:
    """No watchdog in the pod: the agent itself (`--watch-hangs`, as rendered) reads the
    ranks' heartbeats, ends a node none of whose ranks advances for the hang timeout
    (HUNG under this start's token, every rank's stack in its log and in the report),
    and the pod exits 252 (128 + 124), which the operator restarts."""
    pod = Pod(tmp_path)
    pod.env.update(SHARDCTL_HANG_TIMEOUT_S="3", SHARDCTL_NNODES="1", FAKE_OUT=str(tmp_path))
    command = [sys.executable, "-m", NODE_AGENT, "--watch-hangs", "--",
               sys.executable, str(FAKE_LAUNCHER), "2", "stuck"]  # fmt: skip
    try:
        done = subprocess.run(command, env=pod.env, capture_output=True, text=True, timeout=240)
    finally:
        pids = (
            (tmp_path / "rank-pids").read_text().split()
            if (tmp_path / "rank-pids").exists()
            else []
        )
        for pid in map(int, pids):  # whatever the agent left (nothing, when it works)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    log = done.stdout + done.stderr
    assert done.returncode == 252, log
    marker = json.loads((pod.run_dir / "HUNG").read_text())
    assert marker["token"] == "k8s-job-0" and marker["step"] == 3, marker
    assert log.count("Python stack, most recent call first") == 2, log
    assert "stuck_in_a_collective" in log and "the operator restarts it" in log
    assert "stuck_in_a_collective" in Path(marker["report"]).read_text()


# ----------------------------------------------------------------- what is rendered


def _launch(spec: object) -> str:
    return render_k8s.render(spec).common["launch.sh"]  # type: ignore[arg-type]


def test_the_pytorchjob_restarts_by_exit_code_and_its_pods_carry_the_decision() -> None:
    spec = make(k8s__backoff_limit=4)
    job = render_k8s.pytorchjob(spec)
    validate_pytorchjob(job)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {r["restartPolicy"] for r in replicas.values()} == {"ExitCode"}
    launch = _launch(spec)
    assert "export SHARDCTL_EXIT_CODES=kubernetes\n" in launch
    assert "export SHARDCTL_POD_RESTARTS=4\n" in launch
    assert f"export SHARDCTL_POD_COUNTS=/shardctl/runs/{spec.name}/.attempts\n" in launch
    # The node agent is what the container runs, right above the launcher: it applies
    # the hang rule and maps the launcher's end to the pod's code. No watchdog.
    assert (
        f'exec "${{SHARDCTL_PYTHON:-python3}}" -m {NODE_AGENT} --watch-hangs -- \\\n    '
        + LAUNCH_WRAPPER
        + "torchrun"
    ) in launch
    assert "shardctl.train.watchdog" not in launch


def test_without_a_pvc_a_crash_is_not_restarted() -> None:
    launch = _launch(make(resources__nodes=1, k8s__pvc=None))
    assert "export SHARDCTL_POD_RESTARTS=0\n" in launch
    assert "export SHARDCTL_POD_COUNTS=''\n" in launch


def test_without_a_pvc_a_bucket_keeps_the_counts_and_a_crash_restarts() -> None:
    spec = make(
        resources__nodes=1, k8s__pvc=None, k8s__backoff_limit=3,
        checkpoint__dir="s3://ckpt/runs/tiny",
    )  # fmt: skip
    launch = _launch(spec)
    assert "export SHARDCTL_POD_RESTARTS=3\n" in launch
    assert "export SHARDCTL_POD_COUNTS=s3://ckpt/runs/tiny/.attempts\n" in launch


def test_on_failure_keeps_the_launcher_s_codes() -> None:
    spec = make(k8s__restart_policy="OnFailure")
    assert "SHARDCTL_EXIT_CODES" not in _launch(spec)
    job = render_k8s.pytorchjob(spec)
    assert {r["restartPolicy"] for r in job["spec"]["pytorchReplicaSpecs"].values()} == {
        "OnFailure"
    }


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_without_the_watchdog_the_node_agent_still_gives_the_pod_its_code(api: str) -> None:
    """The exit code is the node agent's, not the watchdog's: turning hang detection
    off no longer leaves the operator without shardctl's decision."""
    launch = render_k8s.render(make(k8s__api=api, watchdog__enabled=False)).common["launch.sh"]
    assert "export SHARDCTL_EXIT_CODES=kubernetes\n" in launch
    assert f'exec "${{SHARDCTL_PYTHON:-python3}}" -m {NODE_AGENT} -- \\\n' in launch
    assert "shardctl.train.watchdog" not in launch


def test_the_trainjob_runtime_fails_the_jobset_on_a_permanent_code() -> None:
    spec = make(k8s__api="trainjob", k8s__runtime="shardctl-torch", k8s__backoff_limit=5)
    rendered = render_k8s.render(spec)
    validate_trainer_object(rendered.objects["trainjob"])
    runtime = rendered.runtime
    assert runtime is not None
    validate_trainer_object(runtime)
    jobset = runtime["spec"]["template"]["spec"]
    (rule,) = jobset["failurePolicy"]["rules"]
    assert rule["action"] == "FailJobSet"
    assert rule["onJobFailureReasons"] == ["PodFailurePolicy"]  # the Job's reason for FailJob
    assert jobset["failurePolicy"]["maxRestarts"] == 5
    (rjob,) = jobset["replicatedJobs"]
    assert rule["targetReplicatedJobs"] == [rjob["name"]]
    job_spec = rjob["template"]["spec"]
    assert job_spec["backoffLimit"] == 0 and job_spec["podReplacementPolicy"] == "Failed"
    assert job_spec["template"]["spec"]["restartPolicy"] == "Never"
    (pod_rule,) = job_spec["podFailurePolicy"]["rules"]
    assert pod_rule["action"] == "FailJob"
    on = pod_rule["onExitCodes"]
    assert on["operator"] == "In" and on["containerName"] == "node"
    # The API's rules: ordered, no duplicates, no 0, at most 255 values.
    assert on["values"] == sorted(set(on["values"])) and 0 not in on["values"]
    assert len(on["values"]) <= 255
    permanent = set(on["values"])
    # The same split as the PyTorchJob's ExitCode policy.
    assert all((code in permanent) != operator_restarts(code) for code in range(1, 256))
    assert 78 in permanent and not {129, 137, 170, 252} & permanent
    assert "SHARDCTL_EXIT_CODES=kubernetes" in rendered.common["launch.sh"]


@pytest.mark.parametrize("own_run_dir", [True, False])
def test_a_pod_without_a_shared_run_dir_takes_its_ranks_exits_42_for_a_save(
    tmp_path: Path, own_run_dir: bool
) -> None:
    """Without a PVC rank 0's PREEMPTED is in its own pod's run dir only. A pod whose
    every rank exited 42 (after its save, as its launcher recorded) for another pod's
    preemption is a preemption too: restarted (170) and not counted against
    k8s.backoff_limit. With a shared run dir the marker decides: the same exits alone
    are a crash, counted (tests above)."""
    from shardctl.orchestrator.clusters.k8s.node_agent import FolderCounts, PodAdapter
    from shardctl.orchestrator.launch_wrapper import record_path, write_once
    from shardctl.orchestrator.outcome import Decision, Evidence, Kind, judge

    run_dir = tmp_path / "runs" / "job"
    adapter = PodAdapter(
        str(run_dir), "job", 1, 2, 0, exit_codes=True, bound=2,
        counts=FolderCounts(str(tmp_path / "counts")), own_run_dir=own_run_dir,
    )  # fmt: skip
    ranks = [{"rank": r, "local_rank": r - 2, "exitcode": 42} for r in (2, 3)]
    write_once(record_path(run_dir, "k8s-job-0", 1), {"token": "k8s-job-0", "failures": ranks})
    evidence = Evidence(1, {}, (), None, "k8s-job-0")  # torchrun exits 1, no marker here
    verdict = adapter.own_verdict(judge(evidence), evidence)
    assert verdict.decision is Decision.RETRY
    adapter.carry_out(verdict, evidence, 1, 0)
    if own_run_dir:
        assert verdict.outcome.kind is Kind.PREEMPTED and adapter.exit_code == 170
        assert not (tmp_path / "counts" / "restarts-node-1").exists()
    else:
        assert verdict.outcome.kind is Kind.FAILED and adapter.exit_code == 129
        assert (tmp_path / "counts" / "restarts-node-1").read_text() == "1\n"

    # One rank's 42 beside another's crash is a crash, counted, in either run dir.
    other = PodAdapter(
        str(tmp_path / "other"), "job", 1, 2, 0, exit_codes=True, bound=2,
        counts=FolderCounts(str(tmp_path / "counts-other")), own_run_dir=True,
    )  # fmt: skip
    mixed = [ranks[0], {**ranks[1], "exitcode": 1}]
    write_once(record_path(tmp_path / "other", "k8s-job-0", 1), {"failures": mixed})
    crash = other.own_verdict(judge(evidence), evidence)
    assert crash.outcome.kind is Kind.FAILED and crash.decision is Decision.RETRY
