"""`shardctl checkpoints [--verify]` on damaged manifests, without torch: hand-made
step folders whose manifests are written like the checkpoint manager writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.errors import CheckpointError
from shardctl.train.manifest import (
    FORMAT_VERSION,
    describe_files,
    read_manifest,
    verify,
    write_manifest,
)


def make_step(ckdir: Path, step: int) -> Path:
    path = ckdir / f"step-{step:08d}"
    (path / "dcp").mkdir(parents=True)
    (path / "dcp" / "shard.bin").write_bytes(bytes(range(200)) * step)
    files = describe_files(path, ["dcp/shard.bin"])
    manifest = {"format_version": FORMAT_VERSION, "step": step, "world_size": 2, "files": files}
    manifest["backend"] = "fsdp"
    write_manifest(path, manifest)
    return path


def checkpoints(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, ["checkpoints", *args])


@pytest.mark.parametrize("verify_flag", [[], ["--verify"]])
def test_unreadable_manifest_fails_and_names_the_file(tmp_path: Path, verify_flag: list) -> None:
    make_step(tmp_path, 2)
    bad = make_step(tmp_path, 4) / "manifest.json"
    bad.write_text('{"format_version": 1, "files": ')  # cut short
    res = checkpoints(str(tmp_path), *verify_flag)
    assert res.exit_code == 1, res.output
    assert f"{bad}: unreadable manifest" in res.output
    assert "corrupt" in res.output
    assert str(tmp_path / "step-00000002") in res.output  # what resume falls back to


def test_manifest_entry_without_size_is_a_clear_error(tmp_path: Path) -> None:
    step = make_step(tmp_path, 2)
    path = step / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["files"]["dcp/shard.bin"]["size"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"files entry 'dcp/shard.bin' has no 'size'"):
        read_manifest(step)
    [problem] = verify(step)
    assert "'dcp/shard.bin' has no 'size'" in problem
    res = checkpoints(str(tmp_path), "--verify", "-o", "json")
    assert res.exit_code == 1 and not isinstance(res.exception, KeyError), res.output
    [row] = json.loads(res.output)["checkpoints"]
    assert row["status"] == "corrupt" and "has no 'size'" in row["problems"][0]


def test_what_resume_would_do_when_nothing_is_usable(tmp_path: Path) -> None:
    # Every published checkpoint corrupt: the trainer stops with an error.
    step = make_step(tmp_path, 2)
    (step / "dcp" / "shard.bin").write_bytes(b"x" * 400)
    res = checkpoints(str(tmp_path), "--verify")
    assert res.exit_code == 1
    assert "would start at step 0" not in res.output
    assert "stops with an error" in res.output
    res = checkpoints(str(tmp_path), "--verify", "-o", "json")
    assert json.loads(res.output)["resume_auto"] == "error"

    # Only a save that never finished: the trainer really does start at step 0.
    other = tmp_path / "other"
    (other / "step-00000002.tmp").mkdir(parents=True)
    res = checkpoints(str(other), "--verify")
    assert res.exit_code == 0, res.output
    assert "incomplete" in res.output and "starts at step 0" in res.output


# (a .yaml file is read as the job spec whose checkpoint.dir is listed: test_newuser_cli)
@pytest.mark.parametrize("name", ["notes.txt", "step-00000005"])
def test_a_file_is_refused_not_listed_as_empty(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("not a folder\n")
    res = checkpoints(str(path))
    assert res.exit_code != 0
    assert f"{str(path)!r} is a file, not a folder" in res.stderr
    assert "accepted: a run directory" in res.stderr
    assert "no checkpoints" not in res.stdout
