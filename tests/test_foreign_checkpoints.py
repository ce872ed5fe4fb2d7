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
    # accelerate's default FSDP layout (FULL_STATE_DICT): the whole state, torch.saved.
    full = fsdp["accelerate-fsdp-full"]
    assert (full["format"], full["backend"], full["status"]) == ("accelerate", "full", "complete")
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


def test_accelerate_s_default_fsdp_save_consolidates_to_what_torch_loads(made, tmp_path) -> None:
    """`pytorch_model_fsdp.bin` (FULL_STATE_DICT, accelerate's default; a CUDA GPU wrote
    the same layout through accelerate's FSDP2 plugin: benchmarks/README.md): the
    consolidated weights are what `torch.load` reads; a cut file is named corrupt."""
    src = made["fsdp2"] / "accelerate-fsdp-full"
    res = consolidate(src, tmp_path / "model")
    assert res.exit_code == 0, res.output
    want = torch.load(src / "pytorch_model_fsdp.bin", weights_only=True)
    _assert_equal(want, load_file(tmp_path / "model" / "model.safetensors"))

    cut = tmp_path / "cut"
    shutil.copytree(src, cut)
    with (cut / "pytorch_model_fsdp.bin").open("r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    [row] = _rows(cut, exit_code=1)
    assert row["status"] == "corrupt" and "not a whole torch.save file" in row["problems"][0]
    res = consolidate(cut, tmp_path / "cut-model")
    assert res.exit_code != 0 and "not a whole torch.save file" in res.output
    assert not (tmp_path / "cut-model").exists()


# ------------------------------------------------------------------------ conversion

RESUME = Path(__file__).parent / "helpers" / "foreign_resume.py"


def _resume(mode: str, ckpt: Path, losses: Path, *extra: str) -> dict[int, float]:
    res = run(torchrun_argv(2, RESUME, "--mode", mode, "--ckpt", str(ckpt),
                            "--losses", str(losses), *extra), timeout=400)  # fmt: skip
    assert res.returncode == 0, res.stdout[-6000:]
    return {int(k): v for k, v in json.loads(losses.read_text()).items()}


def convert(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, ["convert", *args])


def test_accelerate_deepspeed_to_fsdp_and_back_resumes_where_it_stopped(tmp_path) -> None:
    """The seed's story: trained with accelerate on DeepSpeed ZeRO-2, continued on FSDP,
    and back. Steps 0-3 are trained and saved by accelerate; the uninterrupted run's
    losses of steps 4-5 are the reference.

    The FSDP side loads the converted folder exactly as accelerate's FSDP2 loader does
    (a plain FSDP2 model: accelerate's FSDP plugin needs a GPU). Its first loss is the
    reference's bit for bit (same weights); the next one differs in the last bits only,
    because FSDP2's gradient reduce-scatter and Adam kernel are not DeepSpeed's. Back on
    DeepSpeed, `accelerator.load_state` continues bit for bit."""
    ds = tmp_path / "checkpoint_0"
    ref = _resume("uninterrupted", ds, tmp_path / "ref.json")
    res = convert(str(ds), "--to", "fsdp", "--out", str(tmp_path / "fsdp"))
    assert res.exit_code == 0, res.output
    assert "laid out for accelerate" in res.output and "carried: random_states_0.pkl" in res.output
    assert (tmp_path / "fsdp" / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert (tmp_path / "fsdp" / "optimizer_0" / ".metadata").is_file()
    [row] = _rows(tmp_path / "fsdp")
    assert (row["format"], row["status"]) == ("accelerate+fsdp", "complete")
    on_fsdp = _resume("accelerate-fsdp-layout", tmp_path / "fsdp", tmp_path / "fsdp.json")
    assert on_fsdp[4] == ref[4]
    assert on_fsdp[5] == pytest.approx(ref[5], rel=1e-5)

    res = convert(str(tmp_path / "fsdp"), "--to", "deepspeed", "--out", str(tmp_path / "back"))
    assert res.exit_code == 2 and "--world-size is required" in res.output
    res = convert(str(tmp_path / "fsdp"), "--to", "deepspeed", "--world-size", "2",
                  "--zero-stage", "2", "--out", str(tmp_path / "back"))  # fmt: skip
    assert res.exit_code == 0, res.output
    assert (tmp_path / "back" / "latest").read_text() == "pytorch_model"
    assert _resume("accelerate-ds", tmp_path / "back", tmp_path / "back.json") == ref


def test_a_trainer_checkpoint_goes_to_fsdp_and_back_and_the_trainer_resumes_it(
    made, tmp_path
) -> None:
    """checkpoint-2 of the Trainer's ZeRO-2 run → FSDP (trainer layout: its state,
    scheduler and RNG files carried) → DeepSpeed again; `Trainer.train(
    resume_from_checkpoint=...)` takes it and logs the uninterrupted run's losses."""
    src = made["trainer-z2"] / "checkpoint-2"
    res = convert(str(src), "--to", "fsdp", "--out", str(tmp_path / "checkpoint-2-fsdp"))
    assert res.exit_code == 0, res.output
    fsdp = tmp_path / "checkpoint-2-fsdp"
    for name in ("trainer_state.json", "scheduler.pt", "training_args.bin", "config.json"):
        assert (fsdp / name).read_bytes() == (src / name).read_bytes(), name
    [row] = _rows(fsdp)
    assert (row["format"], row["step"]) == ("trainer+fsdp", 2)
    back = tmp_path / "checkpoint-2"
    res = convert(str(fsdp), "--to", "deepspeed", "--world-size", "2", "--zero-stage", "2",
                  "--out", str(back))  # fmt: skip
    assert res.exit_code == 0, res.output
    assert (back / "latest").read_text() == "global_step2"
    _torchrun(tmp_path / "resumed", [*MAKERS["trainer-z2"], "--resume", str(back)])
    resumed = json.loads((tmp_path / "resumed" / "log.json").read_text())
    state = json.loads((made["trainer-z2"] / "checkpoint-4" / "trainer_state.json").read_text())
    uninterrupted = {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}
    # The log history goes on from the carried trainer_state.json (steps 1-2).
    assert {int(k): v for k, v in resumed.items()} == uninterrupted


def test_a_plain_dcp_checkpoint_goes_to_deepspeed_with_the_same_weights(made, tmp_path) -> None:
    src = made["fsdp2"] / "dcp"
    res = convert(str(src), "--to", "deepspeed", "--world-size", "2", "--out", str(tmp_path / "ds"))
    assert res.exit_code == 0, res.output
    [row] = _rows(tmp_path / "ds")
    assert (row["format"], row["backend"], row["world_size"]) == ("deepspeed", "deepspeed", 2)
    assert consolidate(src, tmp_path / "a").exit_code == 0
    assert consolidate(tmp_path / "ds", tmp_path / "b").exit_code == 0
    a = load_file(tmp_path / "a" / "model.safetensors")
    _assert_equal(a, load_file(tmp_path / "b" / "model.safetensors"))
    _assert_equal(_zero_to_fp32(tmp_path / "ds"), a)


def test_conversion_refusals_are_one_line(made, tmp_path) -> None:
    res = convert(str(made["fsdp2"] / "dcp"), "--to", "fsdp", "--out", str(tmp_path / "x"))
    assert res.exit_code == 2 and "already an FSDP checkpoint" in res.output
    res = convert(str(made["accelerate-z2"]), "--to", "fsdp", "--layout", "bogus",
                  "--out", str(tmp_path / "x"))  # fmt: skip
    assert res.exit_code == 2 and "bogus" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "x").exists()


def test_the_built_in_loop_resumes_another_tools_checkpoint_after_convert(made, tmp_path) -> None:
    """checkpoint.resume names the command when given another tool's folder; converted
    with --layout shardctl, the loop resumes its model and optimizer at its step."""
    from helpers.train_run import tiny_spec, train

    src = made["trainer-z2"] / "checkpoint-4"
    spec = tiny_spec(tmp_path, "direct", checkpoint={"resume": str(src)},
                     strategy={"precision": "fp32"}, train={"steps": 6})  # fmt: skip
    res = train(spec)
    assert res.returncode != 0
    assert "is a trainer+deepspeed checkpoint" in res.stdout, res.stdout[-4000:]
    assert "--to fsdp --layout shardctl" in res.stdout and "(not retried: exit 78)" in res.stdout

    conv = tmp_path / "as-shardctl"
    res = convert(str(src), "--to", "fsdp", "--layout", "shardctl", "--out", str(conv))
    assert res.exit_code == 0, res.output
    assert _rows(conv)[0]["format"] == "shardctl"
    spec = tiny_spec(tmp_path, "resumed", checkpoint={"resume": str(conv)},
                     strategy={"precision": "fp32"}, train={"steps": 6})  # fmt: skip
    res = train(spec)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "converted from another tool's checkpoint" in res.stdout
    metrics = [json.loads(line) for line in (tmp_path / "resumed" / "logs" / "metrics.jsonl")
               .read_text().splitlines() if '"step"' in line]  # fmt: skip
    assert sorted({m["step"] for m in metrics}) == [5, 6]


def test_an_unsharded_trainer_checkpoint_is_listed_consolidated_and_not_converted(tmp_path) -> None:
    """The Trainer in one process without DeepSpeed: model.safetensors + optimizer.pt."""
    import subprocess
    import sys

    out = tmp_path / "trainer"
    proc = subprocess.run([sys.executable, str(HELPER), "--tool", "trainer", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _rows(out)
    assert [(r["format"], r["step"], r["backend"]) for r in rows] == [
        ("trainer", 2, "full"), ("trainer", 4, "full"),
    ]  # fmt: skip
    res = consolidate(out, tmp_path / "model")
    assert res.exit_code == 0, res.output
    _assert_equal(load_file(out / "checkpoint-4" / "model.safetensors"),
                  load_file(tmp_path / "model" / "model.safetensors"))  # fmt: skip
    res = convert(str(out / "checkpoint-4"), "--to", "deepspeed", "--world-size", "2",
                  "--out", str(tmp_path / "x"))  # fmt: skip
    assert res.exit_code == 2 and "unsharded save" in res.output
