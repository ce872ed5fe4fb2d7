"""Consolidation, single process: the safetensors writer, DCP reading, bad input, CLI.

Multi-rank FSDP and DeepSpeed checkpoints are in test_consolidate_dist.py (slow).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.consolidate_util import make_dcp_step, tiny_llama
from safetensors import safe_open
from safetensors.torch import load_file
from shardctl.orchestrator.cli import cli
from shardctl.orchestrator.cli.consolidate import parse_size
from shardctl.orchestrator.errors import CheckpointError, UsageError
from shardctl.train.consolidate import consolidate
from shardctl.train.consolidate.io import Chunk, SourceTensor, segments_of_ref
from shardctl.train.consolidate.safetensors_out import plan_shards, write_shards
from shardctl.train.consolidate.torchzip import load_refs


def _load_dir(out: Path) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return load_file(out / "model.safetensors")
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        merged.update(load_file(out / f))
    return merged


# ----------------------------------------------------------------- torch.save zips → refs


def test_refs_locate_views_dtypes_and_offsets_inside_a_file(tmp_path):
    base = torch.arange(60, dtype=torch.float32).view(6, 10)
    obj = {"row": base[2], "view": base[1:3], "bf": base.to(torch.bfloat16), "n": 3}
    raw = tmp_path / "blob"
    # A torch.save stream in the middle of a file, like a DCP item.
    prefix = b"x" * 123
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    raw.write_bytes(prefix + buf.getvalue() + b"tail")
    refs = load_refs(raw, len(prefix), len(buf.getvalue()), trusted=False)
    assert refs["n"] == 3
    assert refs["row"].shape == (10,) and refs["row"].storage_offset == 20
    assert refs["bf"].dtype == "bfloat16"
    from shardctl.train.consolidate.io import read_ref

    for key in ("row", "view", "bf"):
        assert torch.equal(read_ref(refs[key]), obj[key]), key


def test_weights_only_refs_refuse_arbitrary_classes(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"a": torch.ones(2), "obj": Path("x")}, path)
    with pytest.raises(CheckpointError, match=r"evil\.pt.*not allowed"):
        load_refs(path, trusted=False)
    assert "obj" in load_refs(path, trusted=True)


# ------------------------------------------------------------------- streaming writer


def _sources(tmp_path: Path) -> tuple[list[SourceTensor], dict[str, torch.Tensor]]:
    full = {
        "a": torch.randn(7, 5),
        "b": torch.randn(64),
        "c": torch.randn(4, 6),
        "steps": torch.tensor([3, 4], dtype=torch.int64),
    }
    torch.save(
        {"a0": full["a"][:3], "a1": full["a"][3:], "b": full["b"], "steps": full["steps"]},
        tmp_path / "p.pt",
    )
    # "c" split along dim 1 (as tensor parallelism would): assembled, not streamed.
    torch.save({"c0": full["c"][:, :2].clone(), "c1": full["c"][:, 2:].clone()}, tmp_path / "q.pt")
    p = load_refs(tmp_path / "p.pt", trusted=False)
    q = load_refs(tmp_path / "q.pt", trusted=False)
    src = [
        SourceTensor(
            "a", (7, 5), "float32",
            segments=[segments_of_ref(p["a0"], 0, 15), segments_of_ref(p["a1"], 0, 20)],
        ),
        SourceTensor("b", (64,), "float32", segments=[segments_of_ref(p["b"], 0, 64)]),
        SourceTensor(
            "c", (4, 6), "float32", chunks=[Chunk(q["c0"], (0, 0)), Chunk(q["c1"], (0, 2))]
        ),
        SourceTensor("steps", (2,), "int64", segments=[segments_of_ref(p["steps"], 0, 2)]),
    ]  # fmt: skip
    return src, full


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_writer_streams_segments_and_chunks_into_valid_safetensors(tmp_path, dtype):
    src, full = _sources(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    files = write_shards(plan_shards(src, dtype, 10**9), out, dtype)
    assert [f.name for f in files] == ["model.safetensors"]
    got = load_file(out / "model.safetensors")
    want_dtype = getattr(torch, dtype)
    for name, t in full.items():
        expected = t.to(want_dtype) if t.is_floating_point() else t
        assert torch.equal(got[name], expected), name
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_writer_shards_like_transformers_with_an_index(tmp_path):
    src, full = _sources(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    # a=140 B, b=256 B (> limit: a shard of its own), c=96 B, steps=16 B
    shards = plan_shards(src, "float32", 200)
    assert [[t.name for t in s.tensors] for s in shards] == [["a"], ["b"], ["c", "steps"]]
    write_shards(shards, out, "float32")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 140 + 256 + 96 + 16
    assert index["weight_map"] == {
        "a": "model-00001-of-00003.safetensors",
        "b": "model-00002-of-00003.safetensors",
        "c": "model-00003-of-00003.safetensors",
        "steps": "model-00003-of-00003.safetensors",
    }
    got = _load_dir(out)
    assert all(torch.equal(got[k], v) for k, v in full.items())


def test_truncated_source_is_named(tmp_path):
    src, _ = _sources(tmp_path)
    data = (tmp_path / "p.pt").read_bytes()
    (tmp_path / "p.pt").write_bytes(data[: len(data) // 3])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError, match=r"p\.pt is truncated"):
        write_shards(plan_shards(src, "float32", 10**9), out, "float32")


# ------------------------------------------------------------------- DCP end to end


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder with two complete DCP checkpoints (steps 1, 2) and one .tmp (3)."""
    root = tmp_path_factory.mktemp("run")
    ckpts = root / "checkpoints"
    for step in (1, 2):
        model = tiny_llama(tied=True, seed=step)
        make_dcp_step(ckpts, step, model.state_dict(), model.config.to_dict())
    (ckpts / "step-00000003.tmp" / "dcp").mkdir(parents=True)
    return root


