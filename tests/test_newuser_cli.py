"""A new user's first commands with wrong input: each answer is one line naming the
path or value and what is accepted, exit 2, no traceback, no user file touched."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from shardctl.orchestrator.cli import cli


def test_init_under_a_file_names_the_file_in_the_way(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: mine\n")
    res = CliRunner().invoke(cli, ["init", str(spec / "sub" / "new.yaml")])
    assert res.exit_code == 2, res.output
    [line] = res.output.strip().splitlines()
    assert f"{spec} is a file, not a folder" in line
    assert "Traceback" not in res.output
    assert spec.read_text() == "name: mine\n"
