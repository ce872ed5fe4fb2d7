"""Checkpoints in a bucket through shardctl (issue 33): `checkpoint.dir` and
`checkpoint.resume` take `s3://BUCKET/PREFIX`, the CheckpointManager saves there (the
upload behind training, the final save waiting for it) and resumes from there on a
machine without the local copy, and `shardctl checkpoints` reads a bucket. Against the
session's real S3 server (SeaweedFS, `s3_server`)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from helpers.ckpt_spec import checkpoint_spec
from helpers.render_util import example_data, merge
from helpers.s3_server import S3Server, isolate_aws_settings
from shardctl.orchestrator.checkpoint_list import save_times
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.errors import CheckpointError, SpecError
from shardctl.orchestrator.rundir import ENV_RUN_DIR
from shardctl.orchestrator.spec import load_spec, parse_spec
from shardctl.train.backends.fsdp import DcpStateIO, ModelState, OptimizerState
from shardctl.train.checkpoint import CheckpointManager


@pytest.fixture
def bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A fresh bucket, this process pointed at the server as its admin; the ranks' run
    dir (where the bucket's local mirror goes) in `tmp_path/run`."""
    isolate_aws_settings(monkeypatch, tmp_path)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv(ENV_RUN_DIR, str(tmp_path / "run"))
    return s3_server.make_bucket(f"ck-{uuid.uuid4().hex[:12]}")


