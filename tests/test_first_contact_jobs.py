"""Issue 35 (first contact, round 4), the jobs command line on this machine: the test
session's own state dir, `submit` refusing an unwritable state or run dir before
anything starts, `status` reading the end of a long metrics.jsonl, one exit code for a
cancel, goodput of a run that requeues without progress, a second Ctrl-C, the code
that ran, and `ls`'s filters.

Expectations are written by hand in each test; the real local runs are tiny and each
process a test starts has a deadline and is ended by its pid."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from shardctl.orchestrator.clusters.records import state_dir

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
