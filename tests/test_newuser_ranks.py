"""What a rank says when the spec's checkpoint dir cannot be read: the failure itself
first (the bucket and what is missing), not a precision that "could not be resolved"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.errors import ShardctlError
from shardctl.orchestrator.spec import load_spec
from shardctl.train.distributed import DistEnv
from shardctl.train.precision import resolve


def test_an_unreadable_bucket_is_said_before_the_precision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    spec_file = tmp_path / "job.yaml"
    assert CliRunner().invoke(cli, ["init", str(spec_file)]).exit_code == 0
    spec = load_spec(spec_file, ("checkpoint.dir=s3://no-such-bucket/run",))
    rank0 = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                    device=torch.device("cpu"))  # fmt: skip
    with pytest.raises(ShardctlError) as exc:
        resolve(spec, rank0)
    said = str(exc.value)
    assert said.startswith("S3 list of s3://no-such-bucket/run failed: "), said
    assert said.endswith("(on rank 0, while resolving strategy.precision auto)"), said
