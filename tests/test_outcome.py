"""The one classifier of how an attempt ends (`shardctl.orchestrator.outcome`): every
rule and every row of the policy, written out here (not computed by the module),
the markers on disk, and `python -m` as the local supervisor calls it (Slurm's node
task, under submitit and job.sbatch alike, calls the module in Python)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from shardctl.orchestrator import outcome as oc
from shardctl.orchestrator.outcome import Decision, Evidence, Kind

PREEMPTED_USR2 = {"kind": "preempted", "step": 7, "signal": "SIGUSR2", "reason": "signal SIGUSR2"}
PREEMPTED_TERM = {"kind": "preempted", "step": 7, "signal": "SIGTERM", "reason": "signal SIGTERM"}
HUNG = {"kind": "hung", "step": 9, "node": 1, "rank": 3, "first": [3]}
FAILED = {"kind": "failed", "code": 5, "rank": 2}
DO_NOT_RETRY = {"kind": "failed", "code": 78, "rank": 1, "reason": "bad config"}
KILLED = oc.killed_marker(rank=1, node=1, host="n2", signum=9)


# (exit code, markers, signals the supervisor received) → (kind, step, signal, rank, code)
@pytest.mark.parametrize(
    ("rc", "markers", "signals", "expected"),
    [
        # exit 0 is done, whatever else lies there
        (0, {"DONE": {"kind": "done", "step": 20}}, (), (Kind.DONE, 20, None, None, None)),
        (0, {"CANCELLED": {}}, ("SIGTERM",), (Kind.DONE, None, None, None, None)),
        # the run wrote DONE (finished) before a cancel or a signal reached it: done
        (1, {"DONE": {"kind": "done", "step": 20}, "CANCELLED": {}}, (),
         (Kind.DONE, 20, None, None, None)),
        (143, {"DONE": {"kind": "done", "step": 20}}, ("SIGTERM",),
         (Kind.DONE, 20, None, None, None)),
        (1, {"DONE": {"kind": "done", "step": 20}}, ("SIGUSR2",),
         (Kind.DONE, 20, None, None, None)),
        # ... unless a rank failed or hung after it: that stays what it was
        (1, {"DONE": {"kind": "done", "step": 20}, "CANCELLED": {}, "FAILED": FAILED}, (),
         (Kind.CANCELLED, None, None, None, None)),
        (1, {"DONE": {"kind": "done", "step": 20}, "FAILED": FAILED}, ("SIGTERM",),
         (Kind.CANCELLED, None, "SIGTERM", None, None)),
        # `shardctl cancel` wrote CANCELLED: a cancel, even over the ranks' warning save
        (1, {"CANCELLED": {}, "PREEMPTED": PREEMPTED_USR2}, (),
         (Kind.CANCELLED, 7, "SIGUSR2", None, None)),
        # the supervisor got the cluster's warning: a preemption, even with a TERM after it
        (1, {"PREEMPTED": PREEMPTED_TERM}, ("SIGUSR2", "SIGTERM"),
         (Kind.PREEMPTED, 7, "SIGUSR2", None, None)),
        (1, {}, ("SIGUSR1",), (Kind.PREEMPTED, None, "SIGUSR1", None, None)),
        # the supervisor got TERM alone: a cancel, never a hang
        (124, {"HUNG": HUNG}, ("SIGTERM",), (Kind.CANCELLED, None, "SIGTERM", None, None)),
        # the ranks' marker: its typed signal decides
        (1, {"PREEMPTED": PREEMPTED_USR2}, (), (Kind.PREEMPTED, 7, "SIGUSR2", None, None)),
        (1, {"PREEMPTED": PREEMPTED_TERM}, (), (Kind.CANCELLED, 7, "SIGTERM", None, None)),
        (1, {"PREEMPTED": {**PREEMPTED_USR2, "signal": "SIGINT"}}, (),
         (Kind.CANCELLED, 7, "SIGINT", None, None)),
        # an old marker (no kind, no signal; the text is never read): a preemption
        (1, {"PREEMPTED": {"step": 4, "reason": "signal SIGTERM"}}, (),
         (Kind.PREEMPTED, 4, None, None, None)),
        # a saved checkpoint outranks a hang declared after it
        (124, {"PREEMPTED": PREEMPTED_USR2, "HUNG": HUNG}, (),
         (Kind.PREEMPTED, 7, "SIGUSR2", None, None)),
        # the script said do not retry (78): its marker, or exit 78 alone; over a hang
        (1, {"FAILED": DO_NOT_RETRY}, (), (Kind.PERMANENT, None, None, 1, 78)),
        (124, {"FAILED": DO_NOT_RETRY, "HUNG": HUNG}, (), (Kind.PERMANENT, None, None, 1, 78)),
        (78, {}, (), (Kind.PERMANENT, None, None, None, 78)),
        # ... but a TERM the supervisor got is still a cancel, and another rank's
        # code in FAILED is that rank's failure, whatever the launcher's exit
        (1, {"FAILED": DO_NOT_RETRY}, ("SIGTERM",), (Kind.CANCELLED, None, "SIGTERM", None, None)),
        (78, {"FAILED": FAILED}, (), (Kind.FAILED, None, None, 2, 5)),
        # hung: the marker's rank and step, or exit 124 alone
        (1, {"HUNG": HUNG}, (), (Kind.HUNG, 9, None, 3, None)),
        (124, {}, (), (Kind.HUNG, None, None, None, None)),
        (None, {"HUNG": {"step": 2, "node": 0, "first": [1]}}, (),
         (Kind.HUNG, 2, None, 1, None)),
        # a rank killed on its node (its node task's KILLED): pinned there, over the
        # FAILED its peers wrote on losing it; a hang outranks it
        (1, {"KILLED": KILLED, "FAILED": FAILED}, (), (Kind.FAILED, None, "SIGKILL", 1, 137)),
        (124, {"HUNG": HUNG, "KILLED": KILLED}, (), (Kind.HUNG, 9, None, 3, None)),
        # ... but not an abort (gloo aborts the ranks that lost a peer) nor a TERM
        (1, {"KILLED": {**KILLED, "signal": "SIGABRT"}, "FAILED": FAILED}, (),
         (Kind.FAILED, None, None, 2, 5)),
        (1, {"KILLED": {**KILLED, "signal": "SIGTERM"}}, (), (Kind.FAILED, None, None, None, 1)),
        # ... nor a KILLED that names no node (a marker edited by hand)
        (1, {"KILLED": {**KILLED, "node": -1}}, (), (Kind.FAILED, None, None, None, 1)),
        (1, {"KILLED": {**KILLED, "node": "n2"}}, (), (Kind.FAILED, None, None, None, 1)),
        # failed: the rank's own code, else the launcher's; 42 without a marker too
        (1, {"FAILED": FAILED}, (), (Kind.FAILED, None, None, 2, 5)),
        (7, {}, (), (Kind.FAILED, None, None, None, 7)),
        (42, {}, (), (Kind.FAILED, None, None, None, 42)),
        # no exit code recorded: DONE, else nothing known
        (None, {"DONE": {"step": 3}}, (), (Kind.DONE, 3, None, None, None)),
        (None, {}, (), (Kind.UNKNOWN, None, None, None, None)),
    ],
)  # fmt: skip
def test_every_rule(rc, markers, signals, expected) -> None:
    got = oc.classify(Evidence(rc, markers, signals, warning="SIGUSR2"))
    assert (got.kind, got.step, got.signal, got.rank, got.code) == expected


def test_the_clusters_own_warning_signal_counts() -> None:
    # slurm.signal INT: an INT the task received is the warning, not a Ctrl-C.
    got = oc.classify(Evidence(1, {}, ("SIGINT",), warning="SIGINT"))
    assert got.kind is Kind.PREEMPTED and got.signal == "SIGINT"


@pytest.mark.parametrize(
    ("kind", "decision", "code"),
    [
        (Kind.DONE, Decision.FINISH, 0),
        (Kind.PREEMPTED, Decision.RETRY, 42),
        (Kind.CANCELLED, Decision.STOP, 143),
        (Kind.HUNG, Decision.RETRY, 124),
        (Kind.FAILED, Decision.STOP, 5),
        (Kind.PERMANENT, Decision.STOP, 78),
        (Kind.UNKNOWN, Decision.STOP, 1),
    ],
)
def test_every_row_of_the_policy(kind: Kind, decision: Decision, code: int) -> None:
    verdict = oc.decide(oc.Outcome(kind, code=5 if kind is Kind.FAILED else None))
    assert (verdict.decision, verdict.exit_code, verdict.out_of_retries) == (decision, code, False)


def test_the_policy_has_one_row_per_kind() -> None:
    assert set(oc.POLICY) == set(Kind)


@pytest.mark.parametrize("kind", [Kind.PREEMPTED, Kind.HUNG])
def test_a_retry_past_the_budget_stops(kind: Kind) -> None:
    assert oc.decide(oc.Outcome(kind), retries=2, max_retries=3).decision is Decision.RETRY
    spent = oc.decide(oc.Outcome(kind), retries=3, max_retries=3)
    assert spent.decision is Decision.STOP and spent.out_of_retries
    assert spent.summary().endswith("; out of retries (3 of at most 3)")


def test_a_crash_pinned_on_a_node_restarts_then_retries_and_says_where() -> None:
    """A rank killed on its node restarts in place like any crash; past the restarts
    it is retried (Slurm leaves the node behind), within the budget and while the
    attempts make progress; an unpinned crash stops there."""
    pinned = oc.classify(Evidence(1, {"KILLED": KILLED}))
    assert pinned.pinned
    assert pinned.summary() == "failed: rank 1 was killed by SIGKILL on node 1 (n2)"
    restart = oc.decide(pinned, restarts=0, max_restarts=1)
    assert restart.decision is Decision.RESTART
    past = oc.decide(pinned, restarts=1, max_restarts=1, retries=0, max_retries=3)
    assert (past.decision, past.exit_code, past.out_of_restarts) == (Decision.RETRY, 137, True)
    spent = oc.decide(pinned, restarts=1, max_restarts=1, retries=3, max_retries=3)
    assert spent.decision is Decision.STOP and spent.out_of_retries
    stalled = oc.Progress(step=20, advanced=False, stalled=3)
    looping = oc.decide(pinned, retries=0, max_retries=3, progress=stalled)
    assert looping.decision is Decision.STOP and looping.no_progress
    crashed = oc.classify(Evidence(1, {"FAILED": FAILED}))
    assert oc.decide(crashed, restarts=1, max_restarts=1).decision is Decision.STOP


def _gather_while_written(
    run_dir: Path, since: float, code: int, marker: str, data: dict, **waits: float
) -> Evidence:
    """The evidence gathered while another thread writes `marker` (`data`) a second
    later: a marker that reaches the judge late, as another node's does."""

    def write() -> None:
        time.sleep(1.0)  # the other node's delay, not a wait of the test
        (run_dir / marker).write_text(json.dumps(data))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        return Evidence.gather(run_dir, since, code, **waits)
    finally:
        writer.join()


