"""`strategy.precision: auto`: what it resolves to, and that a run keeps the value its
first start chose (recorded in every manifest) even where resolution would now differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.ckpt_run import free_port
from helpers.ckpt_spec import checkpoint_spec
from helpers.train_run import tiny_spec
from shardctl.orchestrator.dsconfig import deepspeed_config
from shardctl.orchestrator.precision import explain_auto, is_concrete, resolve_auto
from shardctl.orchestrator.spec import load_spec
from shardctl.train import precision as train_precision
from shardctl.train.manifest import FORMAT_VERSION, write_manifest


@pytest.mark.parametrize(
    ("device", "capability", "flags", "want"),
    [
        ("cuda", (9, 0), set(), "bf16-mixed"),
        ("cuda", (8, 0), set(), "bf16-mixed"),
        ("cuda", (7, 5), set(), "fp16-mixed"),
        ("cuda", None, set(), "fp16-mixed"),
        ("cpu", None, {"avx2", "avx512f"}, "fp32"),
        ("cpu", None, {"avx2", "avx512_bf16"}, "bf16-mixed"),
        ("cpu", None, {"amx_bf16"}, "bf16-mixed"),
        ("cpu", None, set(), "fp32"),
    ],
)
def test_resolve_auto_by_device(
    device: str, capability: tuple[int, int] | None, flags: set[str], want: str
) -> None:
    got = resolve_auto(device, cuda_capability=capability, cpu_flags=flags)
    assert got == want and is_concrete(got)
    assert explain_auto(device, cuda_capability=capability, cpu_flags=flags)[0] == want


def test_the_reason_names_what_was_missing() -> None:
    assert explain_auto("cpu", cpu_flags={"avx2"}) == (
        "fp32",
        "CPU without native bf16: no avx512_bf16/amx_bf16",
    )
    assert explain_auto("cuda", cuda_capability=(7, 0))[1] == (
        "CUDA compute capability 7.0: no native bf16 (needs 8.0)"
    )
    assert not is_concrete("auto")


def _spec(tmp_path: Path, **checkpoint: object) -> object:
    return checkpoint_spec(
        {"every_steps": 5, **checkpoint},
        name="p",
        strategy={"backend": "deepspeed", "zero_stage": 2, "precision": "auto"},
        steps=10,
        run_dir=str(tmp_path / "run"),
    )


def _step(ckdir: Path, step: int, precision: str) -> Path:
    path = ckdir / f"step-{step:08d}"
    path.mkdir(parents=True)
    write_manifest(path, {"format_version": FORMAT_VERSION, "precision": precision, "files": {}})
    return path


def test_the_checkpoint_resumed_from_decides(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    ckdir = Path(spec.checkpoint_dir)
    assert train_precision.recorded(spec.checkpoint) is None  # first start: the host decides
    older = _step(ckdir, 2, "bf16-mixed")
    newest = _step(ckdir, 4, "bf16-mixed")
    assert train_precision.recorded(spec.checkpoint) == ("bf16-mixed", newest)
    (newest / "manifest.json").write_text("{not json")  # unreadable: the older one answers
    assert train_precision.recorded(spec.checkpoint) == ("bf16-mixed", older)
    assert train_precision.recorded(_spec(tmp_path, resume="never").checkpoint) is None
    explicit = _spec(tmp_path, resume=str(older)).checkpoint
    assert train_precision.recorded(explicit) == ("bf16-mixed", older)
    precision, why = train_precision.decide(spec, "cpu")
    assert precision == "bf16-mixed" and str(older) in why


def test_deepspeed_config_sees_the_resolved_precision(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    # Unresolved, a CPU spec renders as fp32 (no bf16 section) ...
    assert "bf16" not in deepspeed_config(spec)
    # ... but what the node resolved is what the engine gets.
    resolved = train_precision.with_precision(spec, "bf16-mixed")
    assert resolved.strategy.precision == "bf16-mixed" and spec.strategy.precision == "auto"
    assert deepspeed_config(resolved)["bf16"] == {"enabled": True}


def test_a_resumed_run_keeps_the_precision_of_its_first_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real one-rank run (in this process): started where auto means bf16-mixed,
    resumed where it would mean fp32; every manifest says bf16-mixed."""
    import torch
    from shardctl.train.loop import run
    from shardctl.train.preemption import EXIT_OK, EXIT_PREEMPTED, STOP_AFTER_STEP_ENV

    path = tiny_spec(
        tmp_path,
        "auto",
        resources={"procs_per_node": 1},
        strategy={"precision": "auto"},
    )
    ckdir = tmp_path / "auto" / "checkpoints"

    def manifest(step: int) -> dict:
        return json.loads((ckdir / f"step-{step:08d}" / "manifest.json").read_text())

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")

    # First start on a host with native bf16, stopped after step 2.
    monkeypatch.setattr(train_precision, "cpu_flags_of_this_host", lambda: {"avx512_bf16"})
    monkeypatch.setenv(STOP_AFTER_STEP_ENV, "2")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert run(load_spec(path)) == EXIT_PREEMPTED
    out = capsys.readouterr().out
    assert "precision auto → bf16-mixed (CPU with native bf16: avx512_bf16)" in out
    assert manifest(2)["precision"] == "bf16-mixed"

    # Resumed on a host without it: auto alone would now say fp32.
    monkeypatch.setattr(train_precision, "cpu_flags_of_this_host", frozenset)
    assert train_precision.of_this_host("cpu")[0] == "fp32"
    monkeypatch.delenv(STOP_AFTER_STEP_ENV)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert run(load_spec(path)) == EXIT_OK
    out = capsys.readouterr().out
    assert "precision auto → bf16-mixed (kept from checkpoint" in out
    assert manifest(4)["precision"] == "bf16-mixed"
    assert torch.distributed.is_initialized() is False
