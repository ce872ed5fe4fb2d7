"""Checkpoints shardctl did not write: accelerate + DeepSpeed (ZeRO-2, ZeRO-3 bf16), the
HF Trainer + DeepSpeed (ZeRO-2, ZeRO-3), a plain FSDP2 DCP script and accelerate's FSDP
layout, each written on 2 CPU ranks by the tool's own API (tests/helpers/foreign_ckpt.py).

`shardctl checkpoints` names each one's format, step and world size; `consolidate` writes
what the peers' own tools reconstruct, bit for bit (DeepSpeed's `zero_to_fp32`, torch's
`dcp_to_torch_save`); damage is named for what each format can prove, and a complete
foreign checkpoint is never called interrupted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.ckpt_run import run, torchrun_argv
from safetensors.torch import load_file
from shardctl.orchestrator.cli import cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HELPER = Path(__file__).parent / "helpers" / "foreign_ckpt.py"

# name → the helper's arguments
MAKERS = {
    "accelerate-z2": ["--tool", "accelerate-ds", "--zero-stage", "2"],
    "accelerate-z3-bf16": ["--tool", "accelerate-ds", "--zero-stage", "3", "--precision", "bf16"],
    "trainer-z2": ["--tool", "trainer-ds", "--zero-stage", "2"],
    "trainer-z3": ["--tool", "trainer-ds", "--zero-stage", "3"],
    "fsdp2": ["--tool", "fsdp2"],
}


def _torchrun(out: Path, args: list[str]) -> None:
    # Sized for a loaded 2-core machine: about 10 s each when it is quiet.
    res = run(torchrun_argv(2, HELPER, "--out", str(out), *args), timeout=400)
    assert res.returncode == 0, res.stdout[-6000:]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("foreign")
    out: dict[str, Path] = {}
    for name, args in MAKERS.items():
        _torchrun(root / name, args)
        out[name] = root / name
    return out


def checkpoints(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, ["checkpoints", "-o", "json", *args])


def consolidate(src: Path, out: Path, *extra: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(
        cli, ["consolidate", str(src), "--out", str(out), "--no-progress", *extra]
    )


def _rows(path: Path, exit_code: int = 0) -> list[dict]:
    """The rows of `checkpoints -o json`; it exits 1 when a checkpoint is corrupt."""
    res = checkpoints(str(path))
    assert res.exit_code == exit_code, res.output
    return json.loads(res.output)["checkpoints"]


# ------------------------------------------------------------------------ listing


def test_each_tool_s_checkpoint_is_listed_with_its_format_step_and_world(made) -> None:
    # What each tool wrote, from its own files: accelerate saved once after 4 steps (the
    # engine counts them), the Trainer every 2 of its 4 steps.
    [acc] = _rows(made["accelerate-z2"])
    assert (acc["format"], acc["step"], acc["world_size"], acc["status"]) == (
        "accelerate+deepspeed", 4, 2, "complete",
    )  # fmt: skip
    trainer = _rows(made["trainer-z3"])
    assert [(r["format"], r["step"], r["status"]) for r in trainer] == [
        ("trainer+deepspeed", 2, "complete"),
        ("trainer+deepspeed", 4, "complete"),
    ]
    assert [Path(r["path"]).name for r in trainer] == ["checkpoint-2", "checkpoint-4"]
    fsdp = {Path(r["path"]).name: r for r in _rows(made["fsdp2"])}
    assert (fsdp["dcp"]["format"], fsdp["dcp"]["world_size"]) == ("dcp", 2)
    assert (fsdp["accelerate-fsdp"]["format"], fsdp["accelerate-fsdp"]["backend"]) == (
        "accelerate+fsdp", "fsdp",
    )  # fmt: skip
    text = CliRunner().invoke(cli, ["checkpoints", str(made["trainer-z2"])]).output
    assert "trainer+deepspeed" in text and "no sha256 recorded" in text


def test_a_torchtitan_style_step_folder_is_a_complete_dcp_checkpoint(made, tmp_path) -> None:
    """DCP's own commit point is its .metadata: a step-N/ holding one (no manifest) is
    complete, never "incomplete (its save was interrupted)"."""
    ckdir = tmp_path / "checkpoint"
    shutil.copytree(made["fsdp2"] / "dcp", ckdir / "step-00000004")
    [row] = _rows(ckdir)
    assert (row["format"], row["step"], row["status"]) == ("dcp", 4, "complete")
    res = CliRunner().invoke(cli, ["checkpoints", str(ckdir / "step-00000004")])
    assert res.exit_code == 0 and "interrupted" not in res.output, res.output


def test_a_folder_that_is_no_checkpoint_says_what_was_looked_for(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    res = CliRunner().invoke(cli, ["checkpoints", str(tmp_path)])
    assert res.exit_code == 0
    assert "looked for" in res.output and "DeepSpeed folder (latest" in res.output
    res = consolidate(tmp_path, tmp_path / "out")
    assert res.exit_code != 0 and "looked for" in res.output
    assert "Traceback" not in res.output


# ------------------------------------------------------------------------ damage


def test_deepspeed_damage_is_named_for_what_the_format_proves(made, tmp_path) -> None:
    src = made["accelerate-z2"]
    # No `latest`: DeepSpeed writes it last, so the save did not finish.
    unfinished = tmp_path / "unfinished"
    shutil.copytree(src, unfinished)
    (unfinished / "latest").unlink()
    [row] = _rows(unfinished)
    assert row["status"] == "incomplete" and "did not finish" in row["problems"][0]
    # A rank's optimizer file gone: the model states record a world size of 2.
    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    next((missing / "pytorch_model").glob("zero_pp_rank_1_*optim_states.pt")).unlink()
    [row] = _rows(missing, exit_code=1)
    assert row["status"] == "corrupt"
    assert "rank(s) [1] are missing" in " ".join(row["problems"])
    # A truncated file.
    cut = tmp_path / "cut"
    shutil.copytree(src, cut)
    victim = next((cut / "pytorch_model").glob("zero_pp_rank_0_*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:1000])
    [row] = _rows(cut, exit_code=1)
    assert row["status"] == "corrupt" and str(victim) in " ".join(row["problems"])
    res = consolidate(cut, tmp_path / "out")
    assert res.exit_code != 0 and str(victim) in res.output
    assert "Traceback" not in res.output and not (tmp_path / "out").exists()


def test_dcp_damage_names_the_file_its_metadata_needs(made, tmp_path) -> None:
    copy = tmp_path / "dcp"
    shutil.copytree(made["fsdp2"] / "dcp", copy)
    victim = copy / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[:100])
    [row] = _rows(copy, exit_code=1)
    assert row["status"] == "corrupt"
    assert f"{victim}: 100 bytes, .metadata needs" in row["problems"][0]
    # DCP writes .metadata last: without it the save did not finish.
    (copy / ".metadata").unlink()
    [row] = _rows(copy)
    assert (row["format"], row["status"]) == ("dcp", "incomplete")
    assert "did not finish" in row["problems"][0]


# ------------------------------------------------------------------- consolidation


def _zero_to_fp32(folder: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(folder))


def _assert_equal(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize(
    ("case", "folder"),
    [
        ("accelerate-z2", "."),
        ("accelerate-z3-bf16", "."),
        ("trainer-z2", "checkpoint-4"),
        ("trainer-z3", "checkpoint-4"),
    ],
)
def test_consolidate_equals_deepspeeds_zero_to_fp32(made, tmp_path, case, folder) -> None:
    src = made[case] / folder
    res = consolidate(src, tmp_path / "model")
    assert res.exit_code == 0, res.output
    assert "records no sha256" in res.output
    got = load_file(tmp_path / "model" / "model.safetensors")
    _assert_equal(_zero_to_fp32(src), got)
    if case.startswith("trainer"):
        # The Trainer keeps config.json in checkpoint-N: the model loads with transformers.
        from transformers import AutoModelForCausalLM

        config = json.loads((tmp_path / "model" / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
        assert torch.equal(model.model.embed_tokens.weight, got["model.embed_tokens.weight"])


def test_a_trainer_output_dir_consolidates_its_newest_checkpoint(made, tmp_path) -> None:
    res = consolidate(made["trainer-z2"], tmp_path / "model", "-o", "json")
    assert res.exit_code == 0, res.output
    assert Path(json.loads(res.output)["checkpoint"]).name == "checkpoint-4"


@pytest.mark.parametrize("layout", ["dcp", "accelerate-fsdp"])
def test_consolidate_equals_torchs_dcp_to_torch_save(made, tmp_path, layout) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = made["fsdp2"] / layout
    res = consolidate(src, tmp_path / "model")
    assert res.exit_code == 0, res.output
    dcp_dir = src if layout == "dcp" else src / "pytorch_model_fsdp_0"
    dcp_to_torch_save(dcp_dir, tmp_path / "ref.pt")
    want = torch.load(tmp_path / "ref.pt", weights_only=True)["model"]
    _assert_equal(want, load_file(tmp_path / "model" / "model.safetensors"))