def test_a_crash_waits_bounded_for_the_node_that_pins_it(tmp_path: Path) -> None:
    """Node 0's ranks lost their peer and ended first: the judge waits, bounded, for the
    KILLED the other node's task writes once its launcher reported."""
    since = time.time() - 1
    (tmp_path / "FAILED").write_text(json.dumps(FAILED))
    evidence = _gather_while_written(tmp_path, since, 1, "KILLED", KILLED, killed_wait_s=60)
    assert oc.classify(evidence).pinned
    (tmp_path / "KILLED").unlink()
    started = time.monotonic()
    assert not oc.classify(Evidence.gather(tmp_path, since, 1, killed_wait_s=1.0)).pinned
    assert time.monotonic() - started >= 1.0


def test_do_not_retry_never_retries_and_says_why() -> None:
    out = oc.classify(Evidence(1, {"FAILED": DO_NOT_RETRY}))
    verdict = oc.decide(out, retries=0, max_retries=10)
    assert (verdict.decision, verdict.exit_code) == (Decision.STOP, 78)
    assert not verdict.out_of_retries and not verdict.no_progress
    assert verdict.summary() == (
        "the script said do not retry (rank 1 exited with code 78): bad config"
    )
    assert oc.from_marker("FAILED", oc.failed_marker(78, 0, "why")).kind is Kind.FAILED
    assert oc.failed_marker(78, 0, "why")["reason"] == "why"
    assert "reason" not in oc.failed_marker(3, 0)


