"""Fencing by attempt: a rank of an attempt that is no longer the run's current one
never publishes a checkpoint (`orchestrator/fence.py`, `train/storage.py`).

The race: two real processes, each saving through a real CheckpointManager, both
stopped just before the publish; the stale one is ahead (step 20, as a rank that
outlived a requeue would be), the current one resumed behind it (step 10). Released
together, only the current attempt's checkpoint appears.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from shardctl.orchestrator.checkpoint_list import complete_checkpoints
from shardctl.orchestrator.fence import (
    AttemptFence,
    StaleAttemptError,
    claim_attempt,
    current_attempt,
    new_token,
)
from shardctl.orchestrator.rundir import ENV_ATTEMPT_TOKEN, ENV_RUN_DIR
from shardctl.train.manifest import list_checkpoints, step_dirname, verify
from shardctl.train.storage import PosixStorage

HELPER = Path(__file__).parent / "helpers" / "fence_writer.py"
# Two torch processes starting on a loaded machine.
DEADLINE_S = 300.0


def _wait_for(path: Path, procs: list[subprocess.Popen[str]], deadline: float) -> None:
    while not path.exists():
        for proc in procs:
            if proc.poll() is not None:
                _out, err = proc.communicate()
                pytest.fail(f"writer {proc.args} ended early ({proc.returncode}): {err[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {DEADLINE_S} s")
        time.sleep(0.05)


def _writer(run: Path, token: str, step: int, tmp: Path) -> subprocess.Popen[str]:
    env = {**os.environ, ENV_RUN_DIR: str(run), ENV_ATTEMPT_TOKEN: token}
    return subprocess.Popen(
        [sys.executable, str(HELPER), "--ckpt", str(run / "checkpoints"), "--step", str(step),
         "--ready", str(tmp / f"ready-{step}"), "--go", str(tmp / "go")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_stale_writer_cannot_publish_while_the_current_attempt_does(tmp_path: Path) -> None:
    run = tmp_path / "run"
    old, new = new_token("local", "fence", 0), new_token("local", "fence", 1)
    claim_attempt(run, old, attempt=0)
    procs: list[subprocess.Popen[str]] = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        procs.append(_writer(run, old, 20, tmp_path))
        _wait_for(tmp_path / "ready-20", procs, deadline)  # staged, about to publish
        claim_attempt(run, new, attempt=1)  # a new attempt of the run starts
        procs.append(_writer(run, new, 10, tmp_path))
        _wait_for(tmp_path / "ready-10", procs, deadline)
        (tmp_path / "go").write_text("go\n")  # both publish at once
        results = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    (_stale_out, stale_err), (cur_out, cur_err) = results
    assert procs[0].returncode == 3, stale_err
    assert "not publishing step-00000020" in stale_err and old in stale_err, stale_err
    assert procs[1].returncode == 0, cur_err
    assert "published" in cur_out
    found = {Path(c.path).name: c.complete for c in list_checkpoints(run / "checkpoints")}
    assert found.get(step_dirname(10)) is True, found
    assert step_dirname(20) not in found, found  # never published (its staging may stay)
    assert not (run / "checkpoints" / step_dirname(20)).exists()
    assert verify(run / "checkpoints" / step_dirname(10)) == []
    assert current_attempt(run)["token"] == new


def test_the_storage_refuses_before_the_rename_and_leaves_the_staging(tmp_path: Path) -> None:
    run = tmp_path / "run"
    claim_attempt(run, "mine")
    fence = AttemptFence(run, "mine")
    storage = PosixStorage(run / "checkpoints", durable=False, fence=fence.check)
    staged = storage.new_staging("step-00000001")
    (staged / "manifest.json").write_text("{}")
    claim_attempt(run, "theirs")  # a newer attempt took over meanwhile
    with pytest.raises(StaleAttemptError, match="no longer the current attempt"):
        storage.publish("step-00000001")
    assert complete_checkpoints(storage) == []
    assert (staged / "manifest.json").is_file()  # it may be the new attempt's: left alone
    with pytest.raises(StaleAttemptError):
        storage.new_staging("step-00000002")  # a stale rank does not even start a save
    assert not storage.staging_path("step-00000002").exists()
    claim_attempt(run, "mine")
    assert storage.publish("step-00000001") == run / "checkpoints" / "step-00000001"


def test_no_token_no_fence_and_a_missing_record_is_stale(tmp_path: Path) -> None:
    assert AttemptFence.from_env({ENV_RUN_DIR: str(tmp_path)}) is None
    fence = AttemptFence.from_env({ENV_RUN_DIR: str(tmp_path), ENV_ATTEMPT_TOKEN: "t"})
    assert fence == AttemptFence(tmp_path, "t")
    with pytest.raises(StaleAttemptError, match="no attempt is recorded"):
        fence.check("step-00000001")
