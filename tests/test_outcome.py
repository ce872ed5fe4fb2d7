"""The one classifier of how an attempt ends (`shardctl.orchestrator.outcome`): every
rule and every row of the policy, written out here (not computed by the module),
the markers on disk, and `python -m` as job.sbatch and the local supervisor call it."""

from __future__ import annotations

import json
import os
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


def test_a_crash_waits_bounded_for_the_node_that_pins_it(tmp_path: Path) -> None:
    """Node 0's ranks lost their peer and ended first: the judge waits, bounded, for the
    KILLED the other node's task writes once its launcher reported."""
    since = time.time() - 1
    (tmp_path / "FAILED").write_text(json.dumps(FAILED))

    def report() -> None:
        time.sleep(1.0)
        (tmp_path / "KILLED").write_text(json.dumps(KILLED))

    writer = threading.Thread(target=report)
    writer.start()
    try:
        evidence = Evidence.gather(tmp_path, since, 1, killed_wait_s=60)
    finally:
        writer.join()
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
    since = time.time() - 5
    first = oc.attempt_progress(tmp_path, ckpt, since, "7")
    assert first == oc.Progress(step=20, advanced=False, stalled=1)
    verdict = oc.decide(oc.Outcome(Kind.HUNG), progress=first)
    oc.record_attempt(tmp_path, "7", verdict, first)
    oc.record_attempt(tmp_path, "7", verdict, first)
    # Another job of the same run (a new submission) does not count against job 7,
    # nor does a line cut short by a crash.
    oc.record_attempt(tmp_path, "6", verdict, first)
    with open(tmp_path / "attempts.jsonl", "a") as f:
        f.write('{"job": "7", "adv\n')
    third = oc.attempt_progress(tmp_path, ckpt, since, "7")
    assert third == oc.Progress(step=20, advanced=False, stalled=3)
    assert oc.attempt_progress(tmp_path, ckpt, since, "8").stalled == 1
    # A newer checkpoint than the previous attempt recorded is progress, and starts
    # the count over.
    _checkpoint(ckpt, 80)
    assert oc.attempt_progress(tmp_path, ckpt, since, "7") == oc.Progress(80, True, 0)
    oc.record_attempt(tmp_path, "7", verdict, oc.Progress(80, True, 0))
    # The next attempt, a moment later (within the clock slack): step 80 is not new.
    assert oc.attempt_progress(tmp_path, ckpt, time.time(), "7") == oc.Progress(80, False, 1)
    last = oc.last_attempt(tmp_path, "7")
    assert last is not None and last["checkpoint_step"] == 80 and last["advanced"] is True
    assert last["kind"] == "hung" and last["decision"] == "retry"


def test_the_torch_free_checkpoint_listing_reads_what_the_storage_publishes(
    tmp_path: Path,
) -> None:
    """`outcome.newest_checkpoint` mirrors the storage's commit marker and folder names
    (it may not import `train/`): the same names, and the same answer on a folder."""
    from shardctl.train.manifest import step_dirname as step_name
    from shardctl.train.storage import COMMIT_MARKER, PosixStorage

    assert oc.CHECKPOINT_COMMIT == COMMIT_MARKER
    for step in (5, 10):
        folder = tmp_path / step_name(step)
        folder.mkdir()
        (folder / COMMIT_MARKER).write_text("{}")
    (tmp_path / step_name(15)).mkdir()  # no commit marker: incomplete
    assert PosixStorage(tmp_path).list_complete()[-1] == step_name(10)
    assert oc.newest_checkpoint(tmp_path)[0] == 10


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


def test_the_docs_table_is_the_policy() -> None:
    """The docs' "How an attempt ends" policy table says what `POLICY` does."""
    page = Path(__file__).resolve().parents[1] / "docs" / "guides" / "faults.md"
    section = page.read_text().split("## How an attempt ends", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in {k.value for k in Kind}:
            rows[Kind(cells[0])] = (cells[1].split(" ")[0].strip(":,"), cells[2])
    assert set(rows) == set(Kind) - {Kind.UNKNOWN}
    for kind, (decision, code) in rows.items():
        rule = oc.POLICY[kind]
        assert decision == rule.decision.value, kind
        written = str(rule.exit_code) if rule.exit_code is not None else "the rank's code"
        assert code.startswith(written), (kind, code)
    rules = [ln for ln in section.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(rules) == len(oc.RULES)


def test_a_hang_that_names_no_rank_waits_for_the_node_that_does(tmp_path: Path) -> None:
    """Node 0's watchdog (its ranks wait in a collective) may declare before the node
    whose rank stopped: the judge waits, bounded, for the HUNG that names that rank."""
    since = time.time() - 1
    unnamed = {"kind": "hung", "step": 26, "rank": None, "node": 0, "first": []}
    named = {"kind": "hung", "step": 26, "rank": 3, "node": 1, "first": [3]}
    (tmp_path / "HUNG").write_text(json.dumps(unnamed))
    # No wait asked: the first HUNG is the evidence.
    assert Evidence.gather(tmp_path, since, 124).outcome_of("HUNG").rank is None

    def declare() -> None:
        time.sleep(1.0)
        (tmp_path / "HUNG").write_text(json.dumps(named))

    writer = threading.Thread(target=declare)
    writer.start()
    try:
        evidence = Evidence.gather(tmp_path, since, 124, culprit_wait_s=60)
    finally:
        writer.join()
    hung = oc.classify(evidence)
    assert (hung.kind, hung.rank, hung.node) == (Kind.HUNG, 3, 1)
    # Bounded: with nobody to name one, the unnamed HUNG stands after the wait.
    (tmp_path / "HUNG").write_text(json.dumps(unnamed))
    started = time.monotonic()
    assert Evidence.gather(tmp_path, since, 124, culprit_wait_s=1.0).outcome_of("HUNG").rank is None
    assert time.monotonic() - started >= 1.0
