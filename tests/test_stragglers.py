"""Stragglers: per-rank step times in the metrics and `status` naming the slowest rank.

Fast: `progress.straggler` on hand-written metrics lines, the per-rank fields and the
console note. Slow (real launcher, 2 CPU ranks): a user script on `shardctl.train.api`
whose rank 1 sleeps after every optimizer step, submitted on the local cluster —
its metrics lines and `shardctl status` name rank 1; and one tiny run of the built-in
loop whose lines carry the per-rank fields. Every process started has a timeout and
is killed by process group (and pid) when it overruns.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.ckpt_run import ROOT, child_env, free_port
from helpers.shared_runs import TinyRun
from helpers.train_run import metrics
from shardctl.orchestrator.progress import straggler
from shardctl.orchestrator.rundir import CONTRACT_ENV
from shardctl.train.metrics import rank_times, slow_note

CODE = ROOT / "tests" / "data" / "usercode"
SHARDCTL = str(Path(sys.executable).parent / "shardctl")


def write_rows(run_dir: Path, rows: list[dict[str, Any] | str]) -> Path:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    (run_dir / "logs" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def row(step: int, slowest: int, slow_s: float = 0.5, median_s: float = 0.3, **more: Any) -> dict:
    return {
        "step": step,
        "loss": 1.0,
        "step_s_min": 0.1,
        "step_s_median": median_s,
        "step_s_max": slow_s,
        "slowest_rank": slowest,
        **more,
    }


# ------------------------------------------------------------------ fast


def test_a_rank_slowest_in_most_of_the_last_steps_is_named(tmp_path: Path) -> None:
    # Older lines (a different picture) are outside the window of the last 10.
    rows = [row(s, 0) for s in range(1, 6)] + [row(s, 1) for s in range(6, 15)]
    rows.insert(10, row(99, 0))  # one of the last 10 with another slowest rank
    line = straggler(write_rows(tmp_path, rows))
    assert line == (
        "rank 1 is the slowest in 9 of the last 10 logged steps (step time 0.5 s vs a median 0.3 s)"
    )


def test_no_straggler_when_it_alternates_is_close_or_too_few_lines(tmp_path: Path) -> None:
    alternating = [row(s, s % 2) for s in range(1, 11)]
    assert straggler(write_rows(tmp_path / "alt", alternating)) is None
    # 7 of 10 is under 80 %.
    seven = [row(s, 1 if s <= 7 else 0) for s in range(1, 11)]
    assert straggler(write_rows(tmp_path / "seven", seven)) is None
    # Always the same rank, but only 5 % slower than the median: noise, not a straggler.
    close = [row(s, 1, slow_s=0.315) for s in range(1, 11)]
    assert straggler(write_rows(tmp_path / "close", close)) is None
    few = [row(s, 1) for s in range(1, 5)]
    assert straggler(write_rows(tmp_path / "few", few)) is None
    # One rank (no per-rank fields) and a run dir without metrics.
    one_rank = [{"step": s, "loss": 1.0} for s in range(1, 11)]
    assert straggler(write_rows(tmp_path / "one", one_rank)) is None
    assert straggler(tmp_path / "nothing") is None


def test_corrupt_and_odd_lines_are_skipped(tmp_path: Path) -> None:
    rows: list[dict[str, Any] | str] = [row(s, 1) for s in range(1, 6)]
    rows[1:1] = ['{"step": 3, "slowest_rank": 1, "step_s_m', "not json", "[1, 2]", ""]
    rows.append(row(6, True))  # a bool is no rank
    rows.append(row(7, 1, slow_s="fast"))  # a time that is no number
    rows.append('{"step": 8, "slowest_rank": 1, "step_s_max": 0.5')  # cut short by a kill
    line = straggler(write_rows(tmp_path, rows))
    assert line is not None and line.startswith("rank 1 is the slowest in 5 of the last 5 ")


def test_a_rank_slow_at_loading_data_is_named(tmp_path: Path) -> None:
    # Step times even (the others wait for it in the first collective), data time not.
    data = {"data_s_median": 0.01, "data_s_max": 0.2, "data_slowest_rank": 3}
    rows = [row(s, s % 2, slow_s=0.52, median_s=0.5, **data) for s in range(1, 11)]
    line = straggler(write_rows(tmp_path / "data", rows))
    assert line == (
        "rank 3 is the slowest at loading data in 10 of the last 10 logged steps "
        "(data time 0.2 s vs a median 0.01 s)"
    )
    # Consistently slowest at data, but by microseconds of a 0.5 s step: not named.
    tiny = {"data_s_median": 1e-4, "data_s_max": 2e-4, "data_slowest_rank": 3}
    rows = [row(s, 1, **tiny) for s in range(1, 11)]
    line = straggler(write_rows(tmp_path / "tiny", rows))
    assert line is not None and "loading data" not in line and line.startswith("rank 1 ")


def test_rank_times_and_the_console_note() -> None:
    fields = rank_times([0.3, 0.5, 0.31, 0.29], [0.01, 0.0, 0.2, 0.01])
    assert fields == {
        "step_s_min": 0.29,
        "step_s_median": 0.305,
        "step_s_max": 0.5,
        "slowest_rank": 1,
        "data_s_median": 0.01,
        "data_s_max": 0.2,
        "data_slowest_rank": 2,
    }
    assert slow_note(fields) == "  slowest rank 1 (1.64× the median)"
    assert slow_note(rank_times([0.3, 0.33])) == ""  # under 1.2×
    assert slow_note(None) == ""


# ------------------------------------------------------------------ slow


def _shardctl(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run the CLI in its own session; on a timeout kill its process group and every
    process under it (torchrun puts each rank in a session of its own)."""
    from helpers.ckpt_run import kill_group

    env = {k: v for k, v in child_env().items() if k not in CONTRACT_ENV}
    proc = subprocess.Popen(
        [SHARDCTL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, cwd=cwd, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{args} timed out:\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_a_sleeping_rank_of_your_script_is_named_by_status(tmp_path: Path) -> None:
    steps, log_every = 12, 2
    args = ["--steps", str(steps), "--log-every", str(log_every), "--sleep", "0.15"]
    spec = tmp_path / "slow.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "slow",
                "run_dir": str(tmp_path / "slow"),
                "resources": {"procs_per_node": 2, "device": "cpu"},
                "entrypoint": {"script": str(CODE / "straggler.py"), "args": args},
                "checkpoint": {"every_steps": 5},
                "local": {"master_port": free_port()},
            }
        )
    )
    res = _shardctl(["submit", str(spec), "--wait"], tmp_path, 240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    rows = metrics(tmp_path / "slow")
    assert [r["step"] for r in rows] == list(range(log_every, steps + 1, log_every))
    for r in rows:
        assert r["step_s_min"] <= r["step_s_median"] <= r["step_s_max"], r
    # Every line but possibly the first (whose steps include start-up) names rank 1,
    # about 0.15 s slower per step than rank 0 (which waited in the agreement instead).
    assert sum(r["slowest_rank"] == 1 for r in rows) >= len(rows) - 1, rows
    assert all(r["step_s_max"] - r["step_s_min"] > 0.1 for r in rows[1:]), rows

    line = straggler(tmp_path / "slow")
    assert line is not None and line.startswith("rank 1 is the slowest in "), line
    status = _shardctl(["status", "slow"], tmp_path, 60)
    assert status.returncode == 0, status.stderr
    first, *notes = status.stdout.splitlines()  # the state, then indented notes
    assert "SUCCEEDED" in first and f"step {steps}" in first
    assert f"  straggler: {line}" in notes, notes
    data = json.loads(_shardctl(["status", "slow", "-o", "json"], tmp_path, 60).stdout)
    assert data["straggler"] == line


@pytest.mark.slow
def test_the_built_in_loop_logs_per_rank_times(tiny_run: TinyRun) -> None:
    """The shared tiny 2-rank run (6 steps, logged every 2)."""
    rows = metrics(tiny_run.run_dir)
    assert [r["step"] for r in rows] == [2, 4, 6]
    for r in rows:
        assert 0 < r["step_s_min"] <= r["step_s_median"] <= r["step_s_max"], r
        assert r["slowest_rank"] in (0, 1) and r["data_slowest_rank"] in (0, 1)
        assert 0 <= r["data_s_median"] <= r["data_s_max"] < r["step_s_max"], r
        # Seconds of the window tokens/s measures (from the end of the previous step,
        # saves left out), less rank 0's agreement: the same size, loosely.
        window = 2 * 32 * 2 * 2 / r["tokens_per_s"]  # micro-batch × seq × accum × ranks
        assert 0.5 * window < r["step_s_max"] < 1.5 * window, (r, window)
    assert "step      6/6  loss" in tiny_run.stdout  # the console line is unchanged
