"""Evidence belongs to the attempt that wrote it, never to the one nearest in time.

Two races a busy machine measured (issue 32, item 8), each forced here:

- two attempts in the same second: the first attempt's FAILED (or PREEMPTED) marker,
  with the same file time as the second attempt's start, was read as the second's.
  Every marker now carries its writer's attempt token (`SHARDCTL_ATTEMPT_TOKEN`) and
  a judge that knows its token reads only that token's markers; markers without one
  (older versions) are still read by their time;
- a node whose launcher fails once another node finished: node 1's torchrun lost the
  rendezvous store that lived on node 0 after node 0's ranks wrote DONE, and the node
  task raised (the job did not end SUCCEEDED). A DONE of this attempt's token, with no
  FAILED, HUNG or KILLED, is the run's end whatever the launcher's code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.node_task_run import SCRIPT as NODE_TASK
from shardctl.orchestrator.clusters.base import JobRef, JobState
from shardctl.orchestrator.clusters.local import EXIT_FILE, PID_FILE, LocalCluster
from shardctl.orchestrator.fence import claim_attempt
from shardctl.orchestrator.outcome import Evidence, Kind, classify, failed_marker
from shardctl.orchestrator.rundir import (
    DONE_FILE,
    ENV_ATTEMPT_TOKEN,
    EXIT_PREEMPTED,
    FAILED_FILE,
    PREEMPTED_FILE,
    RunDir,
)
from shardctl.train import entry

FIRST, SECOND = "local-codes-0-aaaa1111", "local-codes-1-bbbb2222"


def _as_attempt(monkeypatch: pytest.MonkeyPatch, token: str) -> None:
    """This test process acts as a rank (or supervisor) of the attempt `token`."""
    monkeypatch.setenv(ENV_ATTEMPT_TOKEN, token)


def _same_second(path: Path, when: float) -> None:
    """Give the marker the file time of the next attempt's start: the two attempts
    ran in the same second, so no time rule can tell them apart."""
    os.utime(path, (when, when))


def test_the_first_attempts_failed_in_the_same_second_is_not_the_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as_attempt(monkeypatch, FIRST)
    assert entry.write_failed(RunDir.of(tmp_path), time.time(), failed_marker(3, 1))
    second_started = time.time()
    _same_second(tmp_path / FAILED_FILE, second_started)
    _as_attempt(monkeypatch, SECOND)
    # The second attempt's launcher ended with torchrun's 1 and no rank wrote anything.
    evidence = Evidence.gather(tmp_path, second_started, 1)
    assert FAILED_FILE not in evidence.markers
    out = classify(evidence)
    assert (out.kind, out.code, out.rank) == (Kind.FAILED, 1, None)
    # A rank of the second attempt that fails names its own cause: the first attempt's
    # marker is replaced, not kept as if a rank of this attempt had been first.
    assert entry.write_failed(RunDir.of(tmp_path), second_started, failed_marker(5, 0))
    out = classify(Evidence.gather(tmp_path, second_started, 1))
    assert (out.kind, out.code, out.rank) == (Kind.FAILED, 5, 0)
    assert json.loads((tmp_path / FAILED_FILE).read_text())["token"] == SECOND


def test_a_scripts_exit_42_is_this_attempts_preemption_not_the_last_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = RunDir.of(tmp_path)
    _as_attempt(monkeypatch, FIRST)
    folder.write_marker(
        PREEMPTED_FILE, {"kind": "preempted", "step": 10, "signal": "SIGUSR2", "reason": "x"}
    )
    second_started = time.time()
    _same_second(tmp_path / PREEMPTED_FILE, second_started)
    _as_attempt(monkeypatch, SECOND)
    entry.record(EXIT_PREEMPTED, second_started, str(tmp_path), 0)
    written = json.loads((tmp_path / PREEMPTED_FILE).read_text())
    assert written["token"] == SECOND and written["reason"] == "exit 42"
    out = classify(Evidence.gather(tmp_path, second_started, 1))
    assert (out.kind, out.step, out.signal) == (Kind.PREEMPTED, None, None)


def test_exit_42_of_a_rank_other_than_0_is_a_preemption_when_rank_0_was_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 exits 42 first; torchrun then stops rank 0 (TERM) before it records
    anything, and reports its own 1. The run saved for a preemption: not FAILED."""
    _as_attempt(monkeypatch, SECOND)
    started = time.time()
    entry.record(EXIT_PREEMPTED, started, str(tmp_path), 1)
    out = classify(Evidence.gather(tmp_path, started, 1))
    assert (out.kind, out.signal) == (Kind.PREEMPTED, None)
    # The checkpoint library's marker (rank 0, with the step) is never replaced.
    library = {"kind": "preempted", "step": 40, "signal": "SIGUSR2", "reason": "saved"}
    RunDir.of(tmp_path).write_marker(PREEMPTED_FILE, library)
    entry.record(EXIT_PREEMPTED, started, str(tmp_path), 1)
    assert classify(Evidence.gather(tmp_path, started, 1)).step == 40