def objects(s3_server: S3Server, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object below `prefix`, read with plain boto3 (not the code under test)."""
    raw = s3_server.boto3_client()
    found = {}
    for item in raw.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
        found[item["Key"]] = raw.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
    return found


# -- the spec ------------------------------------------------------------------------

# These tests look at checkpoints only: no model at the end.
NO_MODEL = {"consolidate_on_finish": False}


def test_a_spec_file_keeps_s3_urls_as_written(tmp_path: Path) -> None:
    """They were taken as relative paths: checkpoints in '<spec dir>/s3:/bkt/x'."""
    url = "s3://my-bucket/runs/a/checkpoints"
    data = merge(example_data(), {"checkpoint": {"dir": url, "resume": f"{url}/step-00000010"}})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path)
    assert spec.checkpoint_dir == url
    assert spec.checkpoint.resume == f"{url}/step-00000010"


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("dir", "s3://My_Bucket/x", "bucket name 'My_Bucket' is not"),
        ("dir", "s3://bkt//x", "empty part"),
        ("dir", "S3://bkt/x", "lowercase 's3://'"),
        ("resume", "s3://ab/step-00000001", "bucket name 'ab' is not"),
    ],
)
def test_a_malformed_url_is_refused_in_one_line(field: str, value: str, why: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(merge(example_data(), {"checkpoint": {field: value, **NO_MODEL}}))
    line = next(x for x in str(caught.value).splitlines() if f"checkpoint.{field}" in x)
    assert repr(value) in line and why in line and "accepted: s3://BUCKET" in line


# -- the CheckpointManager -------------------------------------------------------------


class Trainer:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


class Setup:
    """A small model and optimizer whose checkpoints go to `location`."""

    def __init__(self, location: str, seed: int = 0, **checkpoint: object) -> None:
        torch.manual_seed(seed)
        spec = checkpoint_spec({"dir": location, "keep": 2, **checkpoint}, name="s3unit")
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.trainer = Trainer()
        state_io = DcpStateIO(
            {"model": ModelState(self.model), "optim": OptimizerState(self.model, self.optim)},
            spec.strategy,
        )
        self.mgr = CheckpointManager(spec.checkpoint, state_io, rank=0, world_size=1)

    def train_to(self, step: int) -> None:
        while self.trainer.step < step:
            loss = self.model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            self.optim.step()
            self.optim.zero_grad()
            self.trainer.step += 1

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def test_saves_go_to_the_bucket_and_resume_on_a_machine_without_the_local_copy(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    location = f"s3://{bucket}/runs/a/checkpoints"
    first = Setup(location)
    for step in (2, 4, 6):
        first.train_to(step)
        first.mgr.save(step, first.trainer, final=step == 6)
    # The final save returned only once its upload was committed (behind training
    # otherwise): the manifest is in the bucket, with how long the upload took.
    stored = objects(s3_server, bucket, "runs/a/checkpoints/")
    committed = sorted(k.split("/")[3] for k in stored if k.endswith("/manifest.json"))
    assert committed == ["step-00000004", "step-00000006"]  # keep: 2
    manifest = json.loads(stored["runs/a/checkpoints/step-00000006/manifest.json"])
    assert manifest["step"] == 6 and isinstance(manifest["upload_s"], float)
    # What doctor and the watchdog weigh: a save on a bucket lasts until it is up.
    assert save_times(location)[-1] == pytest.approx(manifest["save_s"] + manifest["upload_s"])
    assert f"runs/a/checkpoints/step-00000006/{next(iter(manifest['files']))}" in stored
    assert not (tmp_path / "s3:").exists() and not Path("s3:").exists()
    expected = first.weights()
    first.mgr.close()

    # Another machine: another run dir, so no local copy; a different initialization.
    monkeypatch.setenv(ENV_RUN_DIR, str(tmp_path / "elsewhere"))
    second = Setup(location, seed=1)
    assert second.mgr.restore(second.trainer) == 6
    assert second.trainer.step == 6
    for got, want in zip(second.weights(), expected, strict=True):
        assert torch.equal(got, want)
    second.mgr.close()

    # One checkpoint named by its URL.
    monkeypatch.setenv(ENV_RUN_DIR, str(tmp_path / "third"))
    third = Setup(location, seed=2, resume=f"{location}/step-00000004")
    assert third.mgr.restore(third.trainer) == 4
    third.mgr.close()


def test_a_save_uploads_behind_and_the_next_save_waits_for_it(
    s3_server: S3Server, bucket: str
) -> None:
    location = f"s3://{bucket}/behind"
    setup = Setup(location)
    setup.train_to(2)
    setup.mgr.save(2, setup.trainer)  # not final: publish returns before the upload ends
    setup.train_to(4)
    setup.mgr.save(4, setup.trainer)  # waits for step 2's upload first
    assert "behind/step-00000002/manifest.json" in objects(s3_server, bucket, "behind/")
    setup.mgr.close()  # waits for step 4's
    assert "behind/step-00000004/manifest.json" in objects(s3_server, bucket, "behind/")


# -- shardctl checkpoints s3://... ---------------------------------------------------


def test_checkpoints_lists_and_verifies_a_bucket(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    location = f"s3://{bucket}/cli/checkpoints"
    setup = Setup(location)
    for step in (2, 4):
        setup.train_to(step)
        setup.mgr.save(step, setup.trainer, final=True)
    setup.mgr.close()
    runner = CliRunner()
    listed = runner.invoke(cli, ["checkpoints", location, "-o", "json"])
    assert listed.exit_code == 0, listed.output
    data = json.loads(listed.output)
    assert [(r["step"], r["status"]) for r in data["checkpoints"]] == [
        (2, "complete"),
        (4, "complete"),
    ]
    assert data["latest_complete"] == f"{location}/step-00000004"
    # Given the run dir, whose job.yaml names the bucket: the same rows.
    run_dir = tmp_path / "cli-run"
    run_dir.mkdir()
    spec = merge(example_data(), {"run_dir": str(run_dir)})
    spec["checkpoint"].update(dir=location, consolidate_on_finish=False)
    (run_dir / "job.yaml").write_text(yaml.safe_dump(parse_spec(spec).to_yaml_dict()))
    by_run = runner.invoke(cli, ["checkpoints", str(run_dir), "-o", "json"])
    assert json.loads(by_run.output)["checkpoints"] == data["checkpoints"], by_run.output

    # An object altered in the bucket: --verify names it, exit 1.
    manifest = json.loads(
        objects(s3_server, bucket, "cli/checkpoints/step-00000004/manifest.json")[
            "cli/checkpoints/step-00000004/manifest.json"
        ]
    )
    rel = next(r for r, e in manifest["files"].items() if e["size"] > 0)
    key = f"cli/checkpoints/step-00000004/{rel}"
    raw = s3_server.boto3_client()
    body = bytearray(raw.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    raw.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    checked = runner.invoke(cli, ["checkpoints", location, "--verify"])
    assert checked.exit_code == 1, checked.output
    assert f"{location}/step-00000004/{rel}: sha256 differs" in checked.output
    assert "resume (auto) would use" in checked.output


def test_checkpoints_of_a_bucket_that_does_not_exist_is_one_line(bucket: str) -> None:
    result = CliRunner().invoke(cli, ["checkpoints", "s3://no-such-bucket-h7/x"])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "s3://no-such-bucket-h7" in lines[0] and "Traceback" not in result.output


# -- bad input: one line naming the URL and what failed ---------------------------------


def _one_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


def test_checkpoints_with_a_wrong_endpoint_or_bad_credentials_is_one_line(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers.s3_server import free_ports

    location = f"s3://{bucket}/x"
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    line = _one_line(CliRunner().invoke(cli, ["checkpoints", location]))
    assert location in line and "not-the-secret" not in line
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.admin.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
    line = _one_line(CliRunner().invoke(cli, ["checkpoints", location]))
    assert location in line and "127.0.0.1" in line


def test_a_save_to_a_read_only_bucket_fails_in_one_line_and_keeps_the_previous(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    location = f"s3://{bucket}/ro"
    first = Setup(location)
    first.train_to(2)
    first.mgr.save(2, first.trainer, final=True)
    first.mgr.close()
    for name, value in s3_server.env(s3_server.reader).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    second = Setup(location)
    second.train_to(4)
    with pytest.raises(CheckpointError) as caught:
        second.mgr.save(4, second.trainer, final=True)
    text = str(caught.value)
    assert "\n" not in text and f"s3://{bucket}/ro" in text, text
    assert "Traceback" not in text
    kept = objects(s3_server, bucket, "ro/")
    assert "ro/step-00000002/manifest.json" in kept
    assert not any(k.startswith("ro/step-00000004") for k in kept)


def test_doctor_writes_a_probe_object_and_names_a_read_only_bucket(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardctl.orchestrator.doctor import bucket_check

    ok = bucket_check(f"s3://{bucket}/d")
    assert ok.status == "ok", ok.detail
    assert objects(s3_server, bucket, "d/") == {}  # the probe was deleted
    for name, value in s3_server.env(s3_server.reader).items():
        monkeypatch.setenv(name, value)
    refused = bucket_check(f"s3://{bucket}/d")
    assert refused.status == "fail" and f"s3://{bucket}/d" in refused.detail
    assert "\n" not in refused.detail


def test_a_slurm_job_s_nodes_keep_the_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes' job.yaml had it made absolute as a path: '<cwd>/s3:/bkt/x'."""
    from shardctl.orchestrator.clusters.slurm import SlurmCluster

    root = Path(__file__).resolve().parents[1]
    data = yaml.safe_load((root / "examples" / "slurm-2node.yaml").read_text())
    data["checkpoint"]["dir"] = "s3://my-bucket/runs/slurm"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    plan = SlurmCluster().dryrun(load_spec(path))
    node_spec = parse_spec(yaml.safe_load(plan.artifacts["job.yaml"]))
    assert node_spec.checkpoint_dir == "s3://my-bucket/runs/slurm"


def test_submit_s_input_check_takes_a_resume_url_and_a_bucket_dir() -> None:
    """A resume URL was refused before submitting as a missing local folder."""
    from shardctl.orchestrator.inputs import input_problems

    url = "s3://my-bucket/runs/a/checkpoints"
    checkpoint = {"dir": url, "resume": f"{url}/step-00000010", **NO_MODEL}
    spec = parse_spec(merge(example_data(), {"checkpoint": checkpoint}))
    assert not [p for p in input_problems(spec, "local") if "checkpoint" in p]


def test_an_upload_that_fails_behind_training_stops_the_next_save_in_one_line(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The network drops while step 4 goes up behind training: the next save says so
    (one line naming the object), step 4 is never committed, step 2 stays complete."""
    from shardctl.orchestrator.errors import ObjectStoreError

    location = f"s3://{bucket}/drop"
    setup = Setup(location)
    setup.train_to(2)
    setup.mgr.save(2, setup.trainer, final=True)
    client = setup.mgr.storage.client
    real_put = client.put_file

    def dropped(path: Path, url: object, *args: object, **kwargs: object) -> None:
        if "step-00000004" in str(url) and str(url).endswith(".distcp"):
            raise ObjectStoreError(f"S3 upload of {url} failed: the connection was cut")
        real_put(path, url, *args, **kwargs)

    monkeypatch.setattr(client, "put_file", dropped)
    setup.train_to(4)
    setup.mgr.save(4, setup.trainer)  # returns: the upload runs (and fails) behind
    setup.train_to(6)
    with pytest.raises(CheckpointError) as caught:
        setup.mgr.save(6, setup.trainer)
    text = str(caught.value)
    assert "\n" not in text and "step-00000004" in text and "connection was cut" in text
    kept = objects(s3_server, bucket, "drop/")
    assert "drop/step-00000002/manifest.json" in kept
    assert "drop/step-00000004/manifest.json" not in kept


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["consolidate", "s3://my-bucket/c"], "say where the model goes with --out FOLDER"),
        (
            ["consolidate", "s3://my-bucket/c", "--out", "s3://my-bucket/model"],
            "the model is written to a local folder",
        ),
        (["convert", "s3://my-bucket/c", "--to", "fsdp"], "give --out NEW_FOLDER"),
        (["checkpoints", "s3://My-Bucket/c"], "bucket name 'My-Bucket' is not"),
    ],
)
def test_commands_refuse_what_they_cannot_do_with_a_bucket_in_one_line(
    argv: list[str], said: str
) -> None:
    line = _one_line(CliRunner().invoke(cli, argv))
    assert said in line