@pytest.mark.parametrize("kind", [Kind.PREEMPTED, Kind.HUNG])
def test_a_retry_after_attempts_without_progress_stops(kind: Kind) -> None:
    stalled = oc.Progress(step=40, advanced=False, stalled=3)
    verdict = oc.decide(oc.Outcome(kind), retries=2, max_retries=10, progress=stalled)
    assert verdict.decision is Decision.STOP and verdict.no_progress
    assert not verdict.out_of_retries
    assert verdict.stop_reason() == "stopped: no new checkpoint in 3 attempts (last at step 40)"
    assert verdict.summary().endswith(
        "; stopped: no new checkpoint in 3 attempts (last at step 40)"
    )
    # One attempt fewer, a bound of 4, the bound off (0), or progress: retry.
    for progress, bound in (
        (oc.Progress(40, False, 2), 3),
        (stalled, 4),
        (stalled, 0),
        (oc.Progress(60, True, 0), 3),
    ):
        again = oc.decide(oc.Outcome(kind), progress=progress, max_stalled=bound)
        assert again.decision is Decision.RETRY and not again.no_progress
    # Nothing saved yet at all.
    none = oc.decide(oc.Outcome(kind), progress=oc.Progress(None, False, 3))
    assert none.stop_reason() == "stopped: no new checkpoint in 3 attempts (none yet)"
    # A stop or a finish is what it is, whatever the progress.
    done = oc.decide(oc.Outcome(Kind.DONE), progress=stalled)
    assert done.decision is Decision.FINISH and not done.no_progress


