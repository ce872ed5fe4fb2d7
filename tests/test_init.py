"""`shardctl init`: a commented starter spec that validates, for both backends."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.cli.init import job_name_from
from shardctl.orchestrator.spec import load_spec

SECTIONS = ("name", "resources", "launcher", "strategy", "train", "checkpoint", "watchdog", "env",
            "local", "slurm", "k8s")  # fmt: skip


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_written_spec_validates_through_the_cli(tmp_path: Path, backend: str):
    path = tmp_path / "my_Job.yaml"
    runner = CliRunner()
    res = runner.invoke(cli, ["init", str(path), "--backend", backend])
    assert res.exit_code == 0, res.stderr
    assert f"wrote {path}" in res.stdout
    res = runner.invoke(cli, ["validate", str(path), "--output", "json"])
    assert res.exit_code == 0, res.stderr
    spec = load_spec(path)
    assert spec.name == "my-job"
    assert spec.strategy.backend == backend
    assert (spec.strategy.sharding, spec.strategy.zero_stage) == ("full_shard", 3)
    assert spec.world_size == 2 and spec.resources.device == "cpu"
    # Not bf16-mixed: emulated bf16 on a CPU without it is several times slower.
    assert spec.strategy.precision == "auto"


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_every_section_has_a_comment_saying_what_it_does(tmp_path: Path, backend: str):
    path = tmp_path / "job.yaml"
    assert CliRunner().invoke(cli, ["init", str(path), "--backend", backend]).exit_code == 0
    lines = path.read_text().splitlines()
    data = yaml.safe_load("\n".join(lines))
    assert list(data) == list(SECTIONS)  # every section is present, in this order
    for section in SECTIONS:
        at = next(i for i, line in enumerate(lines) if re.match(rf"^{section}:", line))
        assert lines[at - 1].startswith("#"), f"section {section!r} has no comment above it"
    # The strategy block explains the choices of its backend.
    text = path.read_text()
    if backend == "deepspeed":
        assert "ZeRO stage 0-3" in text and "bf16-pure is FSDP only" in text
    else:
        assert "full_shard (ZeRO-3)" in text and "hybrid_shard" in text


def test_refuses_to_overwrite_without_force(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text("mine\n")
    res = CliRunner().invoke(cli, ["init", str(path)])
    assert res.exit_code == 2
    assert "already exists" in res.stderr and "--force" in res.stderr
    assert path.read_text() == "mine\n"
    res = CliRunner().invoke(cli, ["init", str(path), "--force", "--backend", "deepspeed"])
    assert res.exit_code == 0, res.stderr
    assert load_spec(path).strategy.backend == "deepspeed"


def test_default_path_is_job_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(cli, ["init"]).exit_code == 0
    assert load_spec(tmp_path / "job.yaml").name == "job"


def test_bad_name_is_rejected_before_writing(tmp_path: Path):
    path = tmp_path / "job.yaml"
    res = CliRunner().invoke(cli, ["init", str(path), "--name", "Not_Valid"])
    assert res.exit_code == 2
    assert "'Not_Valid'" in res.stderr and "lower-case" in res.stderr
    assert not path.exists()


@pytest.mark.parametrize(
    ("file", "name"),
    [("job.yaml", "job"), ("My Big_Job.v2.yaml", "my-big-job"), ("___.yaml", "my-job"),
     ("x" * 80 + ".yaml", "x" * 50), ("ünïcode.yaml", "n-code")],
)  # fmt: skip
def test_job_name_from_file_name_is_always_valid(file: str, name: str):
    assert job_name_from(Path(file)) == name


def test_odd_path_stays_inside_comments(tmp_path: Path):
    path = tmp_path / "my job\nname: evil.yaml"
    res = CliRunner().invoke(cli, ["init", str(path)])
    assert res.exit_code == 0, res.stderr
    spec = load_spec(path)
    assert spec.name == "my-job-name-evil"
    assert "shardctl validate '" in path.read_text()


def _run_with_file_size_limit(args: list[str], limit: int) -> subprocess.CompletedProcess[str]:
    """The real CLI with the kernel refusing any file write past `limit` bytes (EFBIG):
    a deterministic stand-in for a full disk that fails the same write(2) call."""

    def limit_writes() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "shardctl.orchestrator.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        preexec_fn=limit_writes,
    )


def test_failed_write_leaves_nothing_behind_and_init_can_run_again(tmp_path: Path):
    path = tmp_path / "job.yaml"
    proc = _run_with_file_size_limit(["init", str(path)], limit=64)
    assert proc.returncode != 0
    assert f"cannot write {str(path)!r}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # neither a truncated job.yaml nor a temp file
    res = CliRunner().invoke(cli, ["init", str(path)])
    assert res.exit_code == 0, res.stderr
    assert load_spec(path).name == "job"


def test_failed_forced_write_keeps_the_old_file(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text("mine\n")
    proc = _run_with_file_size_limit(["init", str(path), "--force"], limit=64)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert path.read_text() == "mine\n"
    assert [p.name for p in tmp_path.iterdir()] == ["job.yaml"]
