"""CheckpointManager in one process (no process group): layout, manifest,
verification, atomic publication, retention, resume policy, and the CLI.

Real DCP writes through a real (unsharded) model; the multi-rank behaviour is in
test_checkpoint_dist.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.ckpt_spec import checkpoint_spec
from shardctl.orchestrator import storage as storage_mod
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.errors import CheckpointError
from shardctl.train import checkpoint as ckpt
from shardctl.train.backends.deepspeed import DeepSpeedStateIO
from shardctl.train.backends.fsdp import DcpStateIO, ModelState, OptimizerState
from shardctl.train.checkpoint import (
    CheckpointManager,
    latest_complete,
    list_checkpoints,
    verify,
)
from shardctl.train.manifest import sha256_file, share_of
from shardctl.train.storage import PosixStorage


def make_spec(tmp_path: Path, **checkpoint) -> object:
    return checkpoint_spec({"dir": str(tmp_path / "run" / "checkpoints"), **checkpoint})


class Trainer:
    def __init__(self) -> None:
        self.step = 0
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        return {"step": self.step, "rng": ckpt.capture_rng()}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]
        ckpt.restore_rng(sd["rng"])
        self.loaded = sd


class Setup:
    """A small model + optimizer + trainer, and a way to take one training step."""

    def __init__(self, tmp_path: Path, seed: int = 0, **checkpoint) -> None:
        torch.manual_seed(seed)
        self.spec = make_spec(tmp_path, **checkpoint)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.trainer = Trainer()
        state_io = DcpStateIO(
            {"model": ModelState(self.model), "optim": OptimizerState(self.model, self.optim)},
            self.spec.strategy,
        )
        self.mgr = CheckpointManager(
            self.spec.checkpoint,
            state_io,
            rank=0,
            world_size=1,
            model_meta={"source": "factory", "dtype": "fp32"},
        )
        self.ckdir = Path(self.spec.checkpoint_dir)

    def step(self) -> None:
        x = torch.randn(4, 8)
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.optim.step()
        self.optim.zero_grad()
        self.trainer.step += 1

    def train_and_save(self, steps: list[int]) -> None:
        for target in steps:
            while self.trainer.step < target:
                self.step()
            self.mgr.save(target, self.trainer)
        self.mgr.wait()

    def weights(self) -> list:
        return [p.detach().clone() for p in self.model.parameters()]


def flip_byte(path: Path, offset: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_layout_and_manifest(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.train_and_save([3])
    step_dir = s.ckdir / "step-00000003"
    assert sorted(p.name for p in s.ckdir.iterdir()) == ["step-00000003"]
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["format_version"] == 1
    assert manifest["step"] == 3 and manifest["world_size"] == 1
    assert manifest["backend"] == "fsdp" and manifest["sharding"] == "full_shard"
    assert manifest["zero_stage"] == 3 and manifest["precision"] == "fp32"
    assert manifest["model"] == {"source": "factory", "dtype": "fp32"}
    assert manifest["versions"]["torch"] == torch.__version__
    # How long the save took: `shardctl doctor` weighs it against the preemption budget.
    assert isinstance(manifest["save_s"], float) and 0 <= manifest["save_s"] < 600
    files = manifest["files"]
    assert "dcp/.metadata" in files and "train_state/rank-00000.pt" in files
    on_disk = sorted(
        p.relative_to(step_dir).as_posix()
        for p in step_dir.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    )
    assert sorted(files) == on_disk
    for rel, want in files.items():
        assert want["size"] == (step_dir / rel).stat().st_size
        assert want["sha256"] == sha256_file(step_dir / rel)
    assert verify(step_dir) == []
    # DCP keys: the plain FQNs under "model", the optimizer under "optim".
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(step_dir / "dcp")).read_metadata().state_dict_metadata)
    assert "model.0.weight" in keys and any(k.startswith("optim.") for k in keys)


def test_verify_names_file_expected_and_found(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.train_and_save([2])
    step_dir = s.ckdir / "step-00000002"
    target = step_dir / "train_state" / "rank-00000.pt"
    size = target.stat().st_size
    flip_byte(target)
    [problem] = verify(step_dir)
    assert str(target) in problem and "sha256" in problem and "manifest expects" in problem
    with open(target, "r+b") as f:
        f.truncate(size - 5)
    [problem] = verify(step_dir)
    assert f"size {size - 5} bytes, manifest expects {size}" in problem
    target.unlink()
    [problem] = verify(step_dir)
    assert "missing" in problem


def test_verify_alongside_hashes_in_several_threads_and_names_every_bad_file(
    tmp_path: Path,
) -> None:
    from shardctl.train.manifest import VerifyAlongside, _balanced, read_manifest

    s = Setup(tmp_path)
    s.train_and_save([2])
    step_dir = s.ckdir / "step-00000002"
    manifest = read_manifest(step_dir)
    files = sorted(manifest["files"])
    assert len(files) >= 3
    groups = _balanced(manifest["files"], 2)
    assert sorted(f for g in groups for f in g) == files and len(groups) == 2
    assert VerifyAlongside(step_dir, manifest).problems() == []
    bad = [files[0], files[-1]]
    for rel in bad:
        flip_byte(step_dir / rel)
    problems = VerifyAlongside(step_dir, manifest).problems()
    assert [p.split(":")[0] for p in problems] == [f"{step_dir}/{rel}" for rel in bad]


def test_resume_bit_exact_and_fallback_when_newest_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Setup(tmp_path)
    s.train_and_save([2, 4])
    at4 = s.weights()
    s.train_and_save([6])
    at6 = s.weights()
    rng_after_6 = torch.get_rng_state()

    fresh = Setup(tmp_path, seed=99)
    assert fresh.mgr.restore(fresh.trainer) == 6
    assert all(torch.equal(a, b) for a, b in zip(at6, fresh.weights(), strict=True))
    assert fresh.trainer.step == 6
    assert torch.equal(torch.get_rng_state(), rng_after_6)
    # Optimizer state came back too: one more identical step gives identical weights.
    torch.manual_seed(5)
    s.step()
    torch.manual_seed(5)
    fresh.step()
    assert all(torch.equal(a, b) for a, b in zip(s.weights(), fresh.weights(), strict=True))

    flip_byte(next((s.ckdir / "step-00000006" / "dcp").glob("*.distcp")), 200)
    other = Setup(tmp_path, seed=7)
    with caplog.at_level(logging.WARNING):
        assert other.mgr.restore(other.trainer) == 4
    assert "step-00000006" in caplog.text and "manifest expects" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(at4, other.weights(), strict=True))
    assert latest_complete(s.ckdir) == s.ckdir / "step-00000004"


def test_resume_never_and_explicit_path(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.train_and_save([2, 4])
    never = Setup(tmp_path, resume="never")
    assert never.mgr.restore(never.trainer) is None
    explicit = Setup(tmp_path, resume=str(s.ckdir / "step-00000002"))
    assert explicit.mgr.restore(explicit.trainer) == 2

    flip_byte(s.ckdir / "step-00000002" / "train_state" / "rank-00000.pt")
    corrupt = Setup(tmp_path, resume=str(s.ckdir / "step-00000002"))
    with pytest.raises(CheckpointError, match=r"is corrupt:\n.*rank-00000.pt: sha256"):
        corrupt.mgr.restore(corrupt.trainer)

    missing = Setup(tmp_path, resume=str(s.ckdir / "step-00000077"))
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        missing.mgr.restore(missing.trainer)

    (s.ckdir / "step-00000004" / "manifest.json").rename(s.ckdir / "m.json")
    incomplete = Setup(tmp_path, resume=str(s.ckdir / "step-00000004"))
    with pytest.raises(CheckpointError, match=r"no manifest.json, so the checkpoint is incomplete"):
        incomplete.mgr.restore(incomplete.trainer)


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.train_and_save([2, 4])
    for step in (2, 4):
        flip_byte(s.ckdir / f"step-{step:08d}" / "dcp" / ".metadata")
    again = Setup(tmp_path)
    with pytest.raises(CheckpointError, match=r"every complete checkpoint .* failed verification"):
        again.mgr.restore(again.trainer)


def test_nothing_to_resume_starts_at_zero(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    assert s.mgr.restore(s.trainer) is None


def test_crash_before_rename_leaves_previous_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Setup(tmp_path)
    s.train_and_save([2])

    def crash(self: object, name: str, *, replace: bool = False) -> Path:
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(PosixStorage, "publish", crash)
    with pytest.raises(CheckpointError, match="simulated crash"):
        s.train_and_save([4])
    monkeypatch.undo()
    infos = list_checkpoints(s.ckdir)
    assert [(i.step, i.complete) for i in infos] == [(2, True), (4, False)]
    assert infos[1].path.endswith("step-00000004.tmp")
    assert (Path(infos[1].path) / "manifest.json").exists()  # written, but never renamed
    fresh = Setup(tmp_path)
    assert fresh.mgr.restore(fresh.trainer) == 2
    # The next save removes the stale .tmp before writing.
    fresh.train_and_save([3])
    assert sorted(p.name for p in s.ckdir.iterdir()) == ["step-00000002", "step-00000003"]


def test_retention_keeps_newest_and_deletes_only_after_publish(tmp_path: Path) -> None:
    s = Setup(tmp_path, keep=2)
    s.train_and_save([1, 2, 3, 4])
    assert sorted(p.name for p in s.ckdir.iterdir()) == ["step-00000003", "step-00000004"]
    # A save that fails deletes nothing.
    (s.ckdir / ".trash-step-00000001-1-2").mkdir()  # a half-finished deletion
    s.mgr.save(5, s.trainer)
    assert sorted(p.name for p in s.ckdir.iterdir()) == ["step-00000004", "step-00000005"]


def test_resaving_an_existing_step_replaces_it_atomically(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.train_and_save([2])
    first = json.loads((s.ckdir / "step-00000002" / "manifest.json").read_text())
    s.step()
    s.mgr.save(2, s.trainer, final=True)
    second = json.loads((s.ckdir / "step-00000002" / "manifest.json").read_text())
    assert first["files"] != second["files"]
    assert verify(s.ckdir / "step-00000002") == []
    assert sorted(p.name for p in s.ckdir.iterdir()) == ["step-00000002"]


def test_async_save_single_process(tmp_path: Path) -> None:
    s = Setup(tmp_path, **{"async": True})
    s.train_and_save([2])
    s.step()
    s.mgr.save(3, s.trainer)
    s.mgr.close()
    assert [i.step for i in list_checkpoints(s.ckdir) if i.complete] == [2, 3]
    assert verify(s.ckdir / "step-00000003") == []


class _TensorWithAnOwner:
    """A Stateful whose tensor carries an attribute no deep copy can make (a lock):
    what a DTensor carries in its spec (the device mesh), which torch 2.11's
    `DefaultStager` failed to copy on a CUDA GPU (benchmarks/README.md)."""

    def __init__(self) -> None:
        self.weight = torch.arange(6, dtype=torch.float32)
        self.weight.owner = threading.Lock()  # type: ignore[attr-defined]

    def state_dict(self) -> dict:
        return {"weight": self.weight}

    def load_state_dict(self, sd: dict) -> None:
        self.weight.copy_(sd["weight"])


def test_an_async_save_stages_the_tensors_not_what_hangs_off_them(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    io = DcpStateIO({"model": _TensorWithAnOwner()}, None)
    try:
        io.save_async(tmp_path, None).result()
    finally:
        io.close()
    loaded = {"model": {"weight": torch.zeros(6)}}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(loaded["model"]["weight"], torch.arange(6, dtype=torch.float32))


def test_backend_mismatch_is_refused(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.train_and_save([2])
    path = s.ckdir / "step-00000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["backend"] = "deepspeed"
    path.write_text(json.dumps(manifest))
    again = Setup(tmp_path)
    with pytest.raises(CheckpointError, match="written by backend 'deepspeed'"):
        again.mgr.restore(again.trainer)


def test_cli_lists_and_verifies(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.train_and_save([2, 4])
    (s.ckdir / "step-00000006.tmp").mkdir()
    run_dir = s.ckdir.parent
    runner = CliRunner()
    res = runner.invoke(cli, ["checkpoints", str(run_dir), "-o", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    rows = [(r["step"], r["status"], r["world_size"], r["backend"]) for r in data["checkpoints"]]
    assert rows == [
        (2, "complete", 1, "fsdp"),
        (4, "complete", 1, "fsdp"),
        (6, "incomplete", None, None),
    ]
    assert all(r["size_bytes"] > 0 for r in data["checkpoints"][:2])
    assert data["latest_complete"].endswith("step-00000004")

    flip_byte(s.ckdir / "step-00000004" / "dcp" / ".metadata")
    res = runner.invoke(cli, ["checkpoints", str(s.ckdir), "--verify"])
    assert res.exit_code == 1
    assert "corrupt" in res.output and ".metadata: sha256" in res.output
    assert "would use: " + str(s.ckdir / "step-00000002") in res.output

    res = runner.invoke(cli, ["checkpoints", str(s.ckdir / "step-00000002"), "-o", "json"])
    assert [r["step"] for r in json.loads(res.output)["checkpoints"]] == [2]

    res = runner.invoke(cli, ["checkpoints", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "does not exist" in res.output


def test_cli_module_does_not_import_torch() -> None:
    code = (
        "import sys; import shardctl.orchestrator.cli.checkpoints as m; "
        "from shardctl.train import manifest; "
        "bad = [x for x in ('torch', 'deepspeed') if x in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def test_deepspeed_async_falls_back_to_sync_with_a_note(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = checkpoint_spec(
        {"dir": str(tmp_path / "c"), "every_steps": 5, "async": True},
        strategy={"backend": "deepspeed", "zero_stage": 2, "precision": "fp32"},
        steps=10,
    )
    with caplog.at_level(logging.WARNING):
        mgr = CheckpointManager(
            spec.checkpoint, DeepSpeedStateIO(None, spec.strategy), rank=0, world_size=1
        )
    assert mgr.async_save is False
    assert "checkpoint.async is not supported with strategy.backend deepspeed" in caplog.text


def test_hash_shares_cover_every_file_once_and_balance_bytes() -> None:
    sizes = {f"f{i}": size for i, size in enumerate([100, 90, 50, 40, 30, 5, 5, 1])}
    shares = [share_of(sizes, r, 3) for r in range(3)]
    assert sorted(f for s in shares for f in s) == sorted(sizes)
    loads = [sum(sizes[f] for f in s) for s in shares]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert shares == [share_of(sizes, r, 3) for r in range(3)]  # same on every rank


def test_resave_without_rename_exchange_still_ends_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = Setup(tmp_path)
    s.train_and_save([2])
    monkeypatch.setattr(storage_mod, "_rename_exchange", lambda a, b: False)
    s.step()
    s.mgr.save(2, s.trainer)
    assert sorted(p.name for p in s.ckdir.iterdir()) == ["step-00000002"]
    assert verify(s.ckdir / "step-00000002") == []
