"""Job records: a bad one is named and skipped, never a traceback for every command."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.clusters.base import JobRef
from shardctl.orchestrator.clusters.records import jobs_dir, load_records, recall, remember
from shardctl.orchestrator.errors import JobNotFoundError

BAD_RECORDS = {
    "truncated": '{"cluster": "local", "job_id": "1", "na',
    "not-an-object": "[1, 2, 3]",
    "missing-keys": '{"cluster": "local"}',
    "wrong-types": '{"cluster": "local", "job_id": 1, "name": "x", "run_dir": "/r"}',
    "unknown-key": '{"cluster": "local", "job_id": "1", "name": "x", "run_dir": "/r", "z": 1}',
    "binary": "\udcff\udcfe",
    "tab-in-id": '{"cluster": "slurm", "job_id": "\\t99", "name": "x", "run_dir": "/r"}',
    "newline-in-name": '{"cluster": "local", "job_id": "", "name": "a\\nb", "run_dir": "/r"}',
    "empty-cluster": '{"cluster": "", "job_id": "1", "name": "x", "run_dir": "/r"}',
    "control-in-run-dir": '{"cluster": "local", "job_id": "", "name": "x", "run_dir": "/r\\u001b"}',
}


def _write_bad(name: str, text: str) -> Path:
    folder = jobs_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    return path


@pytest.mark.parametrize("kind", sorted(BAD_RECORDS))
def test_a_bad_record_is_named_and_the_others_still_work(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = JobRef(cluster="local", job_id="", name="good", run_dir=str(tmp_path / "run"))
    remember(good)
    bad = _write_bad(kind, BAD_RECORDS[kind])
    assert recall("good") == good
    assert str(bad) in capsys.readouterr().err
    # The CLI: status of the good job works, the bad record is a warning on stderr.
    result = CliRunner().invoke(cli, ["status", "good"])
    assert result.exit_code == 0, result.output
    assert "good (local" in result.output and "Traceback" not in result.output
    # Asking for the bad one by name: not found, with the known jobs listed.
    result = CliRunner().invoke(cli, ["cancel", kind])
    assert result.exit_code == 1 and "no submitted job named" in result.output


def test_records_are_written_atomically(tmp_path: Path) -> None:
    ref = JobRef(cluster="local", job_id="7", name="a", run_dir=str(tmp_path))
    remember(ref)
    remember(JobRef(**{**ref.to_json(), "job_id": "8"}))
    assert [r.job_id for r in load_records()] == ["8"]
    assert sorted(os.listdir(jobs_dir())) == ["a.json"]  # no temp file left behind
    assert json.loads((jobs_dir() / "a.json").read_text())["job_id"] == "8"


def test_an_unknown_job_name_is_cut_in_the_message() -> None:
    with pytest.raises(JobNotFoundError) as info:
        recall("x" * 100_000)
    assert len(str(info.value)) < 400


def test_scan_records_keeps_the_unreadable_ones_with_the_reason(tmp_path: Path) -> None:
    from shardctl.orchestrator.clusters.records import scan_records

    remember(JobRef(cluster="local", job_id="1", name="ok", run_dir=str(tmp_path)))
    _write_bad("bad", BAD_RECORDS["missing-keys"])
    recs = {r.path.stem: r for r in scan_records()}
    assert recs["ok"].ref is not None and recs["ok"].error == ""
    assert recs["bad"].ref is None and "missing" in recs["bad"].error
    assert all(r.submitted is not None for r in recs.values())
    # `ls` shows both, the bad one marked, and exits 0.
    result = CliRunner().invoke(cli, ["ls"])
    assert result.exit_code == 0 and "bad" in result.stdout and "unreadable record" in result.stdout
