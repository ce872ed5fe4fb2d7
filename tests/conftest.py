"""Shared pytest fixtures."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SHARED = ROOT.parent / "shared"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--scale",
        action="store_true",
        help="also run the tests marked `scale` (long runs at scale; deselected by default)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `scale` take long enough that the everyday suite leaves them out;
    `--scale` (scripts/test-all --scale) runs them with everything else."""
    if not config.getoption("--scale"):
        scale = [item for item in items if item.get_closest_marker("scale")]
        if scale:
            config.hook.pytest_deselected(items=scale)
            items[:] = [item for item in items if not item.get_closest_marker("scale")]
    _slurm_first(items)


# The files of the tests that need the dev Slurm cluster (marker `slurm`).
SLURM_FILES = "test_slurm"
# `test_slurm_*` files with no test that needs the cluster (checked at collection):
# shared out like any other file, not queued on the Slurm worker (46 s of it at load 3.6).
CLUSTER_FREE_SLURM_FILES = frozenset({"test_slurm_options.py", "test_slurm_render.py"})


def _on_the_slurm_worker(name: str) -> bool:
    """Whether the file of this name runs on the worker that runs the Slurm tests."""
    return name.startswith(SLURM_FILES) and name not in CLUSTER_FREE_SLURM_FILES


def _slurm_first(items: list[pytest.Item]) -> None:
    """Every test that needs the dev Slurm cluster lives in a `test_slurm_*` file (the
    workers share them out by file name, see `pytest_xdist_make_scheduler`), and those
    tests run first: they are the longest group (those that resize the dev cluster, see
    `resize_cluster`, last of them). The other files follow, those with the
    most long tests first (marker `slow`: a multi-process run; or a `timeout` of its
    own), so that the suite ends on files of quick tests: the worker that runs out of
    files first then waits seconds for the other, not the minutes of a long file handed
    out last (alphabetical order ended on test_trackers, test_train_*,
    test_unmodified_scripts, test_watchdog)."""
    astray = [
        item.nodeid
        for item in items
        if item.get_closest_marker("slurm") and not item.path.name.startswith(SLURM_FILES)
    ]
    if astray:
        raise pytest.UsageError(
            f"tests marked `slurm` must live in a {SLURM_FILES}*.py file (one worker runs "
            f"them all, in turn): move {', '.join(astray)}"
        )
    free = [
        item.nodeid
        for item in items
        if item.get_closest_marker("slurm") and item.path.name in CLUSTER_FREE_SLURM_FILES
    ]
    if free:
        raise pytest.UsageError(
            f"tests marked `slurm` in a file of CLUSTER_FREE_SLURM_FILES (tests/conftest.py; "
            f"its tests run beside the Slurm tests): {', '.join(free)}; take the file off "
            "that list or move the tests"
        )
    long_tests = Counter(item.path.name for item in items if _long(item))
    resizing = {item.path.name for item in items if RESIZE_FIXTURE in item.fixturenames}
    # A stable sort on a key that is the same for every test of a file: each file's
    # tests stay together and in their own order (module fixtures, tests that build on
    # the one before); files of the same key keep their alphabetical order.
    items.sort(key=lambda item: _file_rank(item.path.name, long_tests, resizing))


def _long(item: pytest.Item) -> bool:
    """A test that starts processes and waits on them: marked `slow`, or given a
    `timeout` of its own."""
    return bool(item.get_closest_marker("slow") or item.get_closest_marker("timeout"))


def _file_rank(name: str, long_tests: Counter[str], resizing: set[str]) -> tuple[int, int]:
    """Slurm files first (those that resize the dev cluster last of them), then the
    files by their number of long tests, most first."""
    if _on_the_slurm_worker(name):
        return (0, int(name in resizing))
    return (1, -long_tests[name])


# The fixture of the Slurm tests that need more nodes than the dev cluster's default 2.
RESIZE_FIXTURE = "resize_cluster"


@pytest.fixture(scope="session")
def resize_cluster() -> Any:
    """`resize_cluster(nodes, or_more=False)` brings the dev Slurm cluster to a node
    count (helpers/slurm_dev.py); its default 2 nodes again once, at the end of the
    session. The files that use it run last of the Slurm files (`_file_rank`), so the
    2-node tests never find it resized, and the spares test (3 nodes or more) runs on
    the 4 nodes the scale test left: each resize restarts the Slurm daemons (10-15 s),
    and the two files' module fixtures did four."""
    from helpers.slurm_dev import DevClusterSize

    if os.geteuid() != 0:
        pytest.skip("bringing the dev cluster up needs root")
    size = DevClusterSize()
    try:
        yield size.resize
    finally:
        size.back_to_default()


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How `pytest -n 2` (scripts/test-all) shares the tests out between its workers.

    A file goes whole to one worker, so its module fixtures (a trained run, a converted
    checkpoint) are built once. Every `test_slurm_*` file goes to the same worker
    (except CLUSTER_FREE_SLURM_FILES): two workers' jobs on the dev cluster's two nodes
    would queue behind each other and blow the tests' deadlines. (pytest-xdist's own
    `xdist_group` mark would say this, but xdist 3.8 cannot apply it under pytest 9.2,
    which renamed the node id it rewrites.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "slurm" if _on_the_slurm_worker(Path(path).name) else path

    return ByFile(config, log)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    """One tiny run of the built-in loop shared by the tests that only read what it
    leaves (metrics, trackers, the consolidated model): see helpers/shared_runs.py."""
    from helpers.shared_runs import train_tiny_run

    return train_tiny_run(tmp_path_factory.mktemp("tiny-run"))


@pytest.fixture(scope="session", autouse=True)
def _session_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The whole session's job records live in pytest's tmp area, never in the user's
    `~/.local/state/shardctl`: set in os.environ before any module or session fixture
    submits a job, so every subprocess a test starts inherits it too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHARDCTL_STATE_DIR", str(tmp_path_factory.mktemp("session-state")))
        yield


@pytest.fixture(autouse=True)
def _isolated_state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Job records of one test never leak into another test or the user's home."""
    monkeypatch.setenv("SHARDCTL_STATE_DIR", str(tmp_path_factory.mktemp("state")))


# The signals whose action code run in-process changes (the node agent ignores its
# stop signals once it has decided; the preemption flag installs handlers).
_STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


@pytest.fixture(autouse=True)
def _signal_actions_kept() -> Any:
    """What a test changes of the worker's signal actions and mask is put back after
    it, so a later test in the same worker starts with the worker's own (a node agent
    run in-process leaves SIGUSR2 ignored, as its process is about to exit)."""
    actions = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    for sig, action in actions.items():
        if action is not None:
            signal.signal(sig, action)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A real S3 server (SeaweedFS on loopback, helpers/s3_server.py) shared by every S3
    test of the session: an admin and a read-only identity; stopped by its PID at the end.
    Each test makes its own bucket. A missing `weed` binary fails the test, never skips it."""
    from helpers.s3_server import start_s3_server

    server = start_s3_server(tmp_path_factory.mktemp("s3-server"))
    yield server
    server.stop()
