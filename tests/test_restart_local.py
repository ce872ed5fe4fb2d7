"""Restarts inside the allocation on the local cluster: one real run (torchrun, 2 tiny
ranks) in which a rank is SIGKILLed after the first checkpoint and, later, a rank of
the restarted ranks is SIGSTOPped. The supervisor restarts every rank by itself both
times (a new attempt token each time), the ranks resume from the newest complete
checkpoint, and the run finishes SUCCEEDED; attempts.jsonl records the two restarts,
and `status -o json`'s goodput counts them (two recoveries, some time lost)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers.local_run import (
    attempt_rows,
    ended,
    past_first_checkpoint,
    rank_pids,
    status,
    submit_tiny,
    succeeded,
    wait_for,
)
from helpers.recovery import recovered
from shardctl.orchestrator.fence import current_attempt

pytestmark = pytest.mark.slow

HANG_TIMEOUT_S = 15
STEPS = 200


def _out(run_dir: Path) -> str:
    try:
        return (run_dir / "logs" / "launcher.out").read_text()
    except OSError:
        return ""


@pytest.mark.timeout(900)
def test_a_killed_rank_then_a_stopped_rank_restart_in_place_and_the_run_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = submit_tiny(
        tmp_path, monkeypatch, "restarts", steps=STEPS, hang_timeout_s=HANG_TIMEOUT_S,
        max_in_allocation=3,
    )  # fmt: skip
    run_dir = job.run_dir
    took: list[float] = []
    with past_first_checkpoint(job) as stopped:
        first_token = current_attempt(run_dir)["token"]
        ranks = rank_pids(run_dir, 0, restart=0)
        assert sorted(ranks) == [0, 1], ranks
        # A crash: rank 1 killed. torchrun ends rank 0 and exits 1; the supervisor
        # restarts both ranks, which resume from the checkpoint.
        fault = time.time()
        os.kill(ranks[1], signal.SIGKILL)
        back = recovered(run_dir, lambda: _out(run_dir), 1, fault)
        wait_for("the first restart's first step", back, 400)
        took.append(back() or 0.0)
        assert status("restarts")["state"] == "RUNNING"
        second_token = current_attempt(run_dir)["token"]
        assert second_token == f"{first_token}-r1"
        # A hang: a rank of the restarted ranks stopped for good; the node watchdog
        # ends them (124) and the supervisor restarts every rank again.
        again = rank_pids(run_dir, 0, restart=1)
        assert sorted(again) == [0, 1] and set(again.values()).isdisjoint(ranks.values())
        fault = time.time()
        os.kill(again[0], signal.SIGSTOP)
        stopped.append(again[0])
        back = recovered(run_dir, lambda: _out(run_dir), 2, fault)
        wait_for("the second restart's first step", back, HANG_TIMEOUT_S + 400)
        took.append(back() or 0.0)
        assert current_attempt(run_dir)["token"] == f"{first_token}-r2"
        wait_for("the end", ended("restarts"), 600)
    print(f"fault -> first step of the restarted ranks: {took[0]:.1f} s (SIGKILL), "
          f"{took[1]:.1f} s (SIGSTOP, hang timeout {HANG_TIMEOUT_S} s)")  # fmt: skip
    st, out = succeeded(job)
    assert json.loads((run_dir / "DONE").read_text())["step"] == STEPS
    attempts = attempt_rows(run_dir)
    assert [(a["restart"], a["kind"], a["decision"]) for a in attempts] == [
        (0, "failed", "restart"), (1, "hung", "restart"), (2, "done", "finish"),
    ], attempts  # fmt: skip
    assert attempts[0]["advanced"] is True  # the first checkpoint came before the kill
    # Goodput: both faults are restarts with a recovery each, and their time is lost.
    good = st["goodput"]
    assert good["restarts"] == 2, good
    assert [r["kind"] for r in good["recoveries"]] == ["failed", "hung"], good
    assert all(r["seconds"] > 0 for r in good["recoveries"]), good
    assert 0 < good["effective"] < 1, good
    # Both restarts resumed from a complete checkpoint, never from step 0 again.
    assert out.count("resumed at step") == 2 and out.count("starting at step 0") == 1
    err = (run_dir / "logs" / "launcher.err").read_text()
    assert "restarting every rank in this allocation (1 of at most 3)" in err
    assert "restarting every rank in this allocation (2 of at most 3)" in err
    assert list((run_dir / "logs").glob("hang-attempt0-restart1-node0.txt"))
    assert not any(rank_pids(run_dir, 0).values())  # nothing of any restart left
    with contextlib.suppress(ProcessLookupError):  # the stopped rank was killed
        os.kill(stopped[0], 0)
        pytest.fail(f"the stopped rank {stopped[0]} outlived its restart")
