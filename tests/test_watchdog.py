"""The node watchdog (shardctl.train.watchdog): the timeout rule, the monitor, and the
real process with stand-in ranks that beat through shardctl.train.heartbeat.

The end-to-end hang of real training ranks is in test_hang_local.py (local) and
test_slurm_hang.py (2-node Slurm).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from shardctl.orchestrator.proctree import alive
from shardctl.orchestrator.rundir import EXIT_HUNG, HUNG_FILE, RunDir
from shardctl.train import heartbeat
from shardctl.train.heartbeat import Beat, read_beats
from shardctl.train.watchdog import (
    FLOOR_S,
    STARTUP_FLOOR_S,
    UNMEASURED_FLOOR_S,
    HangRule,
    Monitor,
    earlier_save_times,
    main,
)

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "data" / "watchdog"


# ------------------------------------------------------------------ the rule


def test_derived_timeout_is_never_below_the_floor() -> None:
    rule = HangRule()
    assert rule.limit("step") == FLOOR_S
    # Nothing measured yet: saves get more, and start-up (restore included) its allowance.
    assert rule.limit("save") == UNMEASURED_FLOOR_S
    assert rule.startup_limit("start") == rule.startup_limit("restore") == UNMEASURED_FLOOR_S
    rule.step_times.extend([0.5, 0.6, 0.4])
    assert rule.limit("step") == FLOOR_S  # 10 × 0.5 s is far below 300 s


def test_derived_timeout_follows_slow_steps_and_long_saves() -> None:
    rule = HangRule()
    rule.step_times.extend([40.0, 50.0, 45.0, 500.0])  # median 47.5 s
    assert rule.limit("step") == pytest.approx(475.0)
    rule.save_times.append(200.0)
    assert rule.limit("step") == pytest.approx(600.0)  # 3 × 200 s
    assert rule.limit("save") == pytest.approx(600.0)  # a save was measured
    assert "derived" in rule.describe() and "600" in rule.describe()


def test_earlier_attempts_saves_count(tmp_path: Path) -> None:
    for step, body in ((10, {"save_s": 250.0}), (20, {"save_s": 12}), (30, "{corrupt")):
        d = tmp_path / f"step-{step:08d}"
        d.mkdir()
        (d / "manifest.json").write_text(body if isinstance(body, str) else json.dumps(body))
    (tmp_path / "step-00000040.tmp").mkdir()  # an unfinished save: no manifest
    assert sorted(earlier_save_times(str(tmp_path))) == [12.0, 250.0]
    assert earlier_save_times(str(tmp_path / "nope")) == []
    rule = HangRule(earlier_saves=earlier_save_times(str(tmp_path)))
    assert rule.limit("step") == pytest.approx(750.0)


def test_an_explicit_timeout_is_used_as_given() -> None:
    rule = HangRule(explicit=20.0)
    rule.step_times.append(100.0)
    assert rule.limit("step") == rule.limit("save") == 20.0
    assert "hang_timeout_s" in rule.describe()


def test_the_start_up_allowance_is_its_own_and_never_below_the_hang_timeout() -> None:
    # Unset: 900 s, kept 120 s under the collective timeout (1800 s: torch's default).
    assert HangRule(explicit=15.0).startup_limit("start") == STARTUP_FLOOR_S == 900.0
    assert HangRule(explicit=15.0, collective_s=1020.0).startup_limit("step") == 900.0
    assert HangRule(explicit=15.0, collective_s=300.0).startup_limit("start") == 180.0
    assert HangRule(explicit=600.0, collective_s=720.0).startup_limit("start") == 600.0
    # Derived hang timeouts: start-up and restore get what they had (900 s before a
    # save was measured), and more when the derived timeout is longer.
    assert HangRule().startup_limit("restore") == 900.0
    assert HangRule(earlier_saves=[400.0]).startup_limit("restore") == 1200.0
    # Explicit: as given, but never below the hang timeout.
    assert HangRule(explicit=15.0, startup_explicit=60.0).startup_limit("start") == 60.0
    assert HangRule(startup_explicit=60.0).startup_limit("start") == FLOOR_S
    rule = HangRule(explicit=15.0, startup_explicit=60.0)
    assert "60 s (watchdog.startup_timeout_s" in rule.describe_startup()
    assert "900 s (derived: min(900 s, collective timeout 1800 s - 120 s)" in (
        HangRule(explicit=15.0).describe_startup()
    )


def test_the_spec_and_the_watchdog_derive_the_start_up_allowance_alike() -> None:
    # A deliberate mirror: the watchdog imports no pydantic.
    from shardctl.orchestrator.spec import sections as spec
    from shardctl.train import watchdog

    assert watchdog.STARTUP_FLOOR_S == spec.STARTUP_FLOOR_S
    assert watchdog.COLLECTIVE_MARGIN_S == spec.COLLECTIVE_MARGIN_S
    assert watchdog.DEFAULT_COLLECTIVE_TIMEOUT_S == spec.DEFAULT_COLLECTIVE_TIMEOUT_S
    # The collective timeout the spec derives leaves the watchdog's start-up allowance
    # its margin: a collective waiting for a peer's start-up fails after the verdict.
    for hang, start in ((15, None), (600, None), (2000, None), (15, 60), (None, 60), (None, None)):
        w = spec.Watchdog(hang_timeout_s=hang, startup_timeout_s=start)
        rule = HangRule(
            explicit=hang, startup_explicit=start, collective_s=float(w.collective_timeout)
        )
        limit = rule.startup_limit("start")
        assert w.collective_timeout >= limit + spec.COLLECTIVE_MARGIN_S, (hang, start, limit)


# ------------------------------------------------------------------ the monitor


def _beat(rank: int, step: int, t: float, phase: str = "step", pid: int = 0) -> Beat:
    return Beat(rank, step, phase, pid or 1000 + rank, t)


def test_monitor_measures_steps_and_saves() -> None:
    m = Monitor(HangRule(explicit=10.0))
    m.observe([_beat(0, 1, 100.0)], now=0.0)
    m.observe([_beat(0, 3, 104.0)], now=1.0)  # two steps in 4 s
    m.observe([_beat(0, 3, 104.5, "save")], now=2.0)
    m.observe([_beat(0, 3, 110.5)], now=3.0)  # the save took 6 s
    assert list(m.rule.step_times) == [2.0]
    assert m.rule.save_times == [6.0]


def test_monitor_declares_a_hang_only_when_every_rank_is_idle() -> None:
    m = Monitor(HangRule(explicit=10.0))
    alive_pids = {1000, 1001}
    m.observe([_beat(0, 5, 1.0), _beat(1, 5, 1.0)], now=0.0)
    assert m.verdict(5.0, alive_pids) is None
    m.observe([_beat(0, 6, 2.0), _beat(1, 5, 1.0)], now=8.0)  # rank 0 advanced at 8 s
    assert m.verdict(12.0, alive_pids) is None  # rank 0 idle for 4 s only
    verdict = m.verdict(18.5, alive_pids)
    assert verdict is not None and verdict.idle_s == pytest.approx(10.5)
    assert [v.beat.rank for v in verdict.ranks] == [0, 1]


def test_finished_and_exited_ranks_are_not_watched() -> None:
    m = Monitor(HangRule(explicit=10.0))
    m.observe([_beat(0, 9, 1.0, "finish"), _beat(1, 9, 1.0)], now=0.0)
    assert m.verdict(60.0, {1000}) is None  # rank 1's process is gone, rank 0 finished
    assert m.verdict(60.0, {1000, 1001}) is not None  # rank 1 still runs: hung


def test_a_rank_in_start_up_gets_the_allowance_and_after_it_the_hang_timeout() -> None:
    m = Monitor(HangRule(explicit=10.0, startup_explicit=100.0))
    pids = {1000}
    m.observe([Beat(0, -1, "start", 1000, 1.0, starting=True)], now=0.0)
    assert m.verdict(50.0, pids) is None  # past 10 s, within 100 s
    verdict = m.verdict(100.5, pids)
    assert verdict is not None and verdict.limit_s == 100.0 and verdict.starting
    m.observe([Beat(0, 1, "step", 1000, 102.0)], now=101.0)  # the first step finished
    assert m.verdict(110.0, pids) is None
    verdict = m.verdict(111.5, pids)
    assert verdict is not None and verdict.limit_s == 10.0 and not verdict.starting


def test_no_heartbeat_no_verdict() -> None:
    assert Monitor(HangRule(explicit=1.0)).verdict(1e9, {1}) is None


# ------------------------------------------------------------------ heartbeats


def test_heartbeat_records_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDCTL_HEARTBEAT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(heartbeat, "_writer_ready", False)
    monkeypatch.setattr(heartbeat, "_writer", None)
    heartbeat.beat(12345678901, "save")
    heartbeat.beat(None, "step")  # keeps the step; a shorter record overwrites fully
    (beat,) = read_beats(tmp_path)
    assert (beat.rank, beat.step, beat.phase, beat.pid) == (3, 12345678901, "step", os.getpid())
    assert (tmp_path / "rank-3").stat().st_size == heartbeat.RECORD_BYTES
    with pytest.raises(ValueError, match="accepted: start, restore, step"):
        heartbeat.beat(1, "lunch")
    (tmp_path / "rank-9").write_text("garbage")  # half-written: skipped
    assert [b.rank for b in read_beats(tmp_path)] == [3]


@pytest.mark.parametrize(
    "beats, starting",
    [
        ([(None, "start")], [True]),
        ([(None, "start"), (None, "restore"), (5, "step")], [True, True, True]),
        # training begins (restored step 5), then step 6 finished: start-up is over
        ([(None, "start"), (5, "step"), (6, "step"), (6, "save")], [True, True, False, False]),
        ([(None, "start"), (None, "eval")], [True, False]),  # an evaluation before step 1
        ([(None, "restore"), (0, "save")], [True, False]),
        ([(None, "step"), (None, "step")], [True, False]),  # a script's own heartbeat()
    ],
)
def test_heartbeat_says_whether_the_rank_still_starts_up(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    beats: list[tuple[int | None, str]],
    starting: list[bool],
) -> None:
    monkeypatch.setenv("SHARDCTL_HEARTBEAT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    for name, value in (("_writer_ready", False), ("_writer", None), ("_last_step", -1),
                        ("_training_began", False), ("_starting", True)):  # fmt: skip
        monkeypatch.setattr(heartbeat, name, value)
    seen = []
    for step, phase in beats:
        heartbeat.beat(step, phase)
        seen.append(read_beats(tmp_path)[0].starting)
    assert seen == starting
    (tmp_path / "rank-1").write_text("3 restore 77 1.5\n")  # a record without the word
    assert read_beats(tmp_path)[1].starting


def test_heartbeat_is_a_no_op_outside_shardctl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDCTL_HEARTBEAT_DIR", raising=False)
    monkeypatch.setattr(heartbeat, "_writer_ready", False)
    monkeypatch.setattr(heartbeat, "_writer", None)
    heartbeat.beat(1)
    assert heartbeat._writer is None


# ------------------------------------------------------------------ the real process

# How long a test waits for a stand-in process to get somewhere: sized for a loaded
# machine (two busy loops on two cores start a Python process in seconds, not ms).
READY_S = 60.0


def _watchdog(
    tmp_path: Path,
    mode: str,
    timeout_s: str,
    *,
    ranks: int = 2,
    extra: dict | None = None,
) -> subprocess.Popen:
    """The watchdog over the stand-in launcher; its stderr goes to `watchdog.err`."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "SHARDCTL_RUN_DIR": str(run_dir),
        "SHARDCTL_HANG_TIMEOUT_S": timeout_s,
        "SHARDCTL_NODE_RANK": "0",
        "SHARDCTL_NNODES": "1",
        "SHARDCTL_ATTEMPT": "0",
        "FAKE_OUT": str(tmp_path),
        **(extra or {}),
    }
    for name in ("SHARDCTL_HEARTBEAT_DIR", "SHARDCTL_STARTUP_TIMEOUT_S",
                 "SHARDCTL_COLLECTIVE_TIMEOUT_S"):  # fmt: skip
        if name not in (extra or {}):
            env.pop(name, None)
    argv = [sys.executable, "-m", "shardctl.train.watchdog", "--", sys.executable,
            str(FAKE / "fake_launcher.py"), str(ranks), mode]  # fmt: skip
    with (tmp_path / "watchdog.err").open("w") as err:
        return subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )


