"""A new user's first jobs on the dev Slurm cluster (issue 35): a failing `slurm.setup`
line, `submit --wait`, `logs --rank`, and `status --watch` after a cancel."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from helpers.ckpt_run import kill_group
from shardctl.orchestrator.clusters.base import JobRef, JobState
from shardctl.orchestrator.clusters.records import recall
from shardctl.orchestrator.clusters.slurm import SlurmCluster
from shardctl.orchestrator.clusters.slurm.rank_nodes import node_of_rank
from shardctl.orchestrator.errors import ShardctlError
from test_slurm_cluster import (  # the dev cluster's fixture and the e2e helpers
    SHARDCTL,
    _finished,
    _spec,
    _steps,
    _submitted,
    _wait,
    slurm_cluster,  # noqa: F401  (a fixture)
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_a_failing_setup_line_stops_the_job_naming_it_and_its_output_is_in_the_log(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    setup = ["echo hello from setup", "ls /no-such-setup-dir", "echo not reached"]
    ref = _submitted(tmp_path, _spec("setup-fails", slurm={"setup": setup}))
    assert _finished(ref, timeout=120) is JobState.FAILED
    proc = subprocess.run(
        [*SHARDCTL, "logs", "setup-fails"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "hello from setup" in proc.stdout
    assert "/no-such-setup-dir" in proc.stdout  # ls's own complaint
    assert (
        "shardctl: slurm.setup line 2 (ls /no-such-setup-dir) failed with exit code 2; "
        "no launcher was started"
    ) in proc.stdout
    assert "not reached" not in proc.stdout
    # No launcher ran: the training never started.
    assert not (Path(ref.run_dir) / "logs" / "metrics.jsonl").exists()
    assert SlurmCluster().status(ref).state is JobState.FAILED


def test_submit_wait_streams_every_node_and_exits_with_the_job_s_code(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    name = "wait-for-me"
    spec = _spec(
        name,
        train={"steps": 10},
        checkpoint={"every_steps": 5, "keep": 2, "consolidate_on_finish": False},
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run(
        [*SHARDCTL, "submit", str(path), "--cluster", "slurm", "--wait"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--wait works with" not in proc.stderr
    # Every node's output came while it ran, as `logs -f` shows it.
    assert "/out] step     10/10" in proc.stdout, proc.stdout
    assert "[node 1/out] [shardctl] node 1 of job" in proc.stdout, proc.stdout
    # The last word is what happened, as on the local cluster.
    assert proc.stderr.rstrip().splitlines()[-1].startswith(f"{name}: SUCCEEDED"), proc.stderr
    ref = recall(name)
    assert SlurmCluster().status(ref).state is JobState.SUCCEEDED

    # logs --rank: the node that really ran rank 0 (the rendezvous numbers nodes by
    # arrival), where rank 0's own lines are.
    ran = node_of_rank(ref.run_dir, ref.job_id, 0)
    assert ran is not None, list((Path(ref.run_dir) / "logs").rglob("*"))
    node, host = ran
    assert node_of_rank(ref.run_dir, ref.job_id, 1) == (1 - node, _other(host))
    err = Path(ref.extra["folder"]) / f"{ref.job_id}_{node}_log.err"
    assert "[rank 0] " in err.read_text()
    proc = subprocess.run(
        [*SHARDCTL, "logs", name, "-f", "--rank", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert f"rank 0 ran on node {node} ({host}); showing that node" in proc.stderr
    assert proc.stdout and all(
        line.startswith(f"[node {node}/") for line in proc.stdout.splitlines()
    ), proc.stdout


def _other(host: str) -> str:
    """The dev cluster's other node."""
    return {"n1": "n2", "n2": "n1"}[host]


def test_a_cancelled_slurm_job_exits_143_from_status_watch_and_submit_wait(
    slurm_cluster: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    """One meaning per exit code on every cluster: a cancel is 143 (a local cancel's
    code too), not Slurm's 1, and not 42 although the ranks save on scancel's TERM."""
    name = "cancel-watched"
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_spec(name, train={"steps": 2000})))
    waiting = subprocess.Popen(
        [*SHARDCTL, "submit", str(path), "--cluster", "slurm", "--wait"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    watching: subprocess.Popen[str] | None = None
    try:
        ref = _wait_for_record(name, waiting)
        _wait(ref, lambda: len(_steps(Path(ref.run_dir))) >= 3, 180, "step 3")
        watching = subprocess.Popen(
            [*SHARDCTL, "status", name, "--watch", "--interval", "0.5"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        cancel = subprocess.run(
            [*SHARDCTL, "cancel", name], capture_output=True, text=True, timeout=60
        )
        assert cancel.returncode == 0, cancel.stderr
        watched_out, watched_err = watching.communicate(timeout=180)
        assert watching.returncode == 143, watched_out + watched_err
        waited_out, waited_err = waiting.communicate(timeout=180)
        assert waiting.returncode == 143, waited_out[-3000:] + waited_err
        assert f"{name}: CANCELLED" in waited_err
        assert SlurmCluster().status(ref).state is JobState.CANCELLED
    finally:
        for proc in (waiting, watching):
            if proc is not None and proc.poll() is None:
                kill_group(proc)
                proc.communicate()


def _wait_for_record(name: str, submitting: subprocess.Popen[str]) -> JobRef:
    """The job record `submit` writes once Slurm took the job (deadline-bounded)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(ShardctlError):
            return recall(name)
        assert submitting.poll() is None, submitting.communicate()
        time.sleep(0.5)
    raise AssertionError(f"submit recorded no job {name!r} in 120 s")
