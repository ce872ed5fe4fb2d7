"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

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
    if config.getoption("--scale"):
        return
    scale = [item for item in items if item.get_closest_marker("scale")]
    if scale:
        config.hook.pytest_deselected(items=scale)
        items[:] = [item for item in items if not item.get_closest_marker("scale")]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory):
    """One tiny run of the built-in loop shared by the tests that only read what it
    leaves (metrics, trackers, the consolidated model): see helpers/shared_runs.py."""
    from helpers.shared_runs import train_tiny_run

    return train_tiny_run(tmp_path_factory.mktemp("tiny-run"))


@pytest.fixture(autouse=True)
def _isolated_state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Job records of one test never leak into another test or the user's home."""
    monkeypatch.setenv("SHARDCTL_STATE_DIR", str(tmp_path_factory.mktemp("state")))
