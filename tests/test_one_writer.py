"""One writer per run: `submit` refuses while another job of the same run dir is live
(`clusters/owner.py`), replaces it on `--replace`, and two submits cannot interleave
(the run dir's submit claim). Real local jobs: a script that says it started and
holds until the test lets it go."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from helpers.ckpt_run import free_port
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.clusters.base import JobRef, JobState
from shardctl.orchestrator.clusters.local import LocalCluster
from shardctl.orchestrator.clusters.owner import submit_claim
from shardctl.orchestrator.clusters.records import jobs_dir, recall, remember
from shardctl.orchestrator.errors import ClusterError
from shardctl.orchestrator.fence import current_attempt
from shardctl.orchestrator.proctree import alive
from shardctl.orchestrator.rundir import SUBMIT_CLAIM_FILE

# A job's start on a loaded 2-core machine (torchrun, the watchdog, the entry).
DEADLINE_S = 300.0
HOLD = """
import sys, time
from pathlib import Path
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.write_text("started\\n")
deadline = time.monotonic() + 600
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _spec(tmp_path: Path, name: str, run: str = "run", *extra: str) -> Path:
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    data = {
        "name": name,
        "run_dir": str(tmp_path / run),
        "resources": {"procs_per_node": 1},
        "entrypoint": {
            "script": str(script),
            "args": [str(tmp_path / "ready"), str(tmp_path / "go"), *extra],
        },
        "local": {"master_port": free_port()},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _wait(cond, what: str, ref: JobRef | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        if ref is not None and LocalCluster().status(ref).state is not JobState.RUNNING:
            pytest.fail(f"{ref.name} ended before {what}: {LocalCluster().logs(ref, tail=40)}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _ended(ref: JobRef) -> bool:
    return LocalCluster().status(ref).state is not JobState.RUNNING


def _stop(refs: list[JobRef]) -> None:
    """Never leave a job behind: cancel (by its recorded pid) what still runs."""
    for ref in refs:
        if not _ended(ref):
            LocalCluster().cancel(ref, grace_s=10)


def _submit(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, ["submit", *args])


def test_a_live_run_refuses_a_second_submit_naming_it_until_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, "one")
    res = _submit(str(spec))
    assert res.exit_code == 0, res.output
    first = recall("one")
    refs = [first]
    try:
        _wait((tmp_path / "ready").exists, "the job to start", first)
        again = _submit(str(spec))
        assert again.exit_code == 1, again.output
        text = " ".join(again.output.split())
        assert f"run dir {tmp_path / 'run'} belongs to a live job" in text
        assert f"'one' on local, job id {first.job_id}, RUNNING" in text
        assert "--replace" in text and "shardctl cancel one" in text
        # Another name, the same run dir: refused just as well, naming the live job.
        other = _submit(str(_spec(tmp_path, "other")))
        assert other.exit_code == 1 and "'one' on local" in other.output, other.output
        assert recall("one").job_id == first.job_id  # its record still names the live job
        assert not (tmp_path / "run" / SUBMIT_CLAIM_FILE).exists()  # the claim was let go
        (tmp_path / "go").write_text("go\n")
        _wait(lambda: _ended(first), "the job to end")
        assert LocalCluster().status(first).state is JobState.SUCCEEDED
        # The same command again: the run succeeded, there is nothing to do.
        res = _submit(str(spec))
        assert res.exit_code == 0 and "run complete" in res.output, res.output
        assert recall("one").job_id == first.job_id
        # Ended: the run dir is free again for another command.
        res = _submit(str(_spec(tmp_path, "one", "run", "again")))
        assert res.exit_code == 0, res.output
        refs.append(recall("one"))
        assert refs[1].job_id != first.job_id
        _wait(lambda: _ended(refs[1]), "the second job to end")
        assert current_attempt(tmp_path / "run")["attempt"] == 1  # a second attempt
    finally:
        _stop(refs)


def test_replace_cancels_the_live_job_then_submits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, "one")
    assert _submit(str(spec)).exit_code == 0
    first = recall("one")
    refs = [first]
    try:
        _wait((tmp_path / "ready").exists, "the job to start", first)
        (tmp_path / "ready").unlink()
        res = _submit(str(spec), "--replace")
        assert res.exit_code == 0, res.output
        assert f"replacing 'one' on local, job id {first.job_id}, RUNNING" in res.output
        refs.append(recall("one"))
        assert refs[1].job_id != first.job_id
        # Local status reads the run dir (now the new job's): the old supervisor is gone.
        assert not alive(int(first.job_id))
        _wait((tmp_path / "ready").exists, "the new job to start", refs[1])
    finally:
        (tmp_path / "go").write_text("go\n")
        _stop(refs)


def test_a_job_whose_status_cannot_be_read_blocks_and_says_how_to_proceed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # A record of a cluster this installation no longer has (an uninstalled plugin).
    remember(JobRef(cluster="gone-plugin", job_id="7", name="old", run_dir=str(tmp_path / "run")))
    res = _submit(str(_spec(tmp_path, "one")))
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "'old' on gone-plugin, job id 7: its status cannot be read" in text
    assert f"delete its record in {jobs_dir()} (old.json)" in text
    assert not (tmp_path / "run" / "launch.sh").exists()  # nothing was started


def test_the_submit_claim_refuses_a_live_holder_and_takes_over_a_dead_one(
    tmp_path: Path,
) -> None:
    claim = tmp_path / SUBMIT_CLAIM_FILE
    with submit_claim(tmp_path):
        assert claim.is_file()
        held = f"pid {os.getpid()} on .* delete {claim}"
        with pytest.raises(ClusterError, match=held), submit_claim(tmp_path):
            pass
    assert not claim.exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    claim.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "since": 0.0}))
    with submit_claim(tmp_path):  # its holder is gone: taken over
        assert json.loads(claim.read_text())["pid"] == os.getpid()
    assert not claim.exists()
