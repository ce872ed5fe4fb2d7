"""torchrun's report of its own stop becomes one line; a user's traceback stays (once)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from shardctl.orchestrator.launcher_output import LauncherReport, readable

# What torchrun 2.13 printed when both ranks of a local run exited 42 (recorded from a
# real `shardctl submit --wait` with SHARDCTL_STOP_AFTER_STEP; paths shortened).
DATA = Path(__file__).parent / "data"
EXIT42 = (DATA / "torchrun-exit42.txt").read_text()
# torchrun 2.13 under `shardctl cancel` (SIGTERM to torchrun and its ranks), and both
# ranks of an entrypoint script raising ValueError, from real local runs (paths shortened).
CANCELLED = (DATA / "torchrun-cancelled.txt").read_text()
CRASHED = (DATA / "torchrun-script-crashed.txt").read_text()
# The same cancel, the signal arriving while torchrun logged "Sending process ...":
# Python's "--- Logging error ---" report, then the usual chain, with a rank's lines.
MID_LOG = (DATA / "torchrun-cancelled-mid-log.txt").read_text()
# ... and the signal again while logging printed that report: no call stack, four
# chained tracebacks, torchrun's warnings and a rank's lines in between.
INTERRUPTED = (DATA / "torchrun-cancelled-log-interrupted.txt").read_text()
# ... and a rank's log line landed inside the last exception's line, which Python
# writes in pieces: "torch...api" + "[rank 0] INFO ...complete\n" + ".SignalException: ...".
SPLICED = (DATA / "torchrun-cancelled-spliced.txt").read_text()
# ... and the signal again inside logging's own handling of a level-cache miss (CI): a
# KeyError of logging's chained between torchrun's SignalExceptions.
KEYERROR = (DATA / "torchrun-cancelled-logging-keyerror.txt").read_text()
WHERE = "/runs/job/logs/launcher.err"
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
    texts = {
        BEFORE + EXIT42 + AFTER: 1, CANCELLED + AFTER: 1, BEFORE + CRASHED: 1, MID_LOG: 2,
        INTERRUPTED: 1, SPLICED: 1, KEYERROR: 1,
    }  # fmt: skip
    for text, blocks in texts.items():
        report = LauncherReport()
        out = "".join(report.feed(text[i : i + size]) for i in range(0, len(text), size))
        out += report.close()
        assert out == readable(text) and report.replaced == blocks


def test_a_cancel_is_one_line_naming_the_signal_and_the_file() -> None:
    """73 lines (torchrun's teardown chatter, three chained SignalException tracebacks)."""
    assert CANCELLED.count("Traceback") == 3 and len(CANCELLED.splitlines()) == 73
    out = readable(BEFORE + CANCELLED + AFTER, where=WHERE)
    assert out == (
        BEFORE + "[shardctl] the launcher received SIGTERM and stopped its ranks (not a crash; "
        f"its full report is in {WHERE})\n" + AFTER
    )


def test_a_signal_amid_torchruns_logging_is_the_same_one_line_said_once() -> None:
    assert MID_LOG.count("Traceback") == 4 and "--- Logging error ---" in MID_LOG
    rank = "[rank 0] INFO shardctl.train.checkpoint: checkpoint /tmp/run/d1/checkpoints/"
    assert readable(MID_LOG, where=WHERE).splitlines() == [
        "[shardctl] the launcher received SIGTERM and stopped its ranks (not a crash; its "
        f"full report is in {WHERE})",
        "[rank 0] INFO shardctl.train.checkpoint: retention (keep 2): deleting "
        "/tmp/run/d1/checkpoints/step-00000002",
        f"{rank}step-00000005 complete",
    ]


@pytest.mark.parametrize(
    "text",
    [CANCELLED, MID_LOG, INTERRUPTED, KEYERROR],
    ids=["plain", "mid", "twice", "logging-keyerror"],
)
def test_every_shape_of_a_cancel_is_the_one_line_and_the_ranks_lines(text: str) -> None:
    out = readable(text, where=WHERE)
    assert "Traceback" not in out and "Logging error" not in out and "W1125" not in out
    line = "[shardctl] the launcher received SIGTERM and stopped its ranks"
    assert out.count(line) == 1
    ranks = [x for x in text.splitlines() if x.startswith("[rank ")]
    assert [x for x in out.splitlines() if not x.startswith(line)] == ranks


def test_a_ranks_line_inside_the_launchers_last_line_is_taken_out_and_the_line_mended() -> None:
    """From a real cancel (CI): without the mend the chain's last traceback ended at the
    broken line and the whole report was shown, three tracebacks."""
    spliced = "torch.distributed.elastic.multiprocessing.api[rank 0] INFO shardctl.train"
    assert spliced in SPLICED and SPLICED.count("Traceback") == 3
    assert readable(SPLICED, where=WHERE).splitlines() == [
        SPLICED.splitlines()[0],  # the watchdog's line
        "[rank 0] INFO shardctl.train.checkpoint: no complete checkpoint in "
        "/tmp/run/d1/checkpoints: starting from step 0",
        # Shown where it came, before the traceback it landed in had ended.
        "[rank 0] INFO shardctl.train.checkpoint: checkpoint "
        "/tmp/run/d1/checkpoints/step-00000004 complete",
        "[shardctl] the launcher received SIGTERM and stopped its ranks (not a crash; its "
        f"full report is in {WHERE})",
    ]


def test_an_exception_of_loggings_own_amid_the_signals_chain_is_part_of_it() -> None:
    """From a real cancel (CI): logging's KeyError, raised and caught in its normal
    course, is chained in when the signal lands in its handler."""
    assert KEYERROR.count("Traceback") == 4 and "\nKeyError: 30\n" in KEYERROR
    assert readable(KEYERROR, where=WHERE).splitlines() == [
        KEYERROR.splitlines()[0],
        "[shardctl] the launcher received SIGTERM and stopped its ranks (not a crash; its "
        f"full report is in {WHERE})",
    ]


def test_an_exception_of_torchruns_own_amid_the_signals_chain_is_shown() -> None:
    """The same exception raised anywhere but in logging's code, or ending the chain, is
    an error of torchrun's: the whole report is shown."""
    logging_frame = '  File "/usr/lib/python3.11/logging/__init__.py", line 1742, in isEnabledFor'
    elsewhere = logging_frame.replace("logging/__init__.py", "site-packages/torch/x.py")
    assert logging_frame in KEYERROR
    moved = KEYERROR.replace(logging_frame, elsewhere)
    assert readable(moved) == moved
    last = KEYERROR.rindex("Traceback (most recent call last):")
    ending = KEYERROR[:last] + KEYERROR[last:].replace(
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 3272 got "
        "signal: 15",
        "RuntimeError: rendezvous closed",
    )
    assert ending != KEYERROR and readable(ending) == ending


def test_only_a_line_inside_an_exceptions_name_is_taken_out() -> None:
    """A frame's source line or a message that quotes shardctl's own words is a user's
    text: kept as it is."""
    quoted = (
        "Traceback (most recent call last):\n"
        '  File "train.py", line 3, in <module>\n'
        '    print(f"[shardctl] node 0: {x}")\n'
        "ValueError: see [rank 3] INFO shardctl.train: saved\n"
        "a line printed afterwards\n"
    )
    assert readable(quoted) == quoted


def test_a_logging_error_of_the_users_own_is_kept() -> None:
    error = (
        "--- Logging error ---\nTraceback (most recent call last):\n"
        '  File "train.py", line 3, in log\n'
        "TypeError: not all arguments converted\nCall stack:\n"
        '  File "train.py", line 9, in <module>\n'
        "Message: 'x %s'\nArguments: (1, 2)\n"
    )
    assert readable(error) == error


def test_a_ranks_line_amid_a_traceback_is_shown_and_the_traceback_read_on() -> None:
    lines = CRASHED.splitlines(keepends=True)
    mixed = "".join([*lines[:4], "[rank 1] INFO x: saved\n", *lines[4:]])
    out = readable(mixed)
    # The traceback is held until it ends: the rank's line comes first, nothing is lost.
    assert out.startswith("[rank 1] INFO x: saved\n" + "".join(lines[:11]))
    assert "another rank printed the same" in out


def test_a_script_crash_shows_the_users_traceback_once_and_no_launcher_report() -> None:
    out = readable(CRASHED, where=WHERE)
    assert "ChildFailedError" not in out and "=====" not in out
    assert out.count("Traceback") == 1 and out.count('File "/tmp/run/crash.py", line 3') == 1
    assert "ValueError: bad thing on rank 1\n" in out
    lines = out.splitlines()
    assert lines[-2] == (
        "[shardctl] another rank printed the same traceback, ending: ValueError: bad thing on "
        "rank 0"
    )
    assert lines[-1] == (
        "[shardctl] the launcher reports rank 0 ended first (exit 1), then rank 1 (exit 1); "
        f"its full report is in {WHERE}"
    )
    assert len(lines) == 13  # the first traceback (11 lines) and two lines


def test_a_failure_report_is_one_line_naming_each_rank() -> None:
    """One rank crashed (exit 1) while the other saved: the line says which did what."""
    crashed = readable(_exit_of(EXIT42, rank=1, code="1"))
    assert crashed == (
        "[shardctl] the launcher reports rank 0 ended first (exit 42), then rank 1 (exit 1); "
        "its full report is in its log\n"
    )
    killed = readable(_exit_of(_exit_of(EXIT42, rank=0, code="-9"), rank=1, code="-15"))
    assert killed.startswith(
        "[shardctl] the launcher reports rank 0 ended first (killed by SIGKILL), then stopped "
        "the other ranks;"
    )


def test_a_report_holding_a_ranks_traceback_is_kept_whole() -> None:
    """A rank that used torch's @record has an error file: the report is its traceback."""
    recorded = _exit_of(EXIT42, rank=0, code="1").replace(
        "error_file: <N/A>", "error_file: /tmp/torchelastic_x/error.json", 1
    )
    assert readable(recorded) == recorded


def test_a_users_own_tracebacks_are_never_hidden() -> None:
    """A chain of the user's exceptions, and a different traceback from another rank."""
    chain = (
        "Traceback (most recent call last):\n"
        '  File "train.py", line 3, in <module>\n'
        "    load()\n"
        "KeyError: 'x'\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "train.py", line 5, in <module>\n'
        "    raise RuntimeError('no x')\n"
        "RuntimeError: no x\n"
    )
    other = chain.replace("line 5", "line 9")
    assert readable(chain + AFTER + other) == chain + AFTER + other
    assert readable(chain + "\n" + AFTER) == chain + "\n" + AFTER


def test_ranks_torchrun_tore_down_after_the_preempted_one_are_not_a_failure() -> None:
    """Rank 0 exited 42 first; torchrun then sent SIGTERM to rank 1 (exit -15)."""
    torn = _exit_of(EXIT42, rank=1, code="-15")
    assert torn != EXIT42
    assert "stopped for a preemption" in readable(torn)


def test_an_unfinished_report_is_let_through() -> None:
    cut = EXIT42[: EXIT42.index("Root Cause")]
    assert readable(cut) == cut
    assert readable("no newline at the end") == "no newline at the end"
    unfinished = CANCELLED[: CANCELLED.rindex("torch.distributed.elastic.multiprocessing.api")]
    assert readable(unfinished).endswith(unfinished[unfinished.index("Traceback") :])
