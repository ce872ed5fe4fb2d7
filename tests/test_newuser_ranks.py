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


def test_a_module_that_is_not_there_fails_once_with_its_name(tmp_path: Path) -> None:
    """`submit -- -m typo.train`: every rank raised ImportError and the run was restarted
    (twice, locally) before it failed as "a rank exited with code 1"."""
    import json
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "SHARDCTL_RUN_DIR": str(run_dir), "RANK": "0"}
    res = subprocess.run(
        [sys.executable, "-m", "shardctl.train.entry", "module", "no_such_pkg.train"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    reason = "-m no_such_pkg.train: No module named 'no_such_pkg' here; the run is not retried"
    assert res.returncode == 78, res.stderr
    assert res.stderr.strip() == f"shardctl: {reason}"
    failed = json.loads((run_dir / "FAILED").read_text())
    assert (failed["code"], failed["reason"]) == (78, reason)