def _checkpoint(root: Path, step: int, *, complete: bool = True, at: float | None = None) -> None:
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / "manifest.json").write_text("{}")
        if at is not None:
            os.utime(folder / "manifest.json", (at, at))


def test_progress_is_a_complete_checkpoint_published_during_the_attempt(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    assert oc.newest_checkpoint(ckpt) is None  # no folder yet
    long_ago = time.time() - 3600
    _checkpoint(ckpt, 20, at=long_ago)
    _checkpoint(ckpt, 40, complete=False)  # a save that never finished
    (ckpt / "step-00000060.tmp").mkdir()  # a save under way
    assert oc.newest_checkpoint(ckpt) == (20, long_ago)
    assert oc.newest_step(tmp_path, ckpt) == 20
    first = oc.attempt_progress(tmp_path, ckpt, 20, "7")  # step 20 was there at the start
    assert first == oc.Progress(step=20, advanced=False, stalled=1)
    verdict = oc.decide(oc.Outcome(Kind.HUNG), progress=first)
    oc.record_attempt(tmp_path, "7", verdict, first)
    oc.record_attempt(tmp_path, "7", verdict, first)
    # Another job of the same run (a new submission) does not count against job 7,
    # nor does a line cut short by a crash.
    oc.record_attempt(tmp_path, "6", verdict, first)
    with open(tmp_path / "attempts.jsonl", "a") as f:
        f.write('{"job": "7", "adv\n')
    third = oc.attempt_progress(tmp_path, ckpt, None, "7")  # the ledger's step 20 counts
    assert third == oc.Progress(step=20, advanced=False, stalled=3)
    assert oc.attempt_progress(tmp_path, ckpt, 20, "8").stalled == 1
    # A newer checkpoint than the previous attempt recorded is progress, and starts
    # the count over.
    _checkpoint(ckpt, 80)
    assert oc.attempt_progress(tmp_path, ckpt, 20, "7") == oc.Progress(80, True, 0)
    oc.record_attempt(tmp_path, "7", verdict, oc.Progress(80, True, 0))
    # The next attempt: step 80 is not new, whatever time its manifest says.
    assert oc.attempt_progress(tmp_path, ckpt, 20, "7") == oc.Progress(80, False, 1)
    last = oc.last_attempt(tmp_path, "7")
    assert last is not None and last["checkpoint_step"] == 80 and last["advanced"] is True
    assert last["kind"] == "hung" and last["decision"] == "retry"


@pytest.mark.parametrize("skew_s", [3600.0, 0.0, -3600.0])
def test_progress_is_judged_by_step_whatever_the_manifests_time(
    tmp_path: Path, skew_s: float
) -> None:
    """A job's first attempt: the checkpoint it started from is not progress even when
    its manifest's time is this attempt's second or later (a node's clock ahead), and
    one it published is progress even when its time is long before the start (a node's
    clock behind). The step read at the start decides, not a time."""
    ckpt = tmp_path / "checkpoints"
    started = time.time()
    _checkpoint(ckpt, 20, at=started + skew_s)
    assert oc.attempt_progress(tmp_path, ckpt, 20, "7") == oc.Progress(20, False, 1)
    _checkpoint(ckpt, 30, at=started - 3600.0 + skew_s)
    assert oc.attempt_progress(tmp_path, ckpt, 20, "7") == oc.Progress(30, True, 0)
    # None: the attempt started with no checkpoint at all; any complete one is new.
    assert oc.attempt_progress(tmp_path, ckpt, None, "8") == oc.Progress(30, True, 0)


def test_a_bucket_without_its_client_here_is_no_checkpoint_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local `schedule` reads the newest step after it claimed the start's token: a
    bucket it cannot read (no boto3 on this machine) is "none", not a traceback."""
    from shardctl.orchestrator import attempts
    from shardctl.orchestrator.errors import MissingDependencyError

    def no_client(where: object) -> list[object]:
        raise MissingDependencyError("boto3", "s3", "reading s3://")

    monkeypatch.setattr(attempts, "complete_checkpoints", no_client)
    assert oc.newest_step(tmp_path, "s3://bucket/run") is None


def test_the_supervisors_command_takes_the_start_step(tmp_path: Path) -> None:
    """`python -m ...outcome --start-step` (the local supervisor's call): the checkpoint
    there at the start, its manifest time in the future, is no progress; a bad value is
    one line naming the option."""
    _checkpoint(tmp_path / "checkpoints", 20, at=time.time() + 3600.0)
    (tmp_path / "HUNG").write_text(json.dumps(HUNG))
    base = [sys.executable, "-m", "shardctl.orchestrator.outcome", str(tmp_path)]
    judged = [*base, "--exit-code", "124", "--job", "j", "--since", str(time.time())]
    proc = subprocess.run(
        [*judged, "--start-step", "20"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    line = json.loads((tmp_path / "attempts.jsonl").read_text().splitlines()[-1])
    assert (line["checkpoint_step"], line["advanced"]) == (20, False)
    bad = subprocess.run(
        [*judged, "--start-step", "-3"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
    assert "argument --start-step: '-3' is not a checkpoint step" in bad.stderr.splitlines()[-1]


def test_the_no_progress_rule_lists_checkpoints_through_the_one_lister(
    tmp_path: Path,
) -> None:
    """`outcome.newest_checkpoint` is the torch-free lister's newest complete checkpoint
    (no copy of its folder names or commit marker): a folder without the marker, a
    `.tmp` save and the trash of a deletion are not it."""
    from shardctl.orchestrator.storage import COMMIT_MARKER

    for step in (5, 10):
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir()
        (folder / COMMIT_MARKER).write_text("{}")
    os.utime(tmp_path / "step-00000010" / COMMIT_MARKER, (1000.0, 1000.0))
    (tmp_path / "step-00000015").mkdir()  # no commit marker: incomplete
    for leftover in ("step-00000020.tmp", ".trash-step-00000030-1-2"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / COMMIT_MARKER).write_text("{}")
    assert oc.newest_checkpoint(tmp_path) == (10, 1000.0)


def test_markers_of_an_earlier_attempt_are_left_out(tmp_path: Path) -> None:
    (tmp_path / "PREEMPTED").write_text(json.dumps(PREEMPTED_USR2))
    os.utime(tmp_path / "PREEMPTED", (1, 1))
    (tmp_path / "FAILED").write_text(json.dumps(FAILED))
    evidence = Evidence.gather(tmp_path, time.time() - 5, 1)
    assert set(evidence.markers) == {"FAILED"}
    assert oc.classify(evidence).kind is Kind.FAILED
    # No start time (a local status of a run dir that schedule cleaned): every marker.
    assert set(Evidence.gather(tmp_path, None, 1).markers) == {"PREEMPTED", "FAILED"}


def test_an_old_cancelled_file_still_counts(tmp_path: Path) -> None:
    (tmp_path / "CANCELLED").write_text(f"{time.time()}\n")  # not JSON: before the kinds
    assert oc.classify(Evidence.gather(tmp_path, time.time() - 5, 1)).kind is Kind.CANCELLED


def test_the_writers_markers_read_back(tmp_path: Path) -> None:
    from shardctl.orchestrator.rundir import RunDir

    run = RunDir.of(tmp_path)
    run.write_marker("PREEMPTED", oc.preempted_marker(6, 12, "signal SIGUSR2"))
    assert json.loads((tmp_path / "PREEMPTED").read_text())["signal"] == "SIGUSR2"
    got = oc.from_marker("PREEMPTED", run.read_marker("PREEMPTED") or {})
    assert (got.kind, got.step, got.signal) == (Kind.PREEMPTED, 6, "SIGUSR2")
    got = oc.from_marker("FAILED", oc.failed_marker(3, 1))
    assert (got.kind, got.code, got.rank) == (Kind.FAILED, 3, 1)


def _cli(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl.orchestrator.outcome", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_python_dash_m_prints_the_decision_and_records_the_verdict(tmp_path: Path) -> None:
    (tmp_path / "HUNG").write_text(json.dumps(HUNG))
    verdict = tmp_path / "verdict.json"
    out = _cli(str(tmp_path), "--exit-code", "124", "--since", str(time.time() - 5),
               "--retries", "1", "--max-retries", "3", "--write", str(verdict))  # fmt: skip
    assert out == "retry hung at step 9 (node 1's watchdog)\n"
    recorded = json.loads(verdict.read_text())
    assert recorded["decision"] == "retry" and recorded["outcome"]["kind"] == "hung"
    assert recorded["exit_code"] == 124 and recorded["outcome"]["rank"] == 3
    out = _cli(str(tmp_path), "--exit-code", "1", "--signal", "SIGTERM")
    assert out == "stop cancelled (signal SIGTERM)\n"
    # With --job: progress judged, the attempt recorded; the third without one stops.
    since = str(time.time() - 5)
    ckpt = tmp_path / "elsewhere"
    args = [str(tmp_path), "--exit-code", "124", "--since", since, "--job", "9",
            "--checkpoint-dir", str(ckpt)]  # fmt: skip
    assert _cli(*args).startswith("retry hung at step 9")
    assert _cli(*args).startswith("retry hung at step 9")
    assert _cli(*args) == (
        "stop hung at step 9 (node 1's watchdog); stopped: no new checkpoint in 3 attempts "
        "(none yet)\n"
    )
    assert _cli(*args, "--max-stalled", "0").startswith("retry ")
    lines = [json.loads(x) for x in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    assert [x["decision"] for x in lines] == ["retry", "retry", "stop", "retry"]


def _docs_tables() -> tuple[list[list[str]], list[list[str]]]:
    """The rules table (#, evidence, outcome) and the policy table (outcome, decision,
    exit code) of docs/guides/faults.md's "How an attempt ends", row by row."""
    page = Path(__file__).resolve().parents[1] / "docs" / "guides" / "faults.md"
    section = page.read_text().split("## How an attempt ends", 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| # ") and "---" not in line
    ]
    rules = [cells for cells in rows if cells[0].isdigit()]
    policy = [cells for cells in rows if not cells[0].isdigit() and cells[0] != "outcome"]
    return rules, policy


# For each row of the docs' rules table, evidence that fits what the row says (written
# out here), so a rule moved, dropped or judging otherwise than the docs say fails.
DONE_20 = {"kind": "done", "step": 20}
DOCS_RULE_CASES: dict[int, list[Evidence]] = {
    1: [Evidence(0)],
    2: [
        Evidence(143, {"DONE": DONE_20, "CANCELLED": {}}),
        Evidence(1, {"DONE": DONE_20}, ("SIGTERM",)),
    ],
    3: [Evidence(143, {"CANCELLED": {}})],
    4: [Evidence(1, {}, ("SIGUSR2",), "SIGUSR2"), Evidence(1, {}, ("SIGUSR1",))],
    5: [Evidence(143, {}, ("SIGTERM",)), Evidence(130, {}, ("SIGINT",))],
    6: [Evidence(42, {"PREEMPTED": PREEMPTED_TERM}), Evidence(42, {"PREEMPTED": PREEMPTED_USR2})],
    7: [Evidence(1, {"FAILED": DO_NOT_RETRY}), Evidence(78)],
    8: [Evidence(1, {"HUNG": HUNG}), Evidence(124)],
    9: [Evidence(1, {"KILLED": KILLED})],
    10: [Evidence(1, {"FAILED": FAILED})],
    11: [Evidence(1, {"DONE": {**DONE_20, "token": "t-1"}}, token="t-1")],
    12: [
        Evidence(42),
        Evidence(3),
        Evidence(1, {"DONE": {**DONE_20, "token": "t-0"}}, token="t-1"),
    ],
    13: [Evidence(None, {"DONE": DONE_20})],
}


def _first_rule(evidence: Evidence) -> tuple[int, Kind]:
    """The number (from 1) of the first of `RULES` that matches, and its outcome's kind."""
    for number, (_name, rule) in enumerate(oc.RULES, start=1):
        found = rule(evidence)
        if found is not None:
            return number, found.kind
    raise AssertionError(f"no rule matches {evidence}")


def test_the_docs_rules_table_is_the_classifier_row_by_row() -> None:
    """Each numbered row of the docs is the rule of that number in `RULES`, and the
    outcome it names is what that rule returns for evidence fitting its description."""
    rules, _ = _docs_tables()
    assert [int(cells[0]) for cells in rules] == list(range(1, len(oc.RULES) + 1))
    assert sorted(DOCS_RULE_CASES) == [int(cells[0]) for cells in rules]
    kinds = {k.value for k in Kind}
    for number, _evidence_text, outcome_text in rules:
        written = {w for w in re.findall(r"[a-z]+", outcome_text) if w in kinds}
        assert written, f"rule {number}: the docs name no outcome: {outcome_text!r}"
        judged = set()
        for evidence in DOCS_RULE_CASES[int(number)]:
            first, kind = _first_rule(evidence)
            assert first == int(number), (number, evidence, first)
            judged.add(kind.value)
        assert judged == written, (number, outcome_text)
    # Rule 9's crash is pinned on the node the docs say (code 128 + the signal).
    pinned = oc.classify(DOCS_RULE_CASES[9][0])
    assert (pinned.pinned, pinned.node, pinned.code) == (True, 1, 128 + 9)


def test_the_docs_policy_table_is_the_policy_cell_by_cell() -> None:
    """Each row of the docs' policy table is `POLICY`'s row of that kind: the kinds in
    the same order, the decision, whether it restarts in place first, the exit code."""
    _, policy = _docs_tables()
    assert [cells[0] for cells in policy] == [k.value for k in oc.POLICY if k is not Kind.UNKNOWN]
    for kind_text, decision_text, code_text in policy:
        rule = oc.POLICY[Kind(kind_text)]
        assert decision_text.split(" ")[0].strip(":,") == rule.decision.value, kind_text
        restarts_first = "restarted in place while `restart.max_in_allocation`" in decision_text
        assert restarts_first == rule.restart, kind_text
        if rule.exit_code is None:
            assert code_text == "the rank's code, else the launcher's", kind_text
        else:
            assert code_text == str(rule.exit_code), kind_text
    # The failed row's pinned crash: restarted in place too, then retried like a hang.
    failed = dict((cells[0], cells[1]) for cells in policy)["failed"]
    assert "pinned on one node (rule 9) is then retried like a hang" in failed
    assert (oc.PINNED_CRASH.decision, oc.PINNED_CRASH.restart) == (Decision.RETRY, True)
    assert oc.POLICY[Kind.HUNG].decision == oc.PINNED_CRASH.decision


def test_a_hang_that_names_no_rank_waits_for_the_node_that_does(tmp_path: Path) -> None:
    """Node 0's watchdog (its ranks wait in a collective) may declare before the node
    whose rank stopped: the judge waits, bounded, for the HUNG that names that rank."""
    since = time.time() - 1
    unnamed = {"kind": "hung", "step": 26, "rank": None, "node": 0, "first": []}
    named = {"kind": "hung", "step": 26, "rank": 3, "node": 1, "first": [3]}
    (tmp_path / "HUNG").write_text(json.dumps(unnamed))
    # No wait asked: the first HUNG is the evidence.
    assert Evidence.gather(tmp_path, since, 124).outcome_of("HUNG").rank is None
    evidence = _gather_while_written(tmp_path, since, 124, "HUNG", named, culprit_wait_s=60)
    hung = oc.classify(evidence)
    assert (hung.kind, hung.rank, hung.node) == (Kind.HUNG, 3, 1)
    # Bounded: with nobody to name one, the unnamed HUNG stands after the wait.
    (tmp_path / "HUNG").write_text(json.dumps(unnamed))
    started = time.monotonic()
    assert Evidence.gather(tmp_path, since, 124, culprit_wait_s=1.0).outcome_of("HUNG").rank is None
    assert time.monotonic() - started >= 1.0
