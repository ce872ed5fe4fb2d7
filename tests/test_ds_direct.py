"""`convert --to deepspeed` writes DeepSpeed's ZeRO files itself (`portable/zero_out.py`).

The reference is independent of the code under test: the converter's engine way
(`ds_out.write_with_engine`: DeepSpeed's own ZeRO engine over the same state saves it),
run in the process group of the target world size, which then resumes both
checkpoints with `engine.load_checkpoint` on the real Llama and trains on. Sources: a
real FSDP2 run with tied embeddings (fp32, one param group) and a real DeepSpeed
ZeRO-3 run (bf16, tied, two param groups), both on 2 ranks; targets: ZeRO 1, 2 and 3,
on 2 and 3 ranks (a world-size change, padded partitions), ZeRO-3 sub-groups. A third
source, a model with persistent buffers (float, int and bf16 ones), is compared file by
file only: no Llama of the resuming run has them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.ckpt_run import run, torchrun_argv
from helpers.consolidate_util import MAKE_CKPT
from helpers.ds_compare import differences, folder_differences

pytestmark = pytest.mark.slow

RESUME = Path(__file__).parent / "helpers" / "ds_resume.py"
STEP = 3
# name: (source, ZeRO stage, world size, ZeRO-3 sub_group_size)
CASES: dict[str, tuple[str, int, int, int | None]] = {
    "buffers-z1-w2": ("buffers", 1, 2, None),  # bf16: the module's buffers keep their dtype
    "fsdp-z1-w2": ("fsdp", 1, 2, None),
    "ds-z2-w2": ("ds", 2, 2, None),  # bf16 files, tied names from DeepSpeed's shared_params
    "fsdp-z3-w3": ("fsdp", 3, 3, 4000),  # tied in DCP → ZeRO-3 (sub-groups)
    "ds-z1-w3": ("ds", 1, 3, None),  # 2 → 3 ranks: padded partitions, two param groups
}


def _make(tmp: Path, name: str, *args: str) -> Path:
    step = tmp / name / "checkpoints" / f"step-{STEP:08d}"
    argv = [*args, "--tied", "--steps", str(STEP), "--no-reference", "--out", str(step)]
    made = run(torchrun_argv(2, MAKE_CKPT, *argv), timeout=300)
    assert made.returncode == 0, made.stdout[-4000:]
    return step


def _make_with_buffers(tmp: Path) -> Path:
    """One AdamW step of a Llama with persistent buffers, saved with DCP by names as an
    FSDP run saves it (one process), declared bf16-mixed."""
    import os
    import warnings

    import torch.distributed.checkpoint as dcp
    from shardctl.train.manifest import describe_files, list_files, write_manifest
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.model.register_buffer("extra", torch.arange(5.0))
    model.model.layers[0].register_buffer("counts", torch.arange(3))
    model.register_buffer("low", torch.ones(4, dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 97, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    params = [p for g in opt.param_groups for p in g["params"]]
    name = {id(p): n for n, p in model.named_parameters()}
    saved = opt.state_dict()
    optim = {
        "state": {name[id(params[i])]: v for i, v in saved["state"].items()},
        "param_groups": [
            {**g, "params": [name[id(params[i])] for i in g["params"]]}
            for g in saved["param_groups"]
        ],
    }
    step = tmp / "buffers" / "checkpoints" / "step-00000001"
    staged = step.with_name(step.name + ".tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model.state_dict(), "optim": optim},
                 checkpoint_id=str(staged / "dcp"), no_dist=True)  # fmt: skip
    manifest = {
        "format_version": 1, "step": 1, "world_size": 1, "backend": "fsdp",
        "sharding": "full_shard", "zero_stage": 3, "precision": "bf16-mixed",
        "model": {"source": "llama", "dtype": "fp32", "hf_config": config.to_dict()},
        "versions": {}, "files": describe_files(staged, list_files(staged)),
    }  # fmt: skip
    write_manifest(staged, manifest)
    os.replace(staged, step)
    return step


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("sources")
    return {
        "buffers": _make_with_buffers(tmp),
        "fsdp": _make(tmp, "fsdp", "--backend", "fsdp"),
        "ds": _make(tmp, "ds", "--backend", "deepspeed", "--zero-stage", "3", "--precision",
                    "bf16"),
    }  # fmt: skip


def _portable(step_dir: Path) -> Any:
    from shardctl.train.portable.state import read_state

    return read_state(step_dir, json.loads((step_dir / "manifest.json").read_text()))


@pytest.fixture(scope="module")
def converted(
    sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Path]]:
    """Every case written directly and by the engine, then resumed from both."""
    from shardctl.train.portable import convert_checkpoint

    tmp = tmp_path_factory.mktemp("converted")
    out: dict[str, dict[str, Path]] = {}
    per_world: dict[int, list[dict[str, Any]]] = {}
    for name, (source, stage, world, sub_group) in CASES.items():
        direct, engine = tmp / f"{name}-direct", tmp / f"{name}-engine"
        report = convert_checkpoint(
            sources[source], "deepspeed", direct, world_size=world, zero_stage=stage,
            sub_group_size=sub_group,
        )  # fmt: skip
        assert report.writer == "direct", report.notes
        engine.mkdir()  # the engine writes its files beside the same manifest
        shutil.copy(direct / "manifest.json", engine / "manifest.json")
        results = {w: tmp / f"{name}-{w}.pt" for w in ("direct", "engine")}
        resumed = [[str(direct), str(results["direct"])], [str(engine), str(results["engine"])]]
        per_world.setdefault(world, []).append(
            {
                "stage": stage,
                "precision": report.precision,
                "sub_group_size": sub_group,
                "reference": {"source": str(sources[source]), "out": str(engine)},
                "resume": resumed if source != "buffers" else [],
            }
        )
        out[name] = {
            "direct": direct,
            "engine": engine,
            **{f"resumed-{w}": r for w, r in results.items()},
        }
    for world, cases in per_world.items():
        spec = tmp / f"cases-{world}.json"
        spec.write_text(json.dumps(cases))
        done = run(torchrun_argv(world, RESUME, str(spec)), timeout=600)
        assert done.returncode == 0, done.stdout[-6000:]
    return out


@pytest.mark.parametrize("name", CASES)
def test_the_files_are_the_engine_s_key_by_key(converted, sources, name: str) -> None:
    """Same files, keys in the same order, same types, values and tensor bits; and
    read back, the source's masters, moments and steps."""
    from shardctl.train.portable.state import materialize

    case = converted[name]
    assert folder_differences(case["direct"], case["engine"]) == []
    source, written = _portable(sources[CASES[name][0]]), _portable(case["direct"])
    assert (written.groups, written.steps, written.shared) == (
        source.groups, source.steps, source.shared,
    )  # fmt: skip
    for param in source.names:
        assert torch.equal(
            materialize(written.master[param]), materialize(source.master[param], "float32")
        ), param
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(
                materialize(written.moments[kind][param]),
                materialize(source.moments[kind][param], "float32"),
            ), (param, kind)


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[0] != "buffers"])
def test_deepspeed_resumes_it_bit_identical_to_the_engine_written_one(
    converted, sources, name: str
) -> None:
    from shardctl.train.portable.state import materialize

    case = converted[name]
    direct = torch.load(case["resumed-direct"], weights_only=False)
    engine = torch.load(case["resumed-engine"], weights_only=False)
    # What DeepSpeed loaded is the source's state, exactly (the model started elsewhere).
    source = _portable(sources[CASES[name][0]])
    assert direct["step"] == STEP
    assert sorted(direct["loaded"]) == sorted(source.names)
    for param, loaded in direct["loaded"].items():
        assert torch.equal(loaded["fp32"], materialize(source.master[param], "float32")), param
    # Training on from it: the same losses on every rank, the same masters and moments.
    assert direct["losses"] == engine["losses"] and direct["last"] == engine["last"]
    assert differences(direct["state"], engine["state"]) == []