def test_dcp_consolidates_to_what_from_pretrained_loads_with_equal_logits(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "model"
    result = consolidate(run_dir, out)  # a run folder: newest complete checkpoint
    assert result.checkpoint.name == "step-00000002"
    assert not (tmp_path / "model.tmp").exists()
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    # Tied embeddings are written once, like save_pretrained does.
    assert "lm_head.weight" not in _load_dir(out)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    trained = tiny_llama(tied=True, seed=2)
    ids = torch.randint(0, 131, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, trained(input_ids=ids).logits)
    assert result.tensors == len(trained.state_dict()) - 1
    assert result.total_bytes == sum(
        v.numel() * 4 for k, v in trained.state_dict().items() if k != "lm_head.weight"
    )


def test_bf16_output_is_the_rounded_fp32_masters(run_dir, tmp_path):
    consolidate(run_dir, tmp_path / "m32")
    r = consolidate(run_dir, tmp_path / "m16", dtype="bf16", max_shard_bytes=20_000)
    assert len(r.files) > 2 and r.files[-1].name == "model.safetensors.index.json"
    fp32, bf16 = _load_dir(tmp_path / "m32"), _load_dir(tmp_path / "m16")
    assert fp32.keys() == bf16.keys()
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    config = json.loads((tmp_path / "m16" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_incomplete_checkpoint_is_refused_naming_the_newest_complete(run_dir, tmp_path):
    with pytest.raises(CheckpointError, match=r"incomplete.*newest complete.*step-00000002"):
        consolidate(run_dir / "checkpoints" / "step-00000003.tmp", tmp_path / "m")
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.tmp").exists()


def test_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        consolidate(tmp_path / "empty", tmp_path / "m")
    with pytest.raises(CheckpointError, match="does not exist"):
        consolidate(tmp_path / "nope", tmp_path / "m")


def _copy_step(run_dir: Path, dst: Path) -> Path:
    import shutil

    step = dst / "checkpoints" / "step-00000002"
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", step)
    return step


def test_truncated_file_is_named(run_dir, tmp_path):
    step = _copy_step(run_dir, tmp_path)
    distcp = sorted((step / "dcp").glob("*.distcp"))[0]
    distcp.write_bytes(distcp.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=rf"{distcp.name}: size 1000 bytes"):
        consolidate(step, tmp_path / "m")


def _flip_a_byte(step: Path) -> tuple[Path, str]:
    """One byte of a .distcp altered, same size; returns the file and its old sha256."""
    import hashlib

    distcp = sorted((step / "dcp").glob("*.distcp"))[0]
    data = bytearray(distcp.read_bytes())
    before = hashlib.sha256(data).hexdigest()
    data[len(data) // 2] ^= 0xFF
    distcp.write_bytes(bytes(data))
    return distcp, before


def test_altered_file_is_refused_by_default_naming_file_and_digests(run_dir, tmp_path):
    import hashlib

    step = _copy_step(run_dir, tmp_path)
    distcp, expected = _flip_a_byte(step)
    actual = hashlib.sha256(distcp.read_bytes()).hexdigest()
    with pytest.raises(CheckpointError) as info:
        consolidate(step, tmp_path / "m")
    message = str(info.value)
    assert f"{distcp.name}: sha256 {actual}, manifest expects {expected}" in message
    assert "--no-verify" in message
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.tmp").exists()
    # --no-verify: the old speed, the old trust (sizes only).
    assert consolidate(step, tmp_path / "m", verify=False).checkpoint == step


def test_a_folder_gives_the_checkpoint_resume_would_pick(run_dir, tmp_path):
    """The newest checkpoint fails verification: like resume, the previous one is used
    and the note says why; the choice is the one `latest_complete` (resume) makes."""
    import shutil

    from shardctl.train.manifest import latest_complete

    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(run_dir / "checkpoints", ckpts)
    distcp, _ = _flip_a_byte(ckpts / "step-00000002")
    result = consolidate(tmp_path / "run", tmp_path / "m")
    assert result.checkpoint == latest_complete(ckpts) == ckpts / "step-00000001"
    assert any("step-00000002 failed verification" in n and distcp.name in n for n in result.notes)
    loaded = _load_dir(tmp_path / "m")
    trained = tiny_llama(tied=True, seed=1).state_dict()
    assert all(torch.equal(loaded[k], trained[k]) for k in loaded)
    # Every one damaged: refused, nothing written.
    _flip_a_byte(ckpts / "step-00000001")
    with pytest.raises(CheckpointError, match=r"every complete checkpoint .* failed verification"):
        consolidate(tmp_path / "run", tmp_path / "m2")
    assert not (tmp_path / "m2").exists() and not (tmp_path / "m2.tmp").exists()
    res = CliRunner().invoke(
        cli, ["consolidate", str(ckpts / "step-00000002"), "--out", str(tmp_path / "m3")]
    )
    assert res.exit_code == 1 and distcp.name in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(
        cli,
        ["consolidate", str(ckpts / "step-00000002"), "--out", str(tmp_path / "m3"),
         "--no-verify", "--no-progress"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output


def test_corrupt_metadata_is_named(run_dir, tmp_path):
    step = _copy_step(run_dir, tmp_path)
    (step / "dcp" / ".metadata").write_bytes(b"garbage")
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["dcp/.metadata"]["size"] = 7
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"\.metadata is corrupt"):  # the reader's own check
        consolidate(step, tmp_path / "m", verify=False)


def test_existing_output_is_kept_unless_forced(run_dir, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(UsageError, match="--force"):
        consolidate(run_dir, out)
    assert (out / "precious.txt").read_text() == "keep me"
    consolidate(run_dir, out, force=True)
    assert not (out / "precious.txt").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no .tmp / .old left


def test_interrupted_consolidation_leaves_the_old_model_and_no_tmp(run_dir, tmp_path):
    out = tmp_path / "model"
    consolidate(run_dir, out)
    before = (out / "model.safetensors").read_bytes()

    def interrupt(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt  # Ctrl-C (or a crash) in the middle of the copy

    with pytest.raises(KeyboardInterrupt):
        consolidate(run_dir, out, force=True, dtype="bf16", progress=interrupt)
    assert (out / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


# ------------------------------------------------------------------------------- CLI


def test_cli_defaults_to_model_in_the_run_dir_and_prints_where(run_dir, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    res = CliRunner().invoke(cli, ["consolidate", str(run), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert f"model: {run / 'model'}" in res.output
    assert (run / "model" / "model.safetensors").exists()
    res = CliRunner().invoke(cli, ["consolidate", str(run), "-o", "json"])
    assert res.exit_code == 2 and "--force" in res.output
    res = CliRunner().invoke(
        cli,
        ["consolidate", str(run / "checkpoints"), "--force", "--dtype", "bf16",
         "--max-shard-size", "20KB", "-o", "json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["dtype"] == "bf16" and len(data["files"]) > 2


def test_cli_bad_input_messages(tmp_path):
    res = CliRunner().invoke(cli, ["consolidate", str(tmp_path)])
    assert res.exit_code == 1 and "is not a checkpoint" in res.output
    res = CliRunner().invoke(cli, ["consolidate", str(tmp_path), "--max-shard-size", "lots"])
    assert res.exit_code == 2 and "--max-shard-size 'lots'" in res.output


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5 MiB") == 3 * 2**19
    assert parse_size("1234") == 1234
    for bad in ("", "0", "-1GB", "5 GX"):
        with pytest.raises(UsageError):
            parse_size(bad)


def test_cli_module_imports_no_torch():
    code = (
        "import sys; import shardctl.orchestrator.cli.consolidate; "
        "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_names_not_matching_the_model_config_are_refused(tmp_path):
    model = tiny_llama()
    sd = dict(model.state_dict())
    sd["model.extra.weight"] = sd.pop("model.norm.weight")
    step = make_dcp_step(tmp_path / "checkpoints", 1, sd, model.config.to_dict())
    with pytest.raises(CheckpointError, match=r"missing \['model.norm.weight'\].*model.extra"):
        consolidate(step, tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_metadata_reader_agrees_with_dcps_own(run_dir):
    from shardctl.train.consolidate.dcp import _from_records, read_metadata
    from torch.distributed.checkpoint import FileSystemReader

    dcp_dir = run_dir / "checkpoints" / "step-00000002" / "dcp"
    ours = read_metadata(dcp_dir)
    theirs = _from_records(FileSystemReader(str(dcp_dir)).read_metadata())
    assert ours == theirs and len(ours.tensors) > 20


def test_fsync_by_default_only_when_replacing_a_model(run_dir, tmp_path, monkeypatch):
    import os

    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    consolidate(run_dir, tmp_path / "model")
    assert synced == []  # a new folder: written like save_pretrained writes its own
    consolidate(run_dir, tmp_path / "model", force=True)
    assert len(synced) >= 4  # shard, config files, the folder, its parent
    synced.clear()
    consolidate(run_dir, tmp_path / "other", durable=True)
    assert synced


def test_cli_finds_checkpoints_elsewhere_through_the_spec(run_dir, tmp_path):
    """checkpoint.dir on a scratch file system: the model still goes to <run_dir>/model."""
    import shutil

    scratch = tmp_path / "scratch" / "ckpts"
    shutil.copytree(run_dir / "checkpoints", scratch)
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: elsewhere\n"
        f"run_dir: {tmp_path / 'runs' / 'elsewhere'}\n"
        "train: {model: {llama: {vocab_size: 256}}, data: {builtin: python-stdlib}, steps: 2}\n"
        f"checkpoint: {{every_steps: 1, dir: {scratch}}}\n"
    )
    res = CliRunner().invoke(cli, ["consolidate", str(spec), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "runs" / "elsewhere" / "model" / "model.safetensors").is_file()
    assert not (tmp_path / "scratch" / "model").exists()
    # A bare step folder outside any run dir: where the model goes must be said.
    res = CliRunner().invoke(cli, ["consolidate", str(scratch / "step-00000002")])
    assert res.exit_code == 2 and "--out" in res.output and "Traceback" not in res.output


def _record_state_keys(step: Path, model) -> None:
    """What shardctl's loop writes: the model's names in the manifest."""
    from shardctl.train.model import state_keys

    path = step / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["model"]["state_keys"] = state_keys(model)
    path.write_text(json.dumps(manifest))


def test_recorded_names_are_checked_without_importing_torch_or_transformers(tmp_path):
    model = tiny_llama(tied=True)
    step = make_dcp_step(tmp_path / "checkpoints", 1, model.state_dict(), model.config.to_dict())
    _record_state_keys(step, model)
    code = (  # the command as a user runs it: nothing heavy is imported to start
        "import sys; from shardctl.orchestrator.cli import cli; "
        "cli(['consolidate', sys.argv[1], '--out', sys.argv[2], '--no-progress', '-o', "
        "'json'], standalone_mode=False); "
        "print(sorted(m for m in ('torch', 'transformers', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(step), str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result, imported = out.stdout.rsplit("\n", 2)[:2]
    assert imported == "[]"
    # the tied lm_head is written once, as from the rebuilt model
    assert json.loads(result)["tensors"] == len(model.state_dict()) - 1
    loaded = _load_dir(tmp_path / "model")
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(loaded[name], tensor), name


def test_names_not_matching_the_recorded_names_are_refused(tmp_path):
    model = tiny_llama()
    sd = dict(model.state_dict())
    sd["model.extra.weight"] = sd.pop("model.norm.weight")
    step = make_dcp_step(tmp_path / "checkpoints", 1, sd, model.config.to_dict())
    _record_state_keys(step, model)
    with pytest.raises(CheckpointError, match=r"missing \['model.norm.weight'\].*model.extra"):
        consolidate(step, tmp_path / "model")


def test_a_newer_damaged_or_unfinished_checkpoint_is_named_when_an_older_one_is_used(
    run_dir, tmp_path
):
    """step-3 lost a file its manifest lists (damaged: not complete), step-4 never
    finished (.tmp): the model comes from step 2 and the notes say why each newer one
    was skipped (the docs promise it)."""
    import shutil

    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(run_dir / "checkpoints", ckpts)
    shutil.copytree(ckpts / "step-00000002", ckpts / "step-00000003")
    manifest = json.loads((ckpts / "step-00000003" / "manifest.json").read_text())
    manifest["step"] = 3
    (ckpts / "step-00000003" / "manifest.json").write_text(json.dumps(manifest))
    next((ckpts / "step-00000003" / "dcp").glob("*.distcp")).unlink()
    result = consolidate(tmp_path / "run", tmp_path / "m")
    assert result.checkpoint == ckpts / "step-00000002"
    assert any(n.startswith("skipped step-00000003: ") and "missing" in n for n in result.notes)
    assert any(n.startswith("skipped step-00000003.tmp: ") for n in result.notes)
    assert "used step-00000002, the newest that resume would take" in result.notes


def test_config_json_names_the_architecture_a_serving_engine_dispatches_on(tmp_path):
    """A config built directly (LlamaConfig(...).to_dict()) has architectures None;
    vLLM and TGI pick the model class from it, so the consolidated config names it."""
    from shardctl.train.consolidate import _write_config

    _write_config({"model_type": "llama", "architectures": None, "vocab_size": 8}, "fp32", tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    _write_config({"model_type": "no-such-model", "architectures": None}, "fp32", tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] is None
    import transformers  # noqa: F401  (imported already: other model types are looked up)

    _write_config({"model_type": "gpt2", "architectures": None}, "fp32", tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "GPT2LMHeadModel"
    ]