def _err(tmp_path: Path) -> str:
    return (tmp_path / "watchdog.err").read_text()


def _wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen, tmp_path: Path) -> None:
    """Until `ready()` (a deadline-bounded poll); fails at once if the watchdog ended."""
    deadline = time.monotonic() + READY_S
    while not ready():
        assert proc.poll() is None, (
            f"the watchdog ended ({proc.returncode}) before {what}:\n" + _err(tmp_path)
        )
        assert time.monotonic() < deadline, f"no {what} within {READY_S:g} s:\n" + _err(tmp_path)
        time.sleep(0.1)


def _files(tmp_path: Path, pattern: str, ranks: int = 2) -> Callable[[], bool]:
    return lambda: all((tmp_path / pattern.format(rank)).exists() for rank in range(ranks))


def _rank_pids(tmp_path: Path, wait_s: float = READY_S) -> list[int]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        text = (tmp_path / "rank-pids").read_text() if (tmp_path / "rank-pids").exists() else ""
        if text.endswith("\n"):
            return [int(w) for w in text.split()]
        time.sleep(0.1)
    raise AssertionError("the fake launcher started no ranks")


def _finish(proc: subprocess.Popen, tmp_path: Path, timeout: float = 90) -> tuple[int, str]:
    """The watchdog's exit code and stderr; whatever is left of its tree is killed."""
    try:
        proc.wait(timeout=timeout)
        return proc.returncode, _err(tmp_path)
    finally:
        _clean_up(proc, tmp_path)


