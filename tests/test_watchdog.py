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
from pathlib import Path

import pytest
from shardctl.orchestrator.proctree import alive
from shardctl.orchestrator.rundir import EXIT_HUNG, HUNG_FILE
from shardctl.train import heartbeat
from shardctl.train.heartbeat import Beat, read_beats
from shardctl.train.watchdog import (
    FLOOR_S,
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
    # Nothing measured yet: start-up, restore and saves get more.
    assert rule.limit("save") == rule.limit("start") == rule.limit("restore") == UNMEASURED_FLOOR_S
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


def test_heartbeat_is_a_no_op_outside_shardctl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDCTL_HEARTBEAT_DIR", raising=False)
    monkeypatch.setattr(heartbeat, "_writer_ready", False)
    monkeypatch.setattr(heartbeat, "_writer", None)
    heartbeat.beat(1)
    assert heartbeat._writer is None


# ------------------------------------------------------------------ the real process


def _watchdog(
    tmp_path: Path, mode: str, timeout_s: str, *, ranks: int = 2, extra: dict | None = None
) -> subprocess.Popen:
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
    env.pop("SHARDCTL_HEARTBEAT_DIR", None)
    argv = [sys.executable, "-m", "shardctl.train.watchdog", "--", sys.executable,
            str(FAKE / "fake_launcher.py"), str(ranks), mode]  # fmt: skip
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def _rank_pids(tmp_path: Path, wait_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        text = (tmp_path / "rank-pids").read_text() if (tmp_path / "rank-pids").exists() else ""
        if text.endswith("\n"):
            return [int(w) for w in text.split()]
        time.sleep(0.1)
    raise AssertionError("the fake launcher started no ranks")


def _finish(proc: subprocess.Popen, tmp_path: Path, timeout: float = 60) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if (tmp_path / "rank-pids").exists():
            for pid in _rank_pids(tmp_path, 0.1):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _stop_with_term(proc: subprocess.Popen, pids: list[int], tmp_path: Path) -> tuple[int, str]:
    """SIGTERM to the watchdog (passed to the launcher); the stand-in launcher leaves
    its ranks behind (torchrun would stop them) and they hold the pipe open."""
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return _finish(proc, tmp_path)


@pytest.mark.timeout(120)
def test_a_hung_node_is_ended_with_every_stack_and_exit_124(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = _watchdog(tmp_path, "stuck", "3")
    code, err = _finish(proc, tmp_path)
    took = time.monotonic() - started
    assert code == EXIT_HUNG, err
    assert took < 3 + 25, took  # the timeout, a poll, the stacks and the kill
    # Both ranks' stacks, in the node's log and in the report file, naming the function.
    assert err.count("Python stack, most recent call first") == 2
    assert "stuck_in_a_collective" in err and "waiting_for_peers" in err
    assert "last at step 3" in err
    marker = json.loads((tmp_path / "run" / HUNG_FILE).read_text())
    assert marker["step"] == 3 and marker["node"] == 0 and marker["timeout_s"] == 3.0
    assert [r["rank"] for r in marker["ranks"]] == [0, 1]
    assert marker["first"] == []  # both stopped together, neither stopped or in D state
    report = Path(marker["report"]).read_text()
    assert "stuck_in_a_collective" in report and "rank 1" in report
    assert not any(alive(pid) for pid in _rank_pids(tmp_path, 0.1))  # every rank ended


@pytest.mark.timeout(120)
def test_a_stopped_rank_is_named_and_still_gives_its_stack(tmp_path: Path) -> None:
    proc = _watchdog(tmp_path, "wait", "4")
    try:
        pids = _rank_pids(tmp_path)
        time.sleep(1.5)  # both ranks past step 2, sleeping at step 3
        os.kill(pids[1], signal.SIGSTOP)
        code, err = _finish(proc, tmp_path)
    finally:
        for pid in _rank_pids(tmp_path, 0.1):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    assert code == EXIT_HUNG, err
    assert "stopped (SIGSTOP)" in err and "← stopped advancing first" in err
    marker = json.loads((tmp_path / "run" / HUNG_FILE).read_text())
    assert marker["first"] == [1]
    assert err.count("Python stack, most recent call first") == 2
    assert err.count("fake_rank.py") >= 2  # the stopped rank answered once continued


@pytest.mark.timeout(120)
def test_a_slow_but_alive_rank_is_never_ended(tmp_path: Path) -> None:
    # Rank 1 sleeps 2.5 s inside each of four steps; the timeout is 4 s.
    code, err = _finish(_watchdog(tmp_path, "slow", "4"), tmp_path)
    assert code == 0, err
    assert "HUNG" not in err and not (tmp_path / "run" / HUNG_FILE).exists()


@pytest.mark.timeout(60)
def test_the_launchers_exit_code_passes_through(tmp_path: Path) -> None:
    code, err = _finish(_watchdog(tmp_path, "exit3", "30"), tmp_path)
    assert code == 3, err


@pytest.mark.timeout(60)
def test_signals_reach_the_launcher_and_the_ranks(tmp_path: Path) -> None:
    proc = _watchdog(tmp_path, "wait", "30")
    try:
        pids = _rank_pids(tmp_path)
        time.sleep(1.0)  # the ranks installed their USR2 handler
        os.kill(proc.pid, signal.SIGUSR2)  # preemption: to the ranks, not the launcher
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (tmp_path / "rank-1-got-USR2").exists():
            time.sleep(0.1)
        assert (tmp_path / "rank-0-got-USR2").exists() and (tmp_path / "rank-1-got-USR2").exists()
        assert proc.poll() is None  # the launcher did not die of USR2
        code, err = _stop_with_term(proc, pids, tmp_path)  # the launcher stops its way
    finally:
        for pid in _rank_pids(tmp_path, 0.1):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert code == 7, err
    assert (tmp_path / "launcher-got-TERM").exists()
    assert not (tmp_path / "run" / HUNG_FILE).exists()


@pytest.mark.timeout(60)
def test_a_node_whose_peers_were_declared_hung_exits_124(tmp_path: Path) -> None:
    # Another node's watchdog wrote HUNG; this node's ranks then fail (exit 3 here).
    proc = _watchdog(tmp_path, "exit3", "30", extra={"SHARDCTL_NNODES": "2"})
    _rank_pids(tmp_path)  # the watchdog runs: a marker from now on is of this attempt
    (tmp_path / "run" / HUNG_FILE).write_text(json.dumps({"node": 1, "step": 2}) + "\n")
    code, err = _finish(proc, tmp_path)
    assert code == EXIT_HUNG, err
    assert "node 1 declared the job hung" in err


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


@pytest.mark.timeout(60)
def test_a_stack_asked_for_by_hand_reaches_the_nodes_log(tmp_path: Path) -> None:
    proc = _watchdog(tmp_path, "wait", "30")
    try:
        pids = _rank_pids(tmp_path)
        time.sleep(1.0)  # past the stack-dump install
        os.kill(pids[0], signal.SIGQUIT)  # `kill -QUIT <rank pid>`
        time.sleep(6.0)  # a few polls (every 3 s with a 30 s timeout)
        assert alive(pids[0])  # the rank goes on
        code, err = _stop_with_term(proc, pids, tmp_path)
    finally:
        for pid in _rank_pids(tmp_path, 0.1):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
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
