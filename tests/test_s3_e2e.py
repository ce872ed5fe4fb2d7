"""End to end on a real S3 server (SeaweedFS, `s3_server`) with the real loop (2 ranks
of the tiny Llama under torchrun, `checkpoint.dir: s3://...`): preempted (exit 42 only
once its upload is committed), killed with SIGKILL (launcher and ranks) as its next
checkpoint goes up, and run again, it finishes with the same weights as an
uninterrupted run on disk; `consolidate s3://...` writes them, and a conversion
FSDP → DeepSpeed from the bucket into the bucket holds them too."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.ckpt_run import child_env, kill_group
from helpers.s3_server import S3Server, isolate_aws_settings
from helpers.train_run import (
    assert_bit_equal,
    final_weights,
    loop_argv,
    tiny_spec,
    train,
    train_ok,
)
from shardctl.orchestrator.cli import cli

pytestmark = pytest.mark.slow

EXIT_PREEMPTED = 42
STEPS = 8
# Long enough for a loaded 2-core machine to reach the next checkpoint.
KILL_DEADLINE_S = 300.0


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def _keys(s3_server: S3Server, bucket: str, prefix: str) -> list[str]:
    raw = s3_server.boto3_client()
    found = raw.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return [item["Key"] for item in found]


def _kill_once_uploading(argv: list[str], env: dict, s3_server: S3Server, bucket: str) -> int:
    """Start the run; SIGKILL launcher and ranks as soon as an object of a checkpoint
    after step 3 is in the bucket (its upload under way or just done); the exit code."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + KILL_DEADLINE_S
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if _keys(s3_server, bucket, "run/checkpoints/step-00000004/"):
                break
            time.sleep(0.05)
    finally:
        kill_group(proc)
        proc.wait(timeout=60)
    return proc.returncode


def test_a_run_on_s3_survives_preemption_and_kill_9_and_ends_like_one_on_disk(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolate_aws_settings(monkeypatch, tmp_path)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = s3_server.make_bucket(f"e2e-{uuid.uuid4().hex[:12]}")
    location = f"s3://{bucket}/run/checkpoints"
    common = {"train": {"steps": STEPS}}

    # The reference: the same run on disk, uninterrupted.
    ref = tiny_spec(tmp_path, "ref", **common)
    train_ok(ref)
    expected = final_weights(tmp_path / "ref" / "checkpoints" / "step-00000008", tmp_path / "m0")

    spec = tiny_spec(
        tmp_path, "s3run", checkpoint={"dir": location, "consolidate_on_finish": True}, **common
    )
    env = {"SHARDCTL_RUN_DIR": str(tmp_path / "s3run")}
    # Preempted after step 3: the ranks exit 42 only once step 3 is committed.
    stopped = train(spec, env={**env, "SHARDCTL_STOP_AFTER_STEP": "3"})
    assert f"exiting with code {EXIT_PREEMPTED}" in stopped.stdout, stopped.stdout[-4000:]
    assert "run/checkpoints/step-00000003/manifest.json" in _keys(s3_server, bucket, "run/")

    # Resumed, then killed (kill -9, launcher and ranks) while step 4 goes up.
    code = _kill_once_uploading(loop_argv(spec), {**child_env(), **env}, s3_server, bucket)
    assert code != 0

    # Run again: it resumes from the newest complete checkpoint and finishes.
    res = train_ok(spec, env=env)
    assert "resumed at step" in res.stdout
    # No credential in the runs' output or any file of the run dir.
    secret = s3_server.admin.secret_key
    assert secret not in stopped.stdout + res.stdout
    for path in (tmp_path / "s3run").rglob("*"):
        if path.is_file() and "s3-cache" not in path.parts:
            assert secret.encode() not in path.read_bytes(), path
    stored = _keys(s3_server, bucket, "run/checkpoints/")
    assert "run/checkpoints/step-00000008/manifest.json" in stored
    assert not (tmp_path / "s3:").exists()

    # The run consolidated its last step from the bucket into <run dir>/model.
    assert "consolidated model written to" in res.stdout, res.stdout[-3000:]
    assert_bit_equal(_tensors(tmp_path / "s3run" / "model"), expected)

    # consolidate s3://... (into a local folder) equals the run on disk.
    runner = CliRunner()
    out = tmp_path / "model-s3"
    result = runner.invoke(cli, ["consolidate", location, "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert_bit_equal(_tensors(out), expected)
    # Given the spec, it finds the checkpoints in the bucket and writes <run dir>/model
    # again (--force: the run's own consolidation is there).
    result = runner.invoke(cli, ["consolidate", str(spec), "--force", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert_bit_equal(_tensors(tmp_path / "s3run" / "model"), expected)

    # FSDP → DeepSpeed from the bucket into the bucket, then consolidated from there.
    converted = f"s3://{bucket}/converted/step-00000008"
    result = runner.invoke(
        cli,
        ["convert", f"{location}/step-00000008", "--to", "deepspeed", "--world-size", "2",
         "--out", converted],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    listed = runner.invoke(cli, ["checkpoints", f"s3://{bucket}/converted", "-o", "json"])
    rows = json.loads(listed.output)["checkpoints"]
    assert [(r["step"], r["status"], r["backend"]) for r in rows] == [(8, "complete", "deepspeed")]
    out_ds = tmp_path / "model-ds"
    result = runner.invoke(cli, ["consolidate", converted, "--out", str(out_ds), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert_bit_equal(_tensors(out_ds), expected)
