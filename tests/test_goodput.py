"""Goodput (orchestrator/goodput.py) from hand-written attempts.jsonl + metrics.jsonl,
and what `status`, `status -o json` and `ls` show of it. Every expected number is
worked out by hand in the test from the fixture's times (one step per second unless
said otherwise), never by the code under test."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.clusters.base import JobRef
from shardctl.orchestrator.clusters.records import remember
from shardctl.orchestrator.goodput import goodput

T0 = 1_000_000.0  # the fixtures' clock starts here


def attempt(job: str, start: float, end: float, kind: str, decision: str, ckpt: int | None):
    return {
        "job": job, "attempt": 0, "restart": 0, "start": T0 + start, "end": T0 + end,
        "time": T0 + end, "kind": kind, "decision": decision, "checkpoint_step": ckpt,
        "advanced": True, "summary": kind,
    }  # fmt: skip


def steps(first: int, last: int, at: float) -> list[dict[str, Any]]:
    """Step records `first..last`, one per second, the first at `at`."""
    return [{"step": s, "loss": 1.0, "time": T0 + at + s - first} for s in range(first, last + 1)]


def run_dir(root: Path, lines: list[Any], rows: list[Any], steps_total: int = 10) -> Path:
    (root / "logs").mkdir(parents=True)
    (root / "job.yaml").write_text(yaml.safe_dump({"name": root.name,
                                                   "train": {"steps": steps_total}}))  # fmt: skip
    (root / "attempts.jsonl").write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    )
    (root / "logs" / "metrics.jsonl").write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in rows)
    )
    return root


def measure(root: Path, job: str = "7", **kw: Any) -> dict[str, Any]:
    good = goodput(root, job, now=kw.pop("now", T0 + 10_000), **kw)
    assert good is not None
    return good.to_json()


def test_a_clean_run_is_all_goodput(tmp_path: Path) -> None:
    # Started at 0, steps 1..10 logged at 1..10 s, done at 10 s: the first step took
    # its second (the others' pace), no start-up beyond it.
    root = run_dir(tmp_path / "r", [attempt("7", 0, 10, "done", "finish", 10)], steps(1, 10, 1))
    g = measure(root)
    assert g["effective"] == 1.0
    assert (g["training_s"], g["wall_s"]) == (10.0, 10.0)
    assert (g["restarts"], g["lost_steps"], g["recoveries"], g["notes"]) == (0, 0, [], [])


def test_start_up_is_not_training(tmp_path: Path) -> None:
    # The same steps, but the attempt started 5 s before the first one's second.
    root = run_dir(tmp_path / "r", [attempt("7", -5, 10, "done", "finish", 10)], steps(1, 10, 1))
    assert measure(root)["effective"] == pytest.approx(10 / 15, abs=1e-4)


def test_a_crash_loses_the_steps_past_the_checkpoint(tmp_path: Path) -> None:
    # Attempt 1: steps 1..7 at 1..7 s, checkpoint at 4, killed, judged at 8 s.
    # Attempt 2: started at 8 s, resumed from 4, start-up until 14 s, steps 5..10 at
    # 15..20 s, done at 20 s. Kept: 1..4 (4 s) + 5..10 (6 s) = 10 s of 8 + 12 = 20 s.
    root = run_dir(
        tmp_path / "r",
        [attempt("7", 0, 8, "failed", "restart", 4), attempt("7", 8, 20, "done", "finish", 10)],
        steps(1, 7, 1) + steps(5, 10, 15),
    )
    g = measure(root)
    assert g["effective"] == 0.5
    assert (g["restarts"], g["lost_steps"]) == (1, 7 - 4)
    assert g["recoveries"] == [{"kind": "failed", "seconds": 15.0 - 8.0}]


def test_a_restart_recorded_in_whole_seconds_owns_none_of_the_last_steps(tmp_path: Path) -> None:
    # As test_a_crash_..., but steps 1..7 logged at 1.7..7.7 s and the restart's start
    # recorded as 7 s (whole seconds, rounded down; it began at the judgement, 8 s).
    # Step 7 at 7.7 s is the crashed attempt's: recovery 15 - 8 = 7 s (not 0), wall
    # 8 + 12 = 20 s, kept 1..4 (4 s) + 5..10 (6 s) = 10 s. (From a CI run: 0.0 s.)
    root = run_dir(
        tmp_path / "r",
        [attempt("7", 0, 8, "failed", "restart", 4), attempt("7", 7, 20, "done", "finish", 10)],
        steps(1, 7, 1.7) + steps(5, 10, 15),
    )
    g = measure(root)
    assert g["recoveries"] == [{"kind": "failed", "seconds": 7.0}]
    assert (g["effective"], g["wall_s"], g["lost_steps"]) == (0.5, 20.0, 3)


def test_a_hang_counts_its_silent_time_as_lost(tmp_path: Path) -> None:
    # Steps 1..6 at 1..6 s, checkpoint at 4, then silent until the watchdog at 20 s.
    # The restart resumes from 4: steps 5..8 at 23..26 s, done at 26 s.
    # Kept: 4 s + 4 s = 8 s of 20 + 6 = 26 s; lost 6 - 4 = 2 steps.
    root = run_dir(
        tmp_path / "r",
        [attempt("7", 0, 20, "hung", "restart", 4), attempt("7", 20, 26, "done", "finish", 8)],
        steps(1, 6, 1) + steps(5, 8, 23),
    )
    g = measure(root)
    assert g["effective"] == pytest.approx(8 / 26, abs=1e-4)
    assert (g["restarts"], g["lost_steps"]) == (1, 2)
    assert g["recoveries"] == [{"kind": "hung", "seconds": 3.0}]


def test_a_preemption_then_a_requeue(tmp_path: Path) -> None:
    # Slurm job 55: steps 1..5 at 1..5 s, saved at 5 on the warning, ended at 6 s;
    # requeued, started again at 100 s, steps 6..9 at 102..105 s, done at 105 s.
    # The wait in the queue is no attempt's time: kept 5 + 4 = 9 s of 6 + 5 = 11 s.
    root = run_dir(
        tmp_path / "r",
        [attempt("55", 0, 6, "preempted", "retry", 5),
         attempt("55", 100, 105, "done", "finish", 9)],
        steps(1, 5, 1) + steps(6, 9, 102),
    )  # fmt: skip
    g = measure(root, "55")
    assert g["effective"] == pytest.approx(9 / 11, abs=1e-4)
    assert (g["restarts"], g["lost_steps"]) == (1, 0)
    assert g["recoveries"] == [{"kind": "preempted", "seconds": 102.0 - 6.0}]


def test_another_job_of_the_run_dir_is_not_this_one_s(tmp_path: Path) -> None:
    # Job 6 ran steps 1..4 earlier (checkpoint 4); job 7 resumes from 4: steps 5..10.
    root = run_dir(
        tmp_path / "r",
        [attempt("6", 0, 4, "preempted", "stop", 4), attempt("7", 50, 56, "done", "finish", 10)],
        steps(1, 4, 1) + steps(5, 10, 51),
    )
    g = measure(root)
    # Step 5 at 51 s took a second like the others: 6 s of 6 s, nothing of job 6.
    assert (g["effective"], g["wall_s"], g["restarts"]) == (1.0, 6.0, 0)


def test_corrupt_lines_are_left_out_and_said(tmp_path: Path) -> None:
    root = run_dir(
        tmp_path / "r",
        ['{"job": "7", "start": ', attempt("7", 0, 10, "done", "finish", 10), "[1, 2]"],
        ["not json", *steps(1, 10, 1), '{"step": "x"}', '{"step": 3, "time": "soon"}'],
    )
    g = measure(root)
    assert g["effective"] == 1.0
    assert g["notes"] == ["2 lines of attempts.jsonl could not be read"]


def test_missing_files_and_old_lines(tmp_path: Path) -> None:
    assert goodput(tmp_path / "nowhere", "7", now=T0) is None
    # A line from before start/end were recorded: counted as a restart, no times.
    old = {"job": "7", "time": T0 + 5, "kind": "failed", "decision": "restart"}
    root = run_dir(tmp_path / "r", [old], [])
    g = measure(root)
    assert (g["effective"], g["restarts"]) == (None, 1)
    assert g["notes"] == ["1 attempt recorded without times"]
    # Times, but no metrics file: the training time is unknown, not zero.
    root = run_dir(tmp_path / "m", [attempt("7", 0, 10, "done", "finish", 10)], [])
    (root / "logs" / "metrics.jsonl").unlink()
    g = measure(root)
    assert g["effective"] is None and g["wall_s"] == 10.0
    assert g["notes"] == ["no readable logs/metrics.jsonl: training time unknown"]


def test_a_running_job_counts_up_to_now(tmp_path: Path) -> None:
    # Crashed at 8 s (checkpoint 4); the restart claimed its attempt at 9 s and logged
    # steps 5..6 at 15..16 s; now is 30 s. Kept 4 s + 2 s = 6 s of 8 + (30 - 9) = 29 s.
    root = run_dir(
        tmp_path / "r", [attempt("7", 0, 8, "failed", "restart", 4)],
        steps(1, 7, 1) + steps(5, 6, 15),
    )  # fmt: skip
    (root / "CURRENT_ATTEMPT").write_text('{"token": "t-r1"}\n')
    os.utime(root / "CURRENT_ATTEMPT", (T0 + 9, T0 + 9))
    g = measure(root, running=True, now=T0 + 30)
    assert g["effective"] == pytest.approx(6 / 29, abs=1e-4)
    assert (g["restarts"], g["lost_steps"]) == (1, 3)
    assert g["recoveries"] == [{"kind": "failed", "seconds": 7.0}]
    # Still recovering (no step since the restart): the recovery so far.
    root = run_dir(tmp_path / "s", [attempt("7", 0, 8, "failed", "restart", 4)], steps(1, 7, 1))
    g = measure(root, running=True, now=T0 + 20)
    assert g["recoveries"] == [{"kind": "failed", "seconds": 12.0}]


def test_a_running_jobs_open_attempt_starts_at_its_own_claim_only(tmp_path: Path) -> None:
    """The open attempt starts at the run's CURRENT_ATTEMPT claim when the claim names
    this job; a claim naming another job of the run (however close in time) is not its
    start: then the end of its attempt before (8 s) is."""
    root = run_dir(tmp_path / "r", [attempt("7", 0, 8, "failed", "restart", 4)], steps(1, 7, 1))
    claim = root / "CURRENT_ATTEMPT"
    claim.write_text(json.dumps({"token": "slurm-8-0", "job_id": "8"}))
    os.utime(claim, (T0 + 20, T0 + 20))
    assert measure(root, running=True, now=T0 + 30)["wall_s"] == 30.0
    claim.write_text(json.dumps({"token": "slurm-7-0-r1", "job_id": "7"}))
    os.utime(claim, (T0 + 9, T0 + 9))
    assert measure(root, running=True, now=T0 + 30)["wall_s"] == 29.0
    claim.write_text(json.dumps({"token": "local-x-3-ab", "job": "local-3"}))
    os.utime(claim, (T0 + 9, T0 + 9))
    assert measure(root, "local-3", running=True, now=T0 + 30)["wall_s"] == 21.0
    assert goodput(root, "local-4", running=True, now=T0 + 30) is None


# --------------------------------------------------------------------------- CLI


def crashed_run(root: Path, job: str) -> Path:
    """The crash fixture of `test_a_crash_loses_the_steps_past_the_checkpoint`, ended."""
    return run_dir(
        root,
        [attempt(job, 0, 8, "failed", "restart", 4), attempt(job, 8, 20, "done", "finish", 10)],
        steps(1, 7, 1) + steps(5, 10, 15),
    )


def test_status_prints_the_goodput_and_json_has_the_object(tmp_path: Path) -> None:
    run = crashed_run(tmp_path / "crash", "local-1")
    (run / "local.exit").write_text("0\n")
    (run / "DONE").write_text('{"kind": "done", "step": 10}\n')
    remember(JobRef("local", "9", "crash", str(run), {"attempt": 1}))
    res = CliRunner().invoke(cli, ["status", "crash"])
    assert res.exit_code == 0, res.output
    assert "SUCCEEDED" in res.output
    assert (
        "goodput 50 % (10s of 20s trained; 1 restart, 3 steps lost; recoveries: failed 7 s)"
        in res.output
    )
    res = CliRunner().invoke(cli, ["status", "crash", "-o", "json"])
    data = json.loads(res.stdout)["goodput"]
    assert {k: data[k] for k in ("effective", "restarts", "lost_steps", "recoveries")} == {
        "effective": 0.5, "restarts": 1, "lost_steps": 3,
        "recoveries": [{"kind": "failed", "seconds": 7.0}],
    }  # fmt: skip


def test_ls_has_a_goodput_column_blank_when_unknown(tmp_path: Path) -> None:
    run = crashed_run(tmp_path / "crash", "local-1")
    (run / "local.exit").write_text("0\n")
    remember(JobRef("local", "9", "crash", str(run), {"attempt": 1}))
    bare = tmp_path / "bare"
    (bare / "logs").mkdir(parents=True)
    (bare / "local.exit").write_text("1\n")
    remember(JobRef("local", "10", "bare", str(bare), {"attempt": 1}))
    res = CliRunner().invoke(cli, ["ls"])
    assert res.exit_code == 0, res.output
    head, *rows = res.output.splitlines()
    assert "GOODPUT" in head.split()
    column = head.index("GOODPUT")
    by_name = {row.split()[0]: row for row in rows if row.strip()}
    assert by_name["crash"][column:].startswith("50 %")
    assert by_name["bare"][column : column + len("GOODPUT")].strip() == ""
    listed = {j["name"]: j for j in json.loads(CliRunner().invoke(cli, ["ls", "-o", "json"])
                                               .stdout)["jobs"]}  # fmt: skip
    assert listed["crash"]["goodput"]["effective"] == 0.5 and listed["bare"]["goodput"] is None


def test_a_k8s_job_has_no_goodput_and_no_traceback(tmp_path: Path) -> None:
    from shardctl.orchestrator.cli.jobs import _goodput
    from shardctl.orchestrator.clusters import get_cluster

    # The run dir is on the cluster's volume: unknown here, even where a path exists.
    crashed_run(tmp_path / "far", "ns/far")
    ref = JobRef("k8s", "ns/far", "far", str(tmp_path / "far"), {"pvc": "runs"})
    assert _goodput(get_cluster("k8s"), ref, None) is None


# ------------------------------------------------------------- the memory tier


def restored(token: str | None, step: int, tier: str, at: float) -> dict[str, Any]:
    """A line of logs/restores.jsonl as rank 0 writes it (memory_tier.record_restore)."""
    return {"time": T0 + at, "token": token, "step": step, "tier": tier,
            "lost_steps": None, "seconds": 0.2, "refused": None}  # fmt: skip


def with_restores(root: Path, lines: list[dict[str, Any]]) -> Path:
    (root / "logs" / "restores.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def memory_restart(root: Path, restores: list[dict[str, Any]], tokens: bool = True) -> Path:
    """Durable checkpoints every 100 steps (none yet), a memory copy at step 5.
    Attempt 1 (token t-0): steps 1..7 at 1..7 s, killed, judged at 8 s.
    Attempt 2 (token t-1): restarted in place from memory at 5, steps 6..10 at
    10..14 s, done at 14 s (its final durable save: 10)."""
    first = attempt("7", 0, 8, "failed", "restart", None)
    second = attempt("7", 8, 14, "done", "finish", 10)
    if tokens:
        first["token"], second["token"] = "t-0", "t-1"
    return with_restores(run_dir(root, [first, second], steps(1, 7, 1) + steps(6, 10, 10)),
                         restores)  # fmt: skip


def test_a_restart_from_memory_loses_only_the_steps_past_the_copy(tmp_path: Path) -> None:
    # Resumed at 5 (memory), not 0 (no durable checkpoint): lost 7 - 5 = 2 steps, not 7.
    # Kept: 1..5 (5 s: the first step at the pace, 4 s between records) and 6..10
    # (the first at the pace, 1 s of its 2 s start-up, + 4 s) = 10 s of 8 + 6 = 14 s.
    # A line carrying another token, written inside attempt 2's span with another
    # step, is not attempt 2's: a token decides, never a time.
    root = memory_restart(
        tmp_path / "r",
        [restored("t-stale", 7, "memory", 9.0), restored("t-1", 5, "memory", 9.5)],
    )
    g = measure(root)
    assert (g["restarts"], g["lost_steps"]) == (1, 2)
    assert g["effective"] == pytest.approx(10 / 14, abs=1e-4)
    assert g["recoveries"] == [{"kind": "failed", "seconds": 2.0, "tier": "memory"}]


def test_a_restore_line_of_another_token_only_is_not_matched_by_time(tmp_path: Path) -> None:
    # The only restore line inside attempt 2's span carries another attempt's token:
    # attempt 2 resumed, as far as is known, from attempt 1's checkpoint (none: 0).
    root = memory_restart(tmp_path / "r", [restored("t-stale", 5, "memory", 9.5)])
    g = measure(root)
    assert g["lost_steps"] == 7
    assert g["recoveries"] == [{"kind": "failed", "seconds": 2.0}]


def test_tokenless_attempts_take_the_tokenless_restore_line_in_their_span(
    tmp_path: Path,
) -> None:
    # Neither the ledger nor the restore lines carry tokens (an older version; a pod):
    # the line written inside attempt 2 (at 9.5 s, between 8 and 14 s) is its own.
    root = memory_restart(tmp_path / "r", [restored(None, 5, "memory", 9.5)], tokens=False)
    g = measure(root)
    assert g["lost_steps"] == 2
    assert g["recoveries"] == [{"kind": "failed", "seconds": 2.0, "tier": "memory"}]


def test_a_running_attempt_takes_the_restore_line_of_its_claim(tmp_path: Path) -> None:
    # Attempt 1 as above; the restart in place (token t-1, claimed at 9 s) resumed from
    # memory at 5 and logged 6..8 at 10..12 s; now is 20 s. Lost 7 - 5 = 2 steps;
    # kept 5 s + (1 s + 2 s) = 8 s of 8 + (20 - 9) = 19 s.
    first = attempt("7", 0, 8, "failed", "restart", None) | {"token": "t-0"}
    root = run_dir(tmp_path / "r", [first], steps(1, 7, 1) + steps(6, 8, 10))
    with_restores(root, [restored("t-1", 5, "memory", 9.5)])
    (root / "CURRENT_ATTEMPT").write_text(json.dumps({"token": "t-1", "job": "7"}))
    os.utime(root / "CURRENT_ATTEMPT", (T0 + 9, T0 + 9))
    g = measure(root, running=True, now=T0 + 20)
    assert g["lost_steps"] == 2
    assert g["effective"] == pytest.approx(8 / 19, abs=1e-4)
    assert g["recoveries"] == [{"kind": "failed", "seconds": 2.0, "tier": "memory"}]


def test_status_says_which_tier_each_recovery_came_from(tmp_path: Path) -> None:
    root = memory_restart(tmp_path / "mem", [restored("t-1", 5, "memory", 9.5)])
    for line in (root / "attempts.jsonl").read_text().splitlines():
        assert json.loads(line)["job"] == "7"
    text = (root / "attempts.jsonl").read_text().replace('"job": "7"', '"job": "local-1"')
    (root / "attempts.jsonl").write_text(text)
    (root / "local.exit").write_text("0\n")
    (root / "DONE").write_text('{"kind": "done", "step": 10}\n')
    remember(JobRef("local", "9", "mem", str(root), {"attempt": 1}))
    res = CliRunner().invoke(cli, ["status", "mem"])
    assert res.exit_code == 0, res.output
    assert "1 restart, 2 steps lost; recoveries: failed 2 s from memory)" in res.output
