"""torchrun's crash report for ranks that stopped for a preemption becomes one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from shardctl.orchestrator.launcher_output import PreemptionReport, readable

# What torchrun 2.13 printed when both ranks of a local run exited 42 (recorded from a
# real `shardctl submit --wait` with SHARDCTL_STOP_AFTER_STEP; paths shortened).
EXIT42 = (Path(__file__).parent / "data" / "torchrun-exit42.txt").read_text()
BEFORE = "[rank 0] INFO shardctl.train.checkpoint: checkpoint step-00000005 complete\n"
AFTER = "a line printed afterwards\n"


def _exit_of(report: str, rank: int, code: str) -> str:
    """The report with rank `rank`'s exit code changed to `code`."""
    return re.sub(
        rf"(rank      : {rank} \(local_rank: {rank}\)\n  exitcode  : )42",
        rf"\g<1>{code}",
        report,
    )


def test_the_report_of_an_all_preempted_run_becomes_one_line() -> None:
    out = readable(BEFORE + EXIT42 + AFTER)
    assert "Traceback" not in out and "ChildFailedError" not in out and "=====" not in out
    assert out.startswith(BEFORE) and out.endswith(AFTER)
    assert "saved a checkpoint and stopped for a preemption" in out
    assert len(out.splitlines()) == 3


@pytest.mark.parametrize("size", [1, 7, 64, 4096])
def test_chunks_of_any_size_give_the_same_text(size: int) -> None:
    text = BEFORE + EXIT42 + AFTER
    report = PreemptionReport()
    out = "".join(report.feed(text[i : i + size]) for i in range(0, len(text), size))
    out += report.close()
    assert out == readable(text) and report.replaced == 1


def test_a_real_failure_keeps_its_whole_report() -> None:
    """One rank crashed (exit 1) while the other saved: that is a failure, shown in full."""
    crashed = _exit_of(EXIT42, rank=1, code="1")
    assert crashed != EXIT42
    assert readable(crashed) == crashed
    root = _exit_of(EXIT42, rank=0, code="1")
    assert root != EXIT42 and readable(root) == root


def test_ranks_torchrun_tore_down_after_the_preempted_one_are_not_a_failure() -> None:
    """Rank 0 exited 42 first; torchrun then sent SIGTERM to rank 1 (exit -15)."""
    torn = _exit_of(EXIT42, rank=1, code="-15")
    assert torn != EXIT42
    assert "stopped for a preemption" in readable(torn)


def test_an_unfinished_report_is_let_through() -> None:
    cut = EXIT42[: EXIT42.index("Root Cause")]
    assert readable(cut) == cut
    assert readable("no newline at the end") == "no newline at the end"
