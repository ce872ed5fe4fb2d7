"""Issue 35 (first contact, round 4), the jobs command line on this machine: the test
session's own state dir, `submit` refusing an unwritable state or run dir before
anything starts, `status` reading the end of a long metrics.jsonl, one exit code for a
cancel, goodput of a run that requeues without progress, a second Ctrl-C, the code
that ran, and `ls`'s filters.

Expectations are written by hand in each test; the real local runs are tiny and each
process a test starts has a deadline and is ended by its pid."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers.train_run import tiny_spec
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.clusters import owner
from shardctl.orchestrator.clusters.local import LocalCluster
from shardctl.orchestrator.clusters.records import jobs_dir, state_dir
from shardctl.orchestrator.rundir import SUBMIT_CLAIM_FILE

# ------------------------------------------------------- 1. the session's state dir


@pytest.fixture(scope="module")
def state_dir_seen_by_a_module_fixture() -> str:
    """What a module fixture (one that submits a job for its tests) sees: it is set up
    before any function fixture, so the per-test state dir is not there yet."""
    return os.environ.get("SHARDCTL_STATE_DIR", "")


def test_the_suite_never_writes_the_user_s_state_dir(
    state_dir_seen_by_a_module_fixture: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp_root = tmp_path_factory.getbasetemp().resolve()
    seen = Path(state_dir_seen_by_a_module_fixture).resolve()
    assert seen.is_relative_to(tmp_root), seen
    assert state_dir().resolve().is_relative_to(tmp_root)
    # A process the test starts inherits it.
    child = subprocess.run(
        [sys.executable, "-c", "from shardctl.orchestrator.clusters.records import state_dir; "
         "print(state_dir())"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert Path(child.stdout.strip()).resolve().is_relative_to(tmp_root)
    assert not Path(child.stdout.strip()).resolve().is_relative_to(Path.home() / ".local" / "state")


# ------------------------------------- 2. an unwritable state or run dir, refused first


def _never_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make starting the job a test failure: each refusal must come before it."""

    def schedule(self: object, dryrun: object) -> None:
        raise AssertionError("the job was started")

    monkeypatch.setattr(LocalCluster, "schedule", schedule)


def _refused(res: Any) -> str:
    """The one line `submit` printed on stderr for a refusal (exit 1, no traceback)."""
    assert res.exit_code == 1, res.output
    assert ("Traceback" not in res.output and res.exception is None) or isinstance(
        res.exception, SystemExit
    )
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def test_a_state_dir_that_is_a_file_is_refused_before_the_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real file in the state dir's place (no simulation)."""
    blocker = tmp_path / "state"
    blocker.write_text("not a folder\n")
    monkeypatch.setenv("SHARDCTL_STATE_DIR", str(blocker))
    _never_started(monkeypatch)
    spec = tiny_spec(tmp_path, "job")
    line = _refused(CliRunner().invoke(cli, ["submit", str(spec)]))
    assert f"state dir {blocker}: {blocker} is a file, not a directory" in line
    assert "nothing was submitted" in line and "SHARDCTL_STATE_DIR" in line
    assert blocker.read_text() == "not a folder\n"
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize(
    ("code", "said"),
    [(errno.EROFS, "Read-only file system (EROFS)"),
     (errno.ENOSPC, "No space left on device (ENOSPC)")],
)  # fmt: skip
def test_a_read_only_or_full_state_dir_is_refused_before_the_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, said: str
) -> None:
    """Simulated in-process: as root a chmod does not stop writes, so the one write of
    the state dir's probe (its `Path.open`) raises EROFS or ENOSPC."""
    real_open = Path.open

    def open_(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self.name.startswith(".probe-"):
            raise OSError(code, os.strerror(code), str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    _never_started(monkeypatch)
    spec = tiny_spec(tmp_path, "job")
    line = _refused(CliRunner().invoke(cli, ["submit", str(spec)]))
    assert f"cannot record jobs in the state dir {state_dir()}: {said}; nothing was" in line
    assert "SHARDCTL_STATE_DIR" in line
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize(
    ("code", "said"),
    [(errno.EROFS, "Read-only file system (EROFS)"),
     (errno.ENOSPC, "No space left on device (ENOSPC)")],
)  # fmt: skip
def test_a_read_only_or_full_run_dir_is_refused_before_the_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, said: str
) -> None:
    """Simulated in-process: the one write of the run dir before the job starts, its
    `.submit.claim` (`os.open`), raises EROFS or ENOSPC (as root a chmod does not stop
    writes)."""
    real_open = os.open

    def open_(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(SUBMIT_CLAIM_FILE):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    _never_started(monkeypatch)
    spec = tiny_spec(tmp_path, "job")
    line = _refused(CliRunner().invoke(cli, ["submit", str(spec)]))
    assert f"cannot write the run dir {tmp_path / 'job'}: {said}; nothing was" in line
    assert not (tmp_path / "job").exists()  # the folders the claim made are gone again
    assert list(jobs_dir().glob("*.json")) == []


def test_a_run_dir_with_no_room_left_is_refused_before_the_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulated in-process: the run dir's file system reports 4096 bytes free (the
    claim's few bytes still fit, the job's files would not)."""
    monkeypatch.setattr(owner, "free_bytes", lambda path: 4096)
    _never_started(monkeypatch)
    spec = tiny_spec(tmp_path, "job")
    line = _refused(CliRunner().invoke(cli, ["submit", str(spec)]))
    assert f"cannot write the run dir {tmp_path / 'job'}: No space left on device: 4096 " in line
    assert not (tmp_path / "job").exists()
