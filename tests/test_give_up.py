"""Knowing when to stop: a script's "do not retry" (exit 78) and attempts without a new
checkpoint end a run instead of burning requeues — the Slurm node task, on its own and
as job.sbatch runs it, with stand-ins for srun and scontrol, and a real local run
(torchrun, 2 ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.node_task_run import SCRIPT as NODE_TASK
from helpers.train_run import free_port
from shardctl.orchestrator.clusters import slurm as backend
from shardctl.orchestrator.clusters.base import JobRef, JobState, JobStatus
from shardctl.orchestrator.clusters.slurm import sbatch as rs
from shardctl.orchestrator.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
SHARDCTL = str(Path(sys.executable).parent / "shardctl")

# Records what the job asked of Slurm; never reaches a real controller.
SCONTROL = """#!/bin/bash
case "$1" in
  show) echo "JobId=${SLURM_JOB_ID} JobName=x Command=${FAKE_SCRIPT} WorkDir=/tmp" ;;
  requeue) echo "requeue $2" >> "${FAKE_OUT}" ;;
  *) exit 1 ;;
esac
"""
# One attempt of the ranks: hang (the watchdog's HUNG, exit 124), hang after saving a
# new complete checkpoint, or a rank that said do not retry (FAILED 78, torchrun's 1).
SRUN = """#!/bin/bash
case "${FAKE_END}" in
  hung) echo '{"kind": "hung", "step": 25, "node": 1}' > "${FAKE_RUN}/HUNG"; exit 124 ;;
  saved-then-hung)
    mkdir -p "${FAKE_RUN}/checkpoints/step-00000040"
    echo '{}' > "${FAKE_RUN}/checkpoints/step-00000040/manifest.json"
    echo '{"kind": "hung", "step": 45, "node": 1}' > "${FAKE_RUN}/HUNG"; exit 124 ;;
  do-not-retry) echo '{"kind": "failed", "code": 78, "rank": 1, "reason": "bad config"}' \\
      > "${FAKE_RUN}/FAILED"; exit 1 ;;