def _clean_up(proc: subprocess.Popen, tmp_path: Path) -> None:
    """Kill the watchdog's group and every stand-in rank (by PID; a stopped one too)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    if (tmp_path / "rank-pids").exists():
        for pid in _rank_pids(tmp_path, 0.1):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


def _stop_with_term(proc: subprocess.Popen, pids: list[int], tmp_path: Path) -> tuple[int, str]:
    """SIGTERM to the watchdog (passed to the launcher); the stand-in launcher leaves
    its ranks behind (torchrun would stop them): they are killed by PID."""
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=READY_S)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return _finish(proc, tmp_path)


@pytest.mark.timeout(180)
def test_a_hung_node_is_ended_with_every_stack_and_exit_124(tmp_path: Path) -> None:
    proc = _watchdog(tmp_path, "stuck", "3")
    code, err = _finish(proc, tmp_path)
    assert code == EXIT_HUNG, err
    # Both ranks' stacks, in the node's log and in the report file, naming the function.
    assert err.count("Python stack, most recent call first") == 2
    assert "stuck_in_a_collective" in err and "waiting_for_peers" in err
    assert "last at step 3 (step)" in err and "in start-up" not in err
    marker = json.loads((tmp_path / "run" / HUNG_FILE).read_text())
    assert marker["step"] == 3 and marker["node"] == 0 and marker["timeout_s"] == 3.0
    # Past the first step: the hang timeout, not the start-up allowance (900 s here).
    assert 3.0 <= marker["idle_s"] < 3.0 + 30, marker  # a poll late, on a loaded machine
    assert marker["rule"].startswith("hang timeout 3 s"), marker
    assert [r["rank"] for r in marker["ranks"]] == [0, 1]
    assert marker["first"] == []  # both stopped together, neither stopped or in D state
    report = Path(marker["report"]).read_text()
    assert "stuck_in_a_collective" in report and "rank 1" in report
    assert not any(alive(pid) for pid in _rank_pids(tmp_path, 0.1))  # every rank ended


@pytest.mark.timeout(180)
def test_a_stopped_rank_is_named_and_still_gives_its_stack(tmp_path: Path) -> None:
    proc = _watchdog(tmp_path, "wait", "4")
    try:
        pids = _rank_pids(tmp_path)
        # Both ranks past step 2 (out of start-up), sleeping in step 3.
        _wait_for("both ranks in step 3", _files(tmp_path, "rank-{}-waiting"), proc, tmp_path)
        os.kill(pids[1], signal.SIGSTOP)
        code, err = _finish(proc, tmp_path)
    finally:
        _clean_up(proc, tmp_path)
    assert code == EXIT_HUNG, err
    assert "stopped (SIGSTOP)" in err and "← stopped advancing first" in err
    marker = json.loads((tmp_path / "run" / HUNG_FILE).read_text())
    assert marker["first"] == [1]
    assert err.count("Python stack, most recent call first") == 2
    assert err.count("fake_rank.py") >= 2  # the stopped rank answered once continued


@pytest.mark.timeout(180)
def test_a_slow_but_alive_rank_is_never_ended(tmp_path: Path) -> None:
    # Rank 1 sleeps 2.5 s inside each of four steps after its start-up; the timeout is
    # 8 s (a step's wake-up may come seconds late on a loaded machine).
    code, err = _finish(_watchdog(tmp_path, "slow", "8"), tmp_path)
    assert code == 0, err
    assert "HUNG" not in err and not (tmp_path / "run" / HUNG_FILE).exists()


# Start-up: from the first heartbeat until the first training step finished.


@pytest.mark.timeout(180)
def test_a_long_start_up_within_its_allowance_is_not_ended(tmp_path: Path) -> None:
    # Every rank stays 10 s in start-up (a slow import on a loaded node): over 3× the
    # hang timeout of 3 s, well within the start-up allowance of 120 s.
    extra = {"SHARDCTL_STARTUP_TIMEOUT_S": "120", "FAKE_STARTUP_S": "10"}
    code, err = _finish(_watchdog(tmp_path, "startup-slow", "3", extra=extra), tmp_path)
    assert code == 0, err
    assert "HUNG" not in err and not (tmp_path / "run" / HUNG_FILE).exists()
    # The watchdog's first line states both limits and where they come from.
    first = err.splitlines()[0]
    assert "hang timeout 3 s (watchdog.hang_timeout_s)" in first, first
    assert "start-up allowance 120 s (watchdog.startup_timeout_s" in first, first
    assert "until it finished its first training step" in first, first


@pytest.mark.timeout(180)
def test_a_rank_stuck_in_start_up_is_ended_after_the_allowance(tmp_path: Path) -> None:
    extra = {"SHARDCTL_STARTUP_TIMEOUT_S": "12"}
    began = time.monotonic()
    code, err = _finish(_watchdog(tmp_path, "startup-stuck", "3", extra=extra), tmp_path)
    assert code == EXIT_HUNG, err
    assert time.monotonic() - began >= 12  # not at the hang timeout of 3 s
    assert err.count("stuck_in_startup") >= 2, err  # both ranks' stacks
    assert "(start, in start-up)" in err and "start-up allowance 12 s" in err, err
    marker = json.loads((tmp_path / "run" / HUNG_FILE).read_text())
    assert marker["timeout_s"] == 12.0 and marker["idle_s"] >= 12.0, marker
    assert marker["rule"].startswith("start-up allowance 12 s"), marker
    assert [r["phase"] for r in marker["ranks"]] == ["start", "start"]


@pytest.mark.timeout(180)
def test_after_the_first_step_the_hang_timeout_applies(tmp_path: Path) -> None:
    # Rank 1 stops in step 4, past its start-up; a start-up allowance of 600 s must
    # not delay the verdict: it comes after the hang timeout of 3 s.
    extra = {"SHARDCTL_STARTUP_TIMEOUT_S": "600"}
    code, err = _finish(_watchdog(tmp_path, "stuck", "3", extra=extra), tmp_path)
    assert code == EXIT_HUNG, err
    marker = json.loads((tmp_path / "run" / HUNG_FILE).read_text())
    assert marker["timeout_s"] == 3.0 and marker["idle_s"] < 3.0 + 30, marker
    assert "in start-up" not in err


@pytest.mark.timeout(90)
def test_the_launchers_exit_code_passes_through(tmp_path: Path) -> None:
    code, err = _finish(_watchdog(tmp_path, "exit3", "30"), tmp_path)
    assert code == 3, err


@pytest.mark.timeout(120)
def test_signals_reach_the_launcher_and_the_ranks(tmp_path: Path) -> None:
    # No hang is looked at here: a timeout a loaded CI host cannot reach (with 30 s, the
    # ranks waiting for this test's signal were once declared hung first).
    proc = _watchdog(tmp_path, "wait", "120")
    try:
        pids = _rank_pids(tmp_path)
        _wait_for("the ranks' USR2 handlers", _files(tmp_path, "rank-{}-ready"), proc, tmp_path)
        os.kill(proc.pid, signal.SIGUSR2)  # preemption: to the ranks, not the launcher
        _wait_for("USR2 at both ranks", _files(tmp_path, "rank-{}-got-USR2"), proc, tmp_path)
        assert proc.poll() is None  # the launcher did not die of USR2
        code, err = _stop_with_term(proc, pids, tmp_path)  # the launcher stops its way
    finally:
        _clean_up(proc, tmp_path)
    assert code == 7, err
    assert (tmp_path / "launcher-got-TERM").exists()
    assert not (tmp_path / "run" / HUNG_FILE).exists()


@pytest.mark.timeout(120)
def test_a_node_whose_peers_were_declared_hung_exits_124(tmp_path: Path) -> None:
    # Another node's watchdog wrote HUNG; this node's ranks then fail (exit 3 here).
    proc = _watchdog(tmp_path, "exit3", "30", extra={"SHARDCTL_NNODES": "2"})
    _rank_pids(tmp_path)  # the watchdog runs: a marker from now on is of this attempt
    (tmp_path / "run" / HUNG_FILE).write_text(json.dumps({"node": 1, "step": 2}) + "\n")
    code, err = _finish(proc, tmp_path)
    assert code == EXIT_HUNG, err
    assert "node 1 declared the job hung" in err


@pytest.mark.timeout(120)
def test_under_a_node_task_that_reads_the_markers_a_lost_peer_keeps_its_exit(
    tmp_path: Path,
) -> None:
    """Slurm's node task judges from the markers: the watchdog neither waits for another
    node's HUNG (10 s on every crash of a multi-node job) nor rewrites the exit."""
    proc = _watchdog(
        tmp_path, "exit3", "30",
        extra={"SHARDCTL_NNODES": "2", "SHARDCTL_NODE_SUPERVISOR": "slurm"},
    )  # fmt: skip
    _rank_pids(tmp_path)
    (tmp_path / "run" / HUNG_FILE).write_text(json.dumps({"node": 1, "step": 2}) + "\n")
    code, err = _finish(proc, tmp_path)
    assert code == 3, err
    assert "declared the job hung" not in err


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["--"]) == 2
    assert "usage: python3 -m shardctl.train.watchdog" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_missing_launcher_is_named(tmp_path: Path) -> None:
    env = dict(os.environ)
    done = subprocess.run(
        [sys.executable, "-m", "shardctl.train.watchdog", "--", str(tmp_path / "no-such")],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 127
    assert "cannot start" in done.stderr and "no-such" in done.stderr


@pytest.mark.timeout(120)
def test_a_stack_asked_for_by_hand_reaches_the_nodes_log(tmp_path: Path) -> None:
    proc = _watchdog(tmp_path, "wait", "120")  # no hang here (see the test above)
    try:
        pids = _rank_pids(tmp_path)
        _wait_for("the ranks' stack dumps", _files(tmp_path, "rank-{}-ready"), proc, tmp_path)
        os.kill(pids[0], signal.SIGQUIT)  # `kill -QUIT <rank pid>`
        # The watchdog passes it on at its next poll (every 5 s at most).
        _wait_for("the stack in the log", lambda: "on SIGQUIT" in _err(tmp_path), proc, tmp_path)
        assert alive(pids[0])  # the rank goes on
        code, err = _stop_with_term(proc, pids, tmp_path)
    finally:
        _clean_up(proc, tmp_path)
    assert code == 7, err  # the stand-in launcher stops on TERM with 7
    assert "rank 0 (pid" in err and "Python stack on SIGQUIT" in err
    assert "fake_rank.py" in err and "rank 1 (pid" not in err


def test_the_watchdog_and_the_heartbeat_import_nothing_heavy() -> None:
    # The watchdog starts before every launcher, the heartbeat inside every rank.
    probe = (
        "import sys, shardctl.train.watchdog, shardctl.train.heartbeat, shardctl.train.entry; "
        "print(sorted(m for m in ('torch', 'numpy', 'yaml', 'pydantic', 'transformers') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_marker_keeps_the_node_that_names_the_culprit(tmp_path: Path) -> None:
    from shardctl.train.watchdog import RankView, Verdict, write_hung_marker

    def verdict(times: list[float]) -> Verdict:
        # pids that do not exist: the process state is unknown, the beat times decide
        views = [RankView(_beat(r, 5, t, pid=2**22 + r), 0.0) for r, t in enumerate(times)]
        return Verdict(20.0, 15.0, views)

    rule, since = HangRule(explicit=15.0), time.time()
    write_hung_marker(str(tmp_path), verdict([100.0, 90.0]), rule, 1, 0, "r1", since)
    marker = json.loads((tmp_path / HUNG_FILE).read_text())
    assert marker["first"] == [1]
    # The typed outcome the classifier reads: hung, the rank stuck first, step, node.
    assert (marker["kind"], marker["rank"], marker["step"], marker["node"]) == ("hung", 1, 5, 1)
    # Another node, whose ranks all wait together, names nobody: the first one stays.
    write_hung_marker(str(tmp_path), verdict([100.0, 100.0]), rule, 0, 0, "r0", since)
    assert json.loads((tmp_path / HUNG_FILE).read_text())["report"] == "r1"
    # A marker of an earlier attempt is replaced.
    write_hung_marker(str(tmp_path), verdict([100.0, 100.0]), rule, 0, 0, "r0", since + 60)
    assert json.loads((tmp_path / HUNG_FILE).read_text())["report"] == "r0"


def test_the_node_that_names_the_culprit_writes_again_after_a_same_instant_declaration(
    tmp_path: Path,
) -> None:
    """Two nodes' watchdogs that declare in the same instant both find no marker and
    both write; when the one that names nobody lands last, the other writes again
    (from a CI run: node 0's marker kept, the stopped rank's node not left behind)."""
    from shardctl.train.watchdog import RankView, Verdict, keep_hung_marker, write_hung_marker

    def verdict(times: list[float]) -> Verdict:
        views = [RankView(_beat(r, 5, t, pid=2**22 + r), 0.0) for r, t in enumerate(times)]
        return Verdict(20.0, 15.0, views)

    rule, since = HangRule(explicit=15.0), time.time()
    mine = write_hung_marker(str(tmp_path), verdict([100.0, 90.0]), rule, 1, 0, "r1", since)
    assert mine is not None and mine["first"] == [1]
    # Node 0 looked before node 1 wrote (here: in a run dir of its own), and writes
    # after it: its marker names nobody.
    (tmp_path / "looked").mkdir()
    theirs = write_hung_marker(str(tmp_path / "looked"), verdict([100.0, 100.0]), rule, 0, 0,
                               "r0", since)  # fmt: skip
    assert theirs is not None and theirs["first"] == []
    RunDir.of(tmp_path).write_marker(HUNG_FILE, theirs)
    keep_hung_marker(str(tmp_path), mine, since)
    assert json.loads((tmp_path / HUNG_FILE).read_text())["report"] == "r1"
    # A node that names nobody never writes again; one that names the culprit does not
    # replace a marker that names one too.
    RunDir.of(tmp_path).write_marker(HUNG_FILE, theirs)
    keep_hung_marker(str(tmp_path), theirs, since)
    assert json.loads((tmp_path / HUNG_FILE).read_text())["report"] == "r0"
    named = {**mine, "report": "r2", "first": [2]}
    RunDir.of(tmp_path).write_marker(HUNG_FILE, named)
    keep_hung_marker(str(tmp_path), mine, since)
    assert json.loads((tmp_path / HUNG_FILE).read_text())["report"] == "r2"


def test_the_watchdog_names_the_launcher_not_the_python_of_its_wrapper() -> None:
    from shardctl.train.watchdog import launcher_name

    wrapped = ["/venv/bin/python", "-m", "shardctl.orchestrator.launch_wrapper", "torchrun",
               "--nnodes", "1"]  # fmt: skip
    assert launcher_name(wrapped) == "torchrun"
    assert launcher_name(["deepspeed", "--num_gpus", "2"]) == "deepspeed"


# ------------------------------------------------------------------ stacks

# A rank whose stack is written in two parts with a second of running between them:
# what faulthandler does when the rank is preempted between two of its writes on a
# loaded host. The first part ends inside a frame's line, as the CI run's report did.
_SLOW_WRITER = """
import os, signal, sys, time
path, ready = sys.argv[1], sys.argv[2]
def dump(signum, frame):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"Thread 0x1 (most recent call first):\\n  File ")
    until = time.monotonic() + 1.5
    while time.monotonic() < until:  # running, not sleeping: preempted mid-stack
        pass
    os.write(fd, b'"loop.py", line 7 in train\\n')
    os.close(fd)
signal.signal(signal.SIGQUIT, dump)
open(ready, "w").close()
while True:
    time.sleep(0.2)
"""


def test_a_stopped_ranks_stack_is_read_whole_when_its_writer_pauses_mid_line(
    tmp_path: Path,
) -> None:
    from shardctl.train.heartbeat import stack_path
    from shardctl.train.watchdog import RankView, collect_stacks

    ready = tmp_path / "ready"
    with (tmp_path / "watchdog.err").open("w") as err:  # what _wait_for shows on failure
        rank = subprocess.Popen(
            [sys.executable, "-c", _SLOW_WRITER, str(stack_path(tmp_path, 0)), str(ready)],
            stderr=err,
        )
    try:
        _wait_for("the stand-in rank's handler", ready.exists, rank, tmp_path)
        rank.send_signal(signal.SIGSTOP)  # the rank that stopped advancing
        view = RankView(Beat(0, 5, "step", rank.pid, time.time()), time.monotonic())
        stacks = collect_stacks(tmp_path, [view], {0: "T"})
        whole = 'Thread 0x1 (most recent call first):\n  File "loop.py", line 7 in train\n'
        assert stacks[0] == whole
    finally:
        rank.kill()
        rank.wait(timeout=30)
