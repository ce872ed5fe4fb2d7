"""`submit --cluster local` with a checkpoint dir (or resume) in a bucket and no AWS
credentials on this machine: one line naming the URL and where credentials are looked
for, before anything starts (the ranks would each fail at their first save). Any
credential source boto3 reads lets it through; nothing asks a server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.clusters.local import LocalCluster
from shardctl.orchestrator.inputs import credential_problems
from shardctl.orchestrator.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-llama.yaml"
URL = "s3://team-ckpt/runs/a"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No AWS setting anywhere: every AWS_* variable unset, HOME an empty folder, and
    no instance metadata (this machine may be an EC2 instance)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return folder


def spec_with(tmp_path: Path, *sets: str):
    return load_spec(EXAMPLE, (f"run_dir={tmp_path / 'run'}", *sets), "local")


def test_submit_refuses_a_bucket_without_credentials_before_starting_anything(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[object] = []
    monkeypatch.setattr(LocalCluster, "schedule", lambda self, plan: started.append(plan))
    argv = ["submit", str(EXAMPLE), "--set", f"checkpoint.dir={URL}"]
    result = CliRunner().invoke(cli, [*argv, "--set", f"run_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = result.stderr.strip().splitlines()
    assert f"checkpoint.dir {URL}: no AWS credentials were found on this machine" in line
    for where in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "~/.aws/credentials", "AWS_CONFIG_FILE"):
        assert where in line, line
    assert started == []
    assert not (tmp_path / "run").exists()


def test_validate_and_a_dry_run_say_the_same(home: Path, tmp_path: Path) -> None:
    sets = ["--set", f"checkpoint.dir={URL}", "--set", f"run_dir={tmp_path / 'run'}"]
    for argv in (["validate", str(EXAMPLE)], ["submit", "--dry-run", str(EXAMPLE)]):
        result = CliRunner().invoke(cli, [*argv, *sets])
        assert result.exit_code == 2, result.output
        assert "no AWS credentials were found" in result.stderr


def test_a_resume_url_is_named_too(home: Path, tmp_path: Path) -> None:
    spec = spec_with(tmp_path, f"checkpoint.resume={URL}/step-00000010")
    (line,) = credential_problems(spec)
    assert line.startswith(f"checkpoint.resume {URL}/step-00000010: no AWS credentials")


def test_a_local_checkpoint_dir_needs_no_credentials(home: Path, tmp_path: Path) -> None:
    assert credential_problems(spec_with(tmp_path)) == []


def test_slurm_is_not_refused_here(home: Path, tmp_path: Path) -> None:
    # Its ranks run elsewhere, with the nodes' own AWS settings.
    sets = ["--set", f"checkpoint.dir={URL}", "--set", f"run_dir={tmp_path / 'run'}"]
    result = CliRunner().invoke(cli, ["validate", str(EXAMPLE), "--cluster", "slurm", *sets])
    assert result.exit_code == 0, result.output


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "source",
    [
        "env-keys",
        "profile",
        "home-credentials",
        "home-config-process",
        "credentials-file-variable",
        "config-file-variable",
        "container",
        "ec2-metadata-allowed-on-ec2",
    ],
)
def test_any_credential_source_lets_it_through(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    spec = spec_with(tmp_path, f"checkpoint.dir={URL}")
    assert credential_problems(spec), "no source set: refused"
    keys = "[default]\naws_access_key_id = AKIA0\naws_secret_access_key = s\n"
    if source == "env-keys":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA0")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    elif source == "profile":
        monkeypatch.setenv("AWS_PROFILE", "team")
    elif source == "home-credentials":
        _write(home / ".aws" / "credentials", keys)
    elif source == "home-config-process":
        _write(home / ".aws" / "config", "[default]\ncredential_process = /bin/creds\n")
    elif source == "credentials-file-variable":
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(_write(tmp_path / "c", keys)))
    elif source == "config-file-variable":
        sso = "[default]\nsso_session = corp\n"
        monkeypatch.setenv("AWS_CONFIG_FILE", str(_write(tmp_path / "cfg", sso)))
    elif source == "container":
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2/credentials/x")
    else:
        from shardctl.orchestrator.s3 import credentials

        monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
        vendor = _write(tmp_path / "sys_vendor", "Amazon EC2\n")
        monkeypatch.setattr(credentials, "_EC2_MARKERS", ((str(vendor), "amazon"),))
    assert credential_problems(spec) == []


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("config", "[default]\nregion = eu-west-1\n"),  # a region is no credential
        ("credentials", "[other]\naws_access_key_id = AKIA0\n"),  # not the default profile
    ],
)
def test_aws_files_without_default_credentials_are_still_absent(
    home: Path, tmp_path: Path, name: str, text: str
) -> None:
    _write(home / ".aws" / name, text)
    assert credential_problems(spec_with(tmp_path, f"checkpoint.dir={URL}"))


def test_only_one_of_the_two_key_variables_is_no_credential(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA0")
    assert credential_problems(spec_with(tmp_path, f"checkpoint.dir={URL}"))