esac
"""


# srun that runs its command here: srun's own words end at the first that is not an option.
RUN_HERE = """#!/bin/bash
while [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""


def _stand_ins(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _old_checkpoint(run_dir: Path, step: int) -> None:
    """A complete checkpoint of an earlier attempt (its manifest an hour old)."""
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    os.utime(folder / "manifest.json", (time.time() - 3600,) * 2)


def _job_sbatch(
    tmp_path: Path, launch_sh: str = SRUN, restarts_in_place: bool = False
) -> tuple[Path, dict[str, str]]:
    """The slurm-2node example's job.sbatch for a run dir in `tmp_path`, and the
    environment to run it with `bash`: srun runs its node task here (node 0), and the
    attempt's end is `launch_sh`'s. Without `restarts_in_place` every attempt ends the
    allocation (up to 10 requeues); with it, the example's restart settings apply."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = load_spec(ROOT / "examples" / "slurm-2node.yaml").to_yaml_dict()
    data["run_dir"] = str(run_dir)
    data["checkpoint"]["dir"] = str(run_dir / "checkpoints")
    if not restarts_in_place:
        data["slurm"]["max_requeues"] = 10
        data["restart"] = {"max_in_allocation": 0}
    script = tmp_path / rs.STANDALONE_FILE
    script.write_text(rs.slurm_artifacts(parse_spec(data))[rs.STANDALONE_FILE])
    bin_dir = _stand_ins(tmp_path)
    (bin_dir / "srun").write_text(RUN_HERE)
    (tmp_path / "launch.sh").write_text(launch_sh)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin",
        "SLURM_JOB_ID": "7",
        "FAKE_SCRIPT": str(script),
        "FAKE_OUT": str(tmp_path / "calls"),
        "FAKE_RUN": str(run_dir),
        "SHARDCTL_PYTHON": sys.executable,  # the batch host's python3 lacks shardctl here
    }
    return script, env


def _attempt(script: Path, env: dict[str, str], restarts: int, end: str):
    """One allocation of job.sbatch; what its node task said is in `stderr`."""
    env = {**env, "SLURM_RESTART_COUNT": str(restarts), "FAKE_END": end}
    proc = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=90
    )
    proc.stderr = proc.stdout + proc.stderr
    return proc


def _requeues(tmp_path: Path) -> int:
    calls = tmp_path / "calls"
    return calls.read_text().count("requeue 7\n") if calls.exists() else 0


def test_job_sbatch_stops_after_three_attempts_without_a_new_checkpoint(tmp_path: Path) -> None:
    script, env = _job_sbatch(tmp_path)
    _old_checkpoint(tmp_path / "run", 20)
    for restarts in (0, 1):
        proc = _attempt(script, env, restarts, "hung")
        assert proc.returncode == 0 and "requeueing job 7" in proc.stderr, proc.stderr
    assert _requeues(tmp_path) == 2
    proc = _attempt(script, env, 2, "hung")
    assert proc.returncode == 1, proc.stderr
    assert _requeues(tmp_path) == 2  # the third attempt is not requeued
    assert (
        "shardctl: job 7: hung at step 25 (node 1's watchdog); stopped: no new checkpoint "
        "in 3 attempts (last at step 20); not requeued" in proc.stderr
    ), proc.stderr
    lines = [json.loads(x) for x in (tmp_path / "run" / "attempts.jsonl").read_text().splitlines()]
    assert [(x["attempt"], x["decision"], x["checkpoint_step"]) for x in lines] == [
        (0, "retry", 20), (1, "retry", 20), (2, "stop", 20),
    ]  # fmt: skip


def test_job_sbatch_a_new_checkpoint_starts_the_count_over(tmp_path: Path) -> None:
    script, env = _job_sbatch(tmp_path)
    for restarts, end in enumerate(("hung", "hung", "saved-then-hung", "hung", "hung")):
        proc = _attempt(script, env, restarts, end)
        assert proc.returncode == 0 and "requeueing job 7" in proc.stderr, (end, proc.stderr)
    assert _requeues(tmp_path) == 5
    proc = _attempt(script, env, 5, "hung")
    assert proc.returncode == 1 and _requeues(tmp_path) == 5
    assert "stopped: no new checkpoint in 3 attempts (last at step 40)" in proc.stderr
    # Another job of the same run (submitted again) starts with a clean slate.
    proc = _attempt(script, {**env, "SLURM_JOB_ID": "8"}, 0, "hung")
    assert proc.returncode == 0 and "requeueing job 8" in proc.stderr, proc.stderr


def test_job_sbatch_never_requeues_a_script_that_said_do_not_retry(tmp_path: Path) -> None:
    script, env = _job_sbatch(tmp_path)
    proc = _attempt(script, env, 0, "do-not-retry")
    assert proc.returncode == 1 and _requeues(tmp_path) == 0, proc.stderr
    assert (
        "shardctl: node 0 of job 7: the script said do not retry (rank 1 exited with code 78): "
        "bad config; not requeued" in proc.stderr
    ), proc.stderr


# ----------------------------------------------------------------- the node task


def _node_task(tmp_path: Path, restarts: int, end: str) -> str:
    launch = tmp_path / "launch.sh"
    launch.write_text(SRUN)
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",  # the stand-ins first
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "7",
        "SLURM_RESTART_COUNT": str(restarts),
        "FAKE_OUT": str(tmp_path / "calls"),
        "FAKE_RUN": str(tmp_path),
        "FAKE_END": end,
    }
    proc = subprocess.run(
        [sys.executable, str(NODE_TASK), str(launch), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return proc.stdout + proc.stderr


def _status(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, info: dict[str, str], name: str, job: str = "7"
) -> JobStatus:
    """`status` of job `job` (named `name`) of the run in `tmp_path`, with scontrol
    answering `info` for every job."""
    monkeypatch.setattr(backend, "_require_slurm", lambda: None)
    monkeypatch.setattr(backend, "scontrol_job", lambda job_id: info)
    return backend.SlurmCluster().status(JobRef("slurm", job, name, str(tmp_path)))


def test_node_task_stops_the_third_attempt_without_progress_and_status_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stand_ins(tmp_path)
    _old_checkpoint(tmp_path, 20)
    for restarts in (0, 1):
        out = _node_task(tmp_path, restarts, "hung")
        assert "RESULT requeued" in out, out
    out = _node_task(tmp_path, 2, "hung")
    assert (
        "ERROR job 7: hung at step 25 (node 1's watchdog); stopped: no new checkpoint in 3 "
        "attempts (last at step 20); not requeued." in out
    ), out
    assert _requeues(tmp_path) == 2
    # `status` of the FAILED job names the reason the node task recorded.
    info = {"JobState": "FAILED", "Restarts": "2", "NodeList": "n[1-2]", "Reason": "None"}
    st = _status(monkeypatch, tmp_path, info, "loops")
    assert st.state is JobState.FAILED
    assert st.detail.endswith("stopped: no new checkpoint in 3 attempts (last at step 20)")
    # Another job of the same run says nothing of job 7's stop.
    st = _status(monkeypatch, tmp_path, info, "loops", job="8")
    assert "stopped" not in st.detail


def test_node_tasks_first_attempt_is_no_progress_on_a_checkpoint_it_started_from(
    tmp_path: Path,
) -> None:
    """The job's first attempt starts from step 20, whose manifest a node with its clock
    an hour ahead wrote (its time is after this attempt's start): node 0 read step 20
    when the attempt started, so the attempt published nothing new."""
    _stand_ins(tmp_path)
    _old_checkpoint(tmp_path, 20)
    manifest = tmp_path / "checkpoints" / "step-00000020" / "manifest.json"
    os.utime(manifest, (time.time() + 3600,) * 2)
    out = _node_task(tmp_path, 0, "hung")
    assert "RESULT requeued" in out, out
    line = json.loads((tmp_path / "attempts.jsonl").read_text().splitlines()[-1])
    assert (line["job"], line["checkpoint_step"], line["advanced"]) == ("7", 20, False)


def test_node_task_never_requeues_a_script_that_said_do_not_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stand_ins(tmp_path)
    out = _node_task(tmp_path, 0, "do-not-retry")
    assert (
        "ERROR node 0 of job 7: the script said do not retry (rank 1 exited with code 78): "
        "bad config; not requeued." in out
    ), out
    assert _requeues(tmp_path) == 0
    info = {"JobState": "FAILED", "Restarts": "0", "NodeList": "n1", "Reason": "None"}
    st = _status(monkeypatch, tmp_path, info, "gives-up")
    assert "the script said do not retry (rank 1 exited with code 78): bad config" in st.detail


# ----------------------------------------------------------------- a real local run

GIVE_UP = """
import os
from shardctl.train import api

print(f"attempt {os.environ['SHARDCTL_ATTEMPT']} rank {os.environ['RANK']}", flush=True)
# Every rank gives up (see usercode/exit_with.py: torchrun's exit barrier); the first
# to write FAILED names the reason.
api.permanent_failure("data.path /nowhere does not exist")
"""


@pytest.mark.slow
def test_a_local_script_that_says_do_not_retry_stops_and_status_says_why(tmp_path: Path) -> None:
    script = tmp_path / "give_up.py"
    script.write_text(GIVE_UP)
    data = {
        "name": "gives-up",
        "run_dir": str(tmp_path / "gives-up"),
        "resources": {"procs_per_node": 2},
        "entrypoint": {"script": str(script)},
        "local": {"master_port": free_port()},
    }
    spec = tmp_path / "gives-up.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    res = subprocess.run(
        [SHARDCTL, "submit", str(spec), "--wait"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    shown = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 78, shown
    # One attempt, never a second (the first rank to give up makes torchrun end the
    # other, which may not have printed yet).
    assert "attempt 0 rank" in res.stdout and "attempt 1" not in res.stdout, shown
    assert (tmp_path / "gives-up" / "local.attempt").read_text().split() == ["0"]
    # Nor a restart in place (restart.max_in_allocation is 3 here): one round, stopped.
    rounds = (tmp_path / "gives-up" / "attempts.jsonl").read_text().splitlines()
    assert [(r["kind"], r["decision"]) for r in map(json.loads, rounds)] == [("permanent", "stop")]
    failed = json.loads((tmp_path / "gives-up" / "FAILED").read_text())
    assert failed["code"] == 78 and failed["rank"] in (0, 1)
    assert failed["reason"] == "data.path /nowhere does not exist"
    status = subprocess.run(
        [SHARDCTL, "status", "gives-up"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "FAILED" in status and "exit 78" in status, status
    assert (
        f"stopped: the script said do not retry (rank {failed['rank']} exited with code 78): "
        "data.path /nowhere does not exist" in status
    ), status
