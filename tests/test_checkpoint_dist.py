"""CheckpointManager across real torchrun ranks (CPU + gloo): FSDP2 through DCP
(sync and async), DeepSpeed ZeRO through engine.save_checkpoint; bit-exact
resume, resharding to other world sizes, corruption on one rank's file.

The training loop here is tests/helpers/ckpt_worker.py (a small MLP with
dropout); the end-to-end version with `python -m shardctl.train` is in
test_resume_train.py.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from statistics import mean

import pytest
from helpers.ckpt_run import WORKER, run, torchrun_argv, worker

pytestmark = pytest.mark.slow


FSDP_RUN = ["--steps", "12", "--every", "4"]


@pytest.fixture(scope="module")
def fsdp_uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One uninterrupted FSDP run, shared: saving synchronously or not must not change
    what is trained, so both modes below end equal to it."""
    return worker(2, tmp_path_factory.mktemp("fsdp-full") / "a", *FSDP_RUN)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fsdp_stop_and_resume_is_bit_exact(
    fsdp_uninterrupted: dict, tmp_path: Path, mode: str
) -> None:
    common = [*FSDP_RUN, *(["--async"] if mode == "async" else [])]
    worker(2, tmp_path / "b", *common, "--stop-after", "10")
    resumed = worker(2, tmp_path / "b", *common)
    assert resumed["resumed"] == 8
    assert resumed["sha256"] == fsdp_uninterrupted["sha256"]
    assert resumed["loss"] == fsdp_uninterrupted["loss"]


@pytest.mark.parametrize("zero", [1, 3])
def test_deepspeed_stop_and_resume_is_bit_exact(tmp_path: Path, zero: int) -> None:
    common = ["--steps", "10", "--every", "4", "--backend", "deepspeed", "--zero", str(zero)]
    full = worker(2, tmp_path / "a", *common)
    worker(2, tmp_path / "b", *common, "--stop-after", "6")
    resumed = worker(2, tmp_path / "b", *common)
    assert resumed["resumed"] == 4
    assert resumed["sha256"] == full["sha256"]
    manifest = json.loads((tmp_path / "b" / "step-00000010" / "manifest.json").read_text())
    assert manifest["backend"] == "deepspeed" and manifest["zero_stage"] == zero
    assert any(f.startswith("deepspeed/") for f in manifest["files"])


def test_fsdp_reshards_to_one_and_three_ranks(tmp_path: Path) -> None:
    ck = tmp_path / "c"
    common = ["--steps", "14", "--every", "4", "--keep", "10"]
    stop = worker(2, ck, *common, "--stop-after", "8")
    untrained = mean(stop["losses"][:3])
    reached = mean(stop["losses"][5:8])  # steps 6-8, where the 2-rank run stopped
    for nproc in (1, 3):
        res = worker(nproc, ck, *common)
        # The weights DCP loaded on the new world size are the saved ones, exactly.
        assert res["resumed"] == 8 and res["world_size"] == nproc
        assert res["restored_sha256"] == stop["sha256"]
        # Training goes on sensibly: the loss keeps the level the 2-rank run reached
        # (other ranks draw other batches, so not bit-exact) and stays below the start.
        resumed = mean(res["losses"])
        assert math.isfinite(resumed) and resumed < untrained
        assert resumed < 2 * reached, (res["losses"], stop["losses"])
        manifest = json.loads((ck / "step-00000014" / "manifest.json").read_text())
        assert manifest["world_size"] == nproc
        assert len([f for f in manifest["files"] if f.startswith("train_state/")]) == nproc
        # The next world size resumes from step 8 again, not from this run's end.
        for step in (12, 14):
            shutil.rmtree(ck / f"step-{step:08d}", ignore_errors=True)


@pytest.mark.parametrize(("zero", "nproc"), [(2, 1), (3, 3)])
def test_deepspeed_resumes_on_another_world_size(tmp_path: Path, zero: int, nproc: int) -> None:
    """ZeRO 1-3 partitions of 2 ranks load on 1 or 3 through the portable path: the
    restored weights are the saved ones exactly, and training goes on."""
    ck = tmp_path / "c"
    common = ["--steps", "8", "--every", "4", "--backend", "deepspeed", "--zero", str(zero)]
    stop = worker(2, ck, *common, "--stop-after", "4")
    out = tmp_path / "resumed.json"
    res = run(torchrun_argv(nproc, WORKER, "--dir", str(ck), "--out", str(out), *common), 300)
    assert res.returncode == 0, res.stdout[-4000:]
    assert f"resharding DeepSpeed ZeRO-{zero} checkpoint" in res.stdout
    assert f"from 2 to {nproc} ranks" in res.stdout
    resumed = json.loads(out.read_text())
    assert resumed["resumed"] == 4 and resumed["restored_sha256"] == stop["sha256"]
    assert all(math.isfinite(x) for x in resumed["losses"]) and len(resumed["losses"]) == 4
    manifest = json.loads((ck / "step-00000008" / "manifest.json").read_text())
    assert manifest["world_size"] == nproc


def test_deepspeed_zero0_resumes_on_another_world_size(tmp_path: Path) -> None:
    ck = tmp_path / "c"
    common = ["--steps", "8", "--every", "4", "--backend", "deepspeed", "--zero", "0"]
    stop = worker(2, ck, *common, "--stop-after", "4")
    res = worker(1, ck, *common)
    assert res["resumed"] == 4 and res["restored_sha256"] == stop["sha256"]


def test_corrupt_shard_of_other_rank_falls_back_on_every_rank(tmp_path: Path) -> None:
    ck = tmp_path / "c"
    common = ["--steps", "12", "--every", "4", "--keep", "3"]
    worker(2, ck, *common, "--stop-after", "8")
    at4 = worker(2, tmp_path / "ref", *common, "--stop-after", "4")
    # Truncate rank 1's DCP shard of the newest checkpoint.
    shard = ck / "step-00000008" / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-16])
    out = tmp_path / "out.json"
    res = run(torchrun_argv(2, WORKER, "--dir", str(ck), "--out", str(out), *common), 300)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "__1_0.distcp: size" in res.stdout and "failed verification" in res.stdout
    data = json.loads(out.read_text())
    assert data["resumed"] == 4 and data["restored_sha256"] == at4["sha256"]