def test_a_marker_without_a_token_is_still_read_by_its_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run dir an older version wrote: its markers name no token."""
    _as_attempt(monkeypatch, SECOND)
    started = time.time()
    (tmp_path / FAILED_FILE).write_text('{"kind": "failed", "code": 3, "rank": 1}\n')
    _same_second(tmp_path / FAILED_FILE, started)
    assert classify(Evidence.gather(tmp_path, started, 1)).code == 3
    _same_second(tmp_path / FAILED_FILE, started - 5.0)  # an earlier attempt's
    assert FAILED_FILE not in Evidence.gather(tmp_path, started, 1).markers


def test_local_status_judges_the_current_attempts_markers_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status` (and `submit --wait`'s exit code) of a start whose ranks wrote nothing
    while the start before it, in the same second, left FAILED code 3."""
    _as_attempt(monkeypatch, FIRST)
    assert entry.write_failed(RunDir.of(tmp_path), time.time(), failed_marker(3, 1))
    monkeypatch.delenv(ENV_ATTEMPT_TOKEN)  # `status` runs outside any attempt
    claim_attempt(tmp_path, SECOND, cluster="local", attempt=1)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    (tmp_path / PID_FILE).write_text(f"{gone.pid} 0\n")
    (tmp_path / EXIT_FILE).write_text("1\n")
    _same_second(tmp_path / FAILED_FILE, (tmp_path / PID_FILE).stat().st_mtime)
    ref = JobRef(cluster="local", job_id=str(gone.pid), name="codes", run_dir=str(tmp_path))
    st = LocalCluster().status(ref)
    assert st.state is JobState.FAILED and st.native_state == "exit 1", st
    assert LocalCluster().exit_code(ref) == 1


def test_a_done_of_this_attempt_then_a_failed_launcher_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as_attempt(monkeypatch, SECOND)
    started = time.time()
    RunDir.of(tmp_path).write_marker(DONE_FILE, {"kind": "done", "step": 600})
    out = classify(Evidence.gather(tmp_path, started, 1))
    assert (out.kind, out.step) == (Kind.DONE, 600)
    # An earlier attempt's DONE, written in the same second, is not this one's.
    (tmp_path / DONE_FILE).write_text(json.dumps({"kind": "done", "step": 600, "token": FIRST}))
    _same_second(tmp_path / DONE_FILE, started)
    assert classify(Evidence.gather(tmp_path, started, 1)).kind is Kind.FAILED
    # A rank of this attempt that failed after DONE still fails the run.
    RunDir.of(tmp_path).write_marker(DONE_FILE, {"kind": "done", "step": 600})
    entry.write_failed(RunDir.of(tmp_path), started, failed_marker(3, 1))
    assert classify(Evidence.gather(tmp_path, started, 1)).code == 3
    # A DONE without a token (an older version's) keeps today's reading: a failure.
    (tmp_path / FAILED_FILE).unlink()
    (tmp_path / DONE_FILE).write_text(json.dumps({"kind": "done", "step": 600}))
    assert classify(Evidence.gather(tmp_path, started, 1)).kind is Kind.FAILED


# ------------------------------------------------- a node whose launcher ends after DONE

# Node 1's stand-in torchrun: its ranks finished, then it waits for the run's end
# (node 0's ranks write DONE) and fails as torchrun does once the rendezvous store
# that lived on node 0 is gone. It says when it is running, so the test writes DONE
# while this launcher is still up.
NODE1_LAUNCHER = """#!/bin/bash
echo "${SHARDCTL_ATTEMPT_TOKEN}" > "${FAKE_RUN}/node1-running"
deadline=$((SECONDS + 60))
while [ ! -e "${FAKE_RUN}/DONE" ] && [ "${SECONDS}" -lt "${deadline}" ]; do sleep 0.1; done
echo "torch.distributed.DistNetworkError: failed to recv, got 0 bytes" >&2
exit 1
"""


