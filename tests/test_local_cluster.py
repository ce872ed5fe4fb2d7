"""The embedded default cluster: dryrun, submit, status, logs, cancel, --wait, resume."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.ckpt_run import ROOT
from helpers.local_run import follow_to_end
from helpers.render_util import LAUNCH_WRAPPER
from helpers.train_run import metrics, tiny_spec
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.clusters.base import JobRef, JobState
from shardctl.orchestrator.clusters.local import LocalCluster
from shardctl.orchestrator.errors import ClusterError, UsageError
from shardctl.orchestrator.spec import load_spec

SHARDCTL = str(Path(sys.executable).parent / "shardctl")


def test_dryrun_is_pure_and_shows_the_script_and_command(tmp_path: Path) -> None:
    spec = load_spec(tiny_spec(tmp_path, "dry"))
    plan = LocalCluster().dryrun(spec)
    assert not (tmp_path / "dry").exists()  # nothing written, nothing started
    assert {"job.yaml", "launch.sh", "env.sh"} <= set(plan.artifacts)
    assert plan.request["argv"] == ["bash", str(tmp_path / "dry" / "launch.sh")]
    assert "torchrun" in plan.artifacts["launch.sh"]
    assert plan.artifacts["launch.sh"] in plan.text
    assert "logs/launcher.out" in plan.text
    assert LocalCluster().dryrun(spec).text == plan.text  # deterministic
    res = CliRunner().invoke(cli, ["submit", str(tmp_path / "dry.yaml"), "--dry-run"])
    first = 'exec "$@" \\\n    ' + LAUNCH_WRAPPER + "torchrun"
    assert res.exit_code == 0 and first in res.output
    assert not (tmp_path / "dry").exists()


def test_status_logs_cancel_of_a_job_that_never_ran(tmp_path: Path) -> None:
    ref = JobRef(cluster="local", job_id="1", name="ghost", run_dir=str(tmp_path / "ghost"))
    local = LocalCluster()
    assert local.status(ref).state == JobState.UNKNOWN
    assert "no logs yet" in local.logs(ref)
    with pytest.raises(ClusterError, match="not running"):
        local.cancel(ref)


def test_a_run_that_wrote_done_before_a_cancel_says_succeeded(tmp_path: Path) -> None:
    """The last step and DONE came first; the cancel only met the ranks shutting down."""
    run_dir = tmp_path / "late"
    run_dir.mkdir()
    (run_dir / "local.pid").write_text("999999999 1\n")  # the supervisor has ended
    (run_dir / "local.exit").write_text("1\n")
    (run_dir / "DONE").write_text('{"kind": "done", "step": 6}\n')
    (run_dir / "CANCELLED").write_text('{"kind": "cancelled"}\n')
    ref = JobRef(cluster="local", job_id="1", name="late", run_dir=str(run_dir))
    st = LocalCluster().status(ref)
    assert (st.state, st.detail) == (JobState.SUCCEEDED, "finished step 6"), st
    assert LocalCluster().exit_code(ref) == 0


def _wait_for(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


@pytest.mark.slow
def test_submit_status_logs_cancel_then_resume_to_completion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # Long enough that it is surely still running when cancelled.
    spec_path = tiny_spec(
        tmp_path, "job", train={"steps": 5000}, checkpoint={"every_steps": 5000, "keep": 2}
    )
    run_dir = tmp_path / "job"
    local = LocalCluster()
    ref = local.submit(load_spec(spec_path))
    try:
        assert ref.run_dir == str(run_dir) and ref.extra["cwd"] == str(tmp_path)
        assert local.status(ref).state == JobState.RUNNING
        with pytest.raises(ClusterError, match="already running"):
            local.submit(load_spec(spec_path))
        _wait_for(
            lambda: (run_dir / "logs" / "metrics.jsonl").exists() and metrics(run_dir),
            240,
            "the first logged step",
        )
        assert "step" in local.logs(ref, tail=50)
        local.cancel(ref, grace_s=120)
    finally:
        if local.status(ref).state == JobState.RUNNING:  # never leave it behind
            local.cancel(ref, grace_s=5)
    st = local.status(ref)
    assert st.state == JobState.CANCELLED, st
    step = json.loads((run_dir / "PREEMPTED").read_text())["step"]
    marker = json.loads((run_dir / "PREEMPTED").read_text())
    assert (marker["kind"], marker["signal"]) == ("preempted", "SIGTERM")
    assert (run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    assert local.exit_code(ref) == 143  # cancelled, though saved (exit-codes.md)
    # torchrun's own traceback of the SIGTERM it got is one line on screen, and stays
    # whole in launcher.err (the file the line names).
    err = run_dir / "logs" / "launcher.err"
    shown = local.logs(ref)
    assert "Traceback" not in shown and "SignalException" in err.read_text(), shown[-3000:]
    assert f"stopped its ranks (not a crash; its full report is in {err})" in shown
    # torchrun got TERM from the group's signal and at most once more from the node
    # watchdog passing it on, never a third time from cancel's signal to each process.
    assert 1 <= len(re.findall(r"SignalException: Process \d+ got signal", err.read_text())) <= 2
    # The supervisor asked the classifier too, and recorded its verdict: a cancel, stop.
    verdict = json.loads((run_dir / "local.outcome").read_text())
    assert (verdict["decision"], verdict["outcome"]["kind"]) == ("stop", "cancelled")
    assert verdict["outcome"]["step"] == step

    # The CLI in the foreground: resumes where the cancel saved, exits with the job's code.
    # (The same run, shortened to end 3 steps after the saved one.)
    total = step + 3
    tiny_spec(tmp_path, "job", train={"steps": total}, checkpoint={"every_steps": total, "keep": 2})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [SHARDCTL, "submit", str(spec_path), "--wait"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resumed at step {step} (" in res.stdout
    assert (run_dir / "DONE").is_file() and not (run_dir / "PREEMPTED").exists()
    status = subprocess.run(
        [SHARDCTL, "status", "job"], capture_output=True, text=True, env=env, timeout=60
    )
    assert "SUCCEEDED" in status.stdout, status.stdout + status.stderr
    again = subprocess.run(
        [SHARDCTL, "submit", str(spec_path), "--wait"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert again.returncode == 0 and "run complete" in again.stdout


@pytest.mark.slow
def test_a_preempted_run_says_so_instead_of_looking_like_a_crash(tmp_path: Path) -> None:
    """torchrun's traceback for exit 42 stays in the launcher log, out of the terminal."""
    spec_path = tiny_spec(tmp_path, "pre", train={"steps": 4})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SHARDCTL_STOP_AFTER_STEP": "2"}
    res = subprocess.run(
        [SHARDCTL, "submit", str(spec_path), "--wait"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        start_new_session=True,
    )  # fmt: skip
    shown = res.stdout + res.stderr
    assert res.returncode == 42, shown[-3000:]
    assert "Traceback" not in shown and "ChildFailedError" not in shown
    assert "pre: PREEMPTED: preempted at step 2" in res.stderr
    assert "submit the spec again to resume" in res.stderr
    assert "ChildFailedError" in (tmp_path / "pre" / "logs" / "launcher.err").read_text()
    logs = subprocess.run(
        [SHARDCTL, "logs", "pre"], capture_output=True, text=True, env=env, timeout=60
    )
    assert "Traceback" not in logs.stdout and "stopped for a preemption" in logs.stdout


@pytest.mark.slow
def test_a_failing_job_is_reported_failed_with_its_exit_code(tmp_path: Path) -> None:
    spec_path = tiny_spec(tmp_path, "bad", train={"data": {"builtin": None, "text": "missing"}})
    local = LocalCluster()
    ref = local.submit(load_spec(spec_path))
    code = follow_to_end(local, ref, poll_s=0.2)
    assert code != 0
    st = local.status(ref)
    assert st.state == JobState.FAILED and st.native_state == f"exit {code}"
    shown = local.logs(ref)
    # A relative path in a spec file is the file's folder's (spec/paths.py).
    assert f"train.data.text '{spec_path.parent / 'missing'}' does not exist" in shown
    # The rank's clear error, then one line for torchrun's 40-line report (kept in the file).
    assert "Traceback" not in shown and "ChildFailedError" not in shown, shown[-3000:]
    err = tmp_path / "bad" / "logs" / "launcher.err"
    assert "[shardctl] the launcher reports rank " in shown and "ended first (exit 78)" in shown
    assert f"its full report is in {err}" in shown and "ChildFailedError" in err.read_text()


@pytest.mark.slow
def test_a_two_node_hybrid_shard_spec_runs_both_nodes_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = load_spec(
        tiny_spec(
            tmp_path,
            "hsdp",
            resources={"nodes": 2, "procs_per_node": 1},
            strategy={"sharding": "hybrid_shard"},
            train={"steps": 2},
            checkpoint={"every_steps": 2},
        )
    )
    local = LocalCluster()
    plan = local.dryrun(spec)
    assert "SHARDCTL_NODE_RANK=0..1" in plan.text
    ref = local.schedule(plan)
    code = follow_to_end(local, ref)
    assert code == 0, local.logs(ref)[-5000:]
    manifest = json.loads(
        (tmp_path / "hsdp" / "checkpoints" / "step-00000002" / "manifest.json").read_text()
    )
    assert (manifest["sharding"], manifest["world_size"]) == ("hybrid_shard", 2)


def test_follow_logs_of_an_ended_run_prints_this_attempt_and_returns(tmp_path: Path) -> None:
    run = tmp_path / "ended"
    (run / "logs").mkdir(parents=True)
    (run / "job.yaml").write_text("resources: {nodes: 1, procs_per_node: 2}\n")
    (run / "logs" / "launcher.out").write_text("old attempt\nnew 1\nnew 2")
    (run / "logs" / "launcher.err").write_text("warning: x\n")
    (run / "local.exit").write_text("0\n")
    offsets = {"launcher.out": len("old attempt\n"), "launcher.err": 0}
    ref = JobRef("local", "1", "ended", str(run), {"log_offsets": offsets})
    out: list[str] = []
    LocalCluster().follow_logs(ref, out.append, poll_s=0.01)
    assert "".join(out) == "new 1\nnew 2\nwarning: x\n"
    out.clear()
    LocalCluster().follow_logs(ref, out.append, node=0, tail=1, poll_s=0.01)
    assert "".join(out) == "new 2\nwarning: x\n"
    with pytest.raises(UsageError, match=r"--node 1: a local run writes every node"):
        LocalCluster().follow_logs(ref, out.append, node=1)