def test_zip64_files_load_as_the_same_objects(
    sources: dict[str, Path], converted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state file of 4 GiB or more needs ZIP64 (a 551M-parameter model on one rank
    does); with the threshold lowered every record gets it: torch.load (DeepSpeed's
    loader) and the converter's own reader see the same checkpoint."""
    from shardctl.train.portable import convert_checkpoint, torchsave_out

    monkeypatch.setattr(torchsave_out, "ZIP32_LIMIT", 1024)
    out = tmp_path / "zip64"
    source, stage, world, sub_group = CASES["fsdp-z3-w3"]
    convert_checkpoint(
        sources[source], "deepspeed", out, world_size=world, zero_stage=stage,
        sub_group_size=sub_group,
    )  # fmt: skip
    optim = out / "deepspeed" / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    with zipfile.ZipFile(optim) as zf:
        assert zf.testzip() is None  # every CRC right
        assert any(i.file_size > 1024 and i.extract_version == 45 for i in zf.infolist())
    assert optim.read_bytes()[-98:-94] == b"PK\x06\x06"  # the ZIP64 end record
    assert folder_differences(out, converted["fsdp-z3-w3"]["direct"]) == []
    ours, ref = _portable(out), _portable(converted["fsdp-z3-w3"]["direct"])
    from shardctl.train.portable.state import materialize

    for name in ref.names:
        assert torch.equal(materialize(ours.master[name]), materialize(ref.master[name])), name


def test_the_direct_writer_needs_no_deepspeed_import_and_no_rank_processes(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    code = (
        "import sys; from pathlib import Path; "
        "from shardctl.train.portable import convert_checkpoint; "
        "r = convert_checkpoint(Path(sys.argv[1]), 'deepspeed', Path(sys.argv[2]), "
        "world_size=4, zero_stage=3); "
        "import multiprocessing; print(r.writer, 'deepspeed' in sys.modules, "
        "len(multiprocessing.active_children()))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(sources["ds"]), str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["direct", "False", "0"]
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["zero_stage"]) == (4, 3)
    import hashlib

    for rel, entry in manifest["files"].items():  # hashed while written: the files' own
        assert hashlib.sha256((tmp_path / "ck" / rel).read_bytes()).hexdigest() == entry["sha256"]


def test_what_the_direct_writer_cannot_write_is_named() -> None:
    from shardctl.train.consolidate.io import SourceTensor
    from shardctl.train.portable.state import PortableState
    from shardctl.train.portable.zero_out import unsupported

    def state(groups: list[list[str]], hyper: dict[str, Any], shapes: dict[str, tuple]) -> Any:
        master = {n: SourceTensor(n, shapes.get(n, (4,)), "float32") for g in groups for n in g}
        return PortableState("fsdp", 2, None, groups, [hyper] * len(groups), {}, master, {})

    ok = state([["a", "b"]], {"lr": 0.1, "betas": (0.9, 0.95)}, {})
    assert unsupported(ok, "0.19.8") is None
    assert "0.21.0" in unsupported(ok, "0.21.0") and "0.19.x" in unsupported(ok, "0.21.0")
    assert "not installed" in unsupported(ok, None)
    assert "group 1 has no parameters" in unsupported(state([["a"], []], {}, {}), "0.19.8")
    assert "parameter b has no elements" in unsupported(
        state([["a", "b"]], {}, {"b": (0, 4)}), "0.19.8"
    )
    assert "lr is a object" in unsupported(state([["a"]], {"lr": object()}, {}), "0.19.8")


def test_ds_writer_is_refused_where_it_means_nothing(sources: dict[str, Path], tmp_path) -> None:
    from click.testing import CliRunner
    from shardctl.orchestrator.cli import cli

    cases = [
        (["--to", "fsdp", "--ds-writer", "engine"], "accepted with --to deepspeed only"),
        (["--to", "deepspeed", "--world-size", "2", "--ds-writer", "fast"],
         "'fast' is not one of 'direct', 'engine'"),
    ]  # fmt: skip
    for args, message in cases:
        res = CliRunner().invoke(cli, ["convert", str(sources["ds"]), *args, "--out",
                                       str(tmp_path / "out")])  # fmt: skip
        assert res.exit_code == 2, res.output
        assert message in res.output and "Traceback" not in res.output, res.output
        assert not (tmp_path / "out").exists()