def _wait_for(path: Path, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.05)
    return path.read_text().strip()


def test_a_node_whose_launcher_fails_after_this_attempts_done_finished(
    tmp_path: Path,
) -> None:
    launch = tmp_path / "launch.sh"
    launch.write_text(NODE1_LAUNCHER)
    env = {
        **os.environ, "SLURM_NODEID": "1", "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2",
        "SLURM_JOB_NUM_NODES": "2", "FAKE_RUN": str(tmp_path),
    }  # fmt: skip
    env.pop(ENV_ATTEMPT_TOKEN, None)
    # An earlier requeue's DONE-less end left FAILED: not this attempt's either.
    (tmp_path / FAILED_FILE).write_text(
        json.dumps({"kind": "failed", "code": 3, "rank": 1, "token": "slurm-7-1"})
    )
    proc = subprocess.Popen(
        [sys.executable, str(NODE_TASK), str(launch), str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        token = _wait_for(tmp_path / "node1-running", 60)
        assert token == "slurm-7-2"  # every node derives the attempt's token
        _same_second(tmp_path / FAILED_FILE, time.time())
        # Node 0's rank 0 finishes the run: DONE, with the attempt's token.
        (tmp_path / DONE_FILE).write_text(
            json.dumps({"kind": "done", "step": 600, "token": token}) + "\n"
        )
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert "RESULT finished" in out, out


def test_a_local_cancel_is_evidence_of_the_current_attempt(tmp_path: Path) -> None:
    claim_attempt(tmp_path, SECOND, cluster="local", attempt=1)
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        (tmp_path / PID_FILE).write_text(f"{sleeper.pid}\n")
        ref = JobRef(cluster="local", job_id=str(sleeper.pid), name="c", run_dir=str(tmp_path))
        LocalCluster().cancel(ref, grace_s=20)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
    marker = json.loads((tmp_path / "CANCELLED").read_text())
    assert (marker["kind"], marker["token"]) == ("cancelled", SECOND)


def test_the_local_supervisor_judges_progress_by_the_step_it_started_from(
    tmp_path: Path,
) -> None:
    """The local node agent is given the newest step when its start began (`schedule`
    reads it once the start's token is claimed): step 20's manifest, written by a clock
    an hour ahead, is still no progress of this start."""
    manifest = tmp_path / "checkpoints" / "step-00000020" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{}")
    os.utime(manifest, (time.time() + 3600,) * 2)
    launch = tmp_path / "launch.sh"
    hung = '{"kind": "hung", "step": 25, "node": 0}'
    launch.write_text(f'echo \'{hung}\' > "$(dirname "$0")/HUNG"; exit 124\n')
    env = {k: v for k, v in os.environ.items() if k != ENV_ATTEMPT_TOKEN}
    args = [
        "--run-dir", str(tmp_path), "--launch", str(launch), "--out", str(tmp_path / "out"),
        "--err", str(tmp_path / "err"), "--nodes", "1", "--job", "local-0",
        "--checkpoint-dir", str(manifest.parent.parent), "--start-step", "20",
    ]  # fmt: skip
    agent = [sys.executable, "-m", "shardctl.orchestrator.agent", *args]
    proc = subprocess.run(agent, env=env, timeout=120)
    assert proc.returncode == 124, (tmp_path / "err").read_text()
    line = json.loads((tmp_path / "attempts.jsonl").read_text().splitlines()[-1])
    assert (line["job"], line["checkpoint_step"], line["advanced"]) == ("local-0", 20, False)


# ----------------------------------------------------------- Slurm status, by token


def _slurm_hung(run_dir: Path, token: str | None, written: float, attempt: int = 0) -> None:
    marker = {"kind": "hung", "step": 9, "node": 1, "rank": 1, "first": [1],
              "attempt": attempt, "time": written}  # fmt: skip
    if token is not None:
        marker["token"] = token
    (run_dir / "HUNG").write_text(json.dumps(marker))


def test_slurm_status_of_a_finished_job_takes_its_own_hung_by_token(tmp_path: Path) -> None:
    """sacct's view of a job that FAILED: a HUNG written by a round of that job is its
    own, whatever time a skewed clock gave it; one of another job of the run, written
    in this job's first second, is not. A tokenless marker (an older version's) still
    goes by its time."""
    from shardctl.orchestrator.clusters import slurm as backend
    from shardctl.orchestrator.clusters.slurm.rounds import round_token

    ref = JobRef("slurm", "41", "hangs", str(tmp_path))
    began = time.time() - 600
    line = "FAILED|1:0|n[1-2]|" + time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(began))
    _slurm_hung(tmp_path, round_token("41", 1, 2), written=began - 86400)  # clock behind
    assert "hung: no rank advanced" in backend._accounted_status(ref, line).detail
    _slurm_hung(tmp_path, round_token("40", 0, 0), written=began)  # the job before
    assert "hung" not in backend._accounted_status(ref, line).detail
    _slurm_hung(tmp_path, None, written=began)
    assert "hung: no rank advanced" in backend._accounted_status(ref, line).detail
    _slurm_hung(tmp_path, None, written=began - 3600)
    assert "hung" not in backend._accounted_status(ref, line).detail


def test_slurm_status_of_a_held_job_takes_the_last_requeues_hung_by_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scontrol's view of a job requeued once: the last attempt is requeue 0. A HUNG
    of job 41's requeue 0 is it; one of another job whose attempt number is also 0 is
    not (the attempt number alone was matched before tokens)."""
    from shardctl.orchestrator.clusters import slurm as backend
    from shardctl.orchestrator.clusters.slurm.rounds import round_token

    info = {"JobState": "RUNNING", "Restarts": "1", "NodeList": "n[1-2]", "Reason": "None"}
    monkeypatch.setattr(backend, "scontrol_job", lambda job_id: info)
    ref = JobRef("slurm", "41", "hangs", str(tmp_path))
    _slurm_hung(tmp_path, round_token("41", 0, 1), written=time.time(), attempt=7)
    assert "last attempt hung at step 9" in backend._held_status(ref, info).detail
    _slurm_hung(tmp_path, round_token("40", 0, 0), written=time.time(), attempt=0)
    assert "hung" not in backend._held_status(ref, info).detail
    _slurm_hung(tmp_path, None, written=time.time(), attempt=0)  # an older version's
    assert "last attempt hung at step 9" in backend._held_status(ref, info).detail


def test_another_attempts_cancel_in_the_same_second_is_not_this_attempts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `cancel` of the first attempt (its token) in the second the next one starts:
    the second attempt was not cancelled. An older version's CANCELLED (a timestamp,
    no JSON, no token) is still read by its time."""
    monkeypatch.delenv(ENV_ATTEMPT_TOKEN, raising=False)
    started = time.time()
    (tmp_path / "CANCELLED").write_text(json.dumps({"kind": "cancelled", "token": FIRST}))
    _same_second(tmp_path / "CANCELLED", started)
    out = classify(Evidence.gather(tmp_path, started, 1, token=SECOND))
    assert out.kind is Kind.FAILED, out
    (tmp_path / "CANCELLED").write_text(f"{started}\n")
    _same_second(tmp_path / "CANCELLED", started)
    assert classify(Evidence.gather(tmp_path, started, 143, token=SECOND)).kind is Kind.CANCELLED
    _same_second(tmp_path / "CANCELLED", started - 60)
    assert "CANCELLED" not in Evidence.gather(tmp_path, started, 1, token=SECOND).markers


def test_a_reader_with_no_start_still_leaves_out_another_tokens_markers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m ...outcome` without `--since` reads every marker there, but one
    written by another attempt (its token) is not this one's."""
    monkeypatch.delenv(ENV_ATTEMPT_TOKEN, raising=False)
    _as_attempt(monkeypatch, FIRST)
    assert entry.write_failed(RunDir.of(tmp_path), time.time(), failed_marker(3, 1))
    monkeypatch.delenv(ENV_ATTEMPT_TOKEN)
    assert FAILED_FILE not in Evidence.gather(tmp_path, None, 1, token=SECOND).markers
    assert Evidence.gather(tmp_path, None, 1, token=FIRST).markers[FAILED_FILE]["code"] == 3
