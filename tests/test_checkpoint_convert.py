"""`shardctl convert STEP_DIR --to fsdp|deepspeed`: a run moves between backends and
world sizes with its optimizer state (real trainer under torchrun, CPU + gloo).

One shared set of trained runs (module fixtures): an uninterrupted 10-step run of
each backend, checkpointed at step 5. A run resumed from a converted step 5 must
end bit-identical to the uninterrupted run: the conversion is lossless (fp32
masters, Adam moments, step counts; the trainer state is copied) and DeepSpeed
and FSDP each reproduce their own steps exactly on the same world size.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.train_run import assert_bit_equal, final_weights, metrics, tiny_spec, train, train_ok

pytestmark = pytest.mark.slow

SHARDCTL = str(Path(sys.executable).parent / "shardctl")
STEPS, EVERY = 10, 5
FP32 = {"precision": "fp32"}
DS = {"backend": "deepspeed", "sharding": "full_shard", **FP32}
FSDP = {"backend": "fsdp", "sharding": "full_shard", **FP32}


def _spec(
    tmp: Path,
    name: str,
    strategy: dict[str, Any],
    *,
    steps: int = STEPS,
    nproc: int = 2,
    resume: str = "auto",
) -> Path:
    return tiny_spec(
        tmp,
        name,
        strategy=strategy,
        resources={"procs_per_node": nproc},
        train={"steps": steps, "grad_accum": 1},
        checkpoint={"every_steps": EVERY, "keep": 3, "resume": resume},
    )  # fmt: skip


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def convert(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SHARDCTL, "convert", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def convert_ok(*args: str) -> str:
    res = convert(*args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run) if "loss" in m}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted 2-rank runs: DeepSpeed ZeRO-3 and FSDP2, fp32, step 5 kept."""
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    for name, strategy in (("ds3", DS), ("fsdp", FSDP)):
        train_ok(_spec(tmp, name, strategy))
        out[name] = tmp / name
    return out


def _resume(tmp: Path, name: str, strategy: dict[str, Any], ckpt: Path, nproc: int = 2) -> Path:
    spec = _spec(tmp, name, strategy, nproc=nproc, resume=str(ckpt))
    res = train_ok(spec, nproc=nproc)
    assert f"resumed at step {EVERY}" in res.stdout, res.stdout[-3000:]
    return tmp / name


def test_deepspeed_to_fsdp_to_deepspeed_resumes_bit_identical(runs, tmp_path: Path) -> None:
    fsdp_ck, ds_ck = tmp_path / "as-fsdp", tmp_path / "as-ds"
    out = convert_ok(_step(runs["ds3"], EVERY), "--to", "fsdp", "--out", fsdp_ck)
    assert "converted deepspeed step 5" in out and "checkpoint.resume" in out
    convert_ok(fsdp_ck, "--to", "deepspeed", "--world-size", "2", "--out", ds_ck)
    manifest = json.loads((ds_ck / "manifest.json").read_text())
    assert (manifest["backend"], manifest["world_size"], manifest["zero_stage"]) == (
        "deepspeed", 2, 3,
    )  # fmt: skip
    assert manifest["converted_from"]["backend"] == "fsdp"
    resumed = _resume(tmp_path, "ds-again", DS, ds_ck)
    assert_bit_equal(
        final_weights(_step(resumed, STEPS), tmp_path / "m1"),
        final_weights(_step(runs["ds3"], STEPS), tmp_path / "m2"),
    )
    assert {s: v for s, v in _losses(resumed).items() if s > EVERY} == {
        s: v for s, v in _losses(runs["ds3"]).items() if s > EVERY
    }


def test_fsdp_to_deepspeed_to_fsdp_resumes_bit_identical(runs, tmp_path: Path) -> None:
    ds_ck, fsdp_ck = tmp_path / "as-ds", tmp_path / "as-fsdp"
    convert_ok(_step(runs["fsdp"], EVERY), "--to", "deepspeed", "--world-size", "3",
               "--zero-stage", "2", "--out", ds_ck)  # fmt: skip
    convert_ok(ds_ck, "--to", "fsdp", "--out", fsdp_ck)
    resumed = _resume(tmp_path, "fsdp-again", FSDP, fsdp_ck)
    assert_bit_equal(
        final_weights(_step(resumed, STEPS), tmp_path / "m1"),
        final_weights(_step(runs["fsdp"], STEPS), tmp_path / "m2"),
    )


def test_deepspeed_step_5_continues_under_fsdp_on_3_ranks(runs, tmp_path: Path) -> None:
    """The loss of the FSDP continuation on 3 ranks follows the DeepSpeed curve. Not
    bit-exact: 3 ranks draw other batches and sum in another order. Tolerance: each
    continued step's loss within 25% of the DeepSpeed run's at that step — a restart
    from the initial weights would be back near ln(256) = 5.5, far outside."""
    fsdp_ck = tmp_path / "as-fsdp"
    convert_ok(_step(runs["ds3"], EVERY), "--to", "fsdp", "--out", fsdp_ck)
    resumed = _resume(tmp_path, "fsdp-3", FSDP, fsdp_ck, nproc=3)
    ours, theirs = _losses(resumed), _losses(runs["ds3"])
    assert sorted(s for s in ours if s > EVERY) == list(range(EVERY + 1, STEPS + 1))
    for step in range(EVERY + 1, STEPS + 1):
        assert math.isfinite(ours[step])
        assert abs(ours[step] - theirs[step]) <= 0.25 * theirs[step], (step, ours, theirs)
    assert (resumed / "DONE").is_file()


def _portable(step_dir: Path) -> Any:
    from shardctl.train.portable.state import read_state

    return read_state(step_dir, json.loads((step_dir / "manifest.json").read_text()))


def _assert_same_state(a: Any, b: Any) -> None:
    from shardctl.train.portable.state import materialize

    assert a.groups == b.groups and a.steps == b.steps
    for name in a.names:
        assert torch.equal(materialize(a.master[name]), materialize(b.master[name])), name
        for kind in ("exp_avg", "exp_avg_sq"):
            x, y = a.moments[kind][name], b.moments[kind][name]
            assert torch.equal(materialize(x), materialize(y)), (name, kind)


def test_zero_1_and_2_sources_convert_losslessly(tmp_path: Path) -> None:
    """A ZeRO-2 source. ZeRO-1 and ZeRO-2 are one DeepSpeed optimizer class with one
    checkpoint layout (the optimizer state partitioned, the module state whole), read
    by one path of the converter: one of them stands for both (ZeRO-1 sources are
    consolidated in test_consolidate_dist.py)."""
    zero = 2
    run = tmp_path / f"ds{zero}"
    strategy = {**DS, "sharding": None, "zero_stage": zero}
    train_ok(_spec(tmp_path, f"ds{zero}", strategy, steps=EVERY))
    src = _step(run, EVERY)
    assert json.loads((src / "manifest.json").read_text())["zero_stage"] == zero
    convert_ok(src, "--to", "fsdp", "--out", tmp_path / "f")
    convert_ok(tmp_path / "f", "--to", "deepspeed", "--world-size", "3",
               "--zero-stage", str(zero), "--out", tmp_path / "d")  # fmt: skip
    source = _portable(src)
    _assert_same_state(source, _portable(tmp_path / "f"))
    _assert_same_state(source, _portable(tmp_path / "d"))
    # The converted checkpoints consolidate to exactly the source's weights.
    weights = final_weights(src, tmp_path / "m0")
    assert_bit_equal(weights, final_weights(tmp_path / "f", tmp_path / "m1"))
    assert_bit_equal(weights, final_weights(tmp_path / "d", tmp_path / "m2"))


# --------------------------------------------------------------------- bad input


def test_bad_input_is_refused_with_the_reason(runs, tmp_path: Path) -> None:
    src = _step(runs["ds3"], EVERY)
    cases: list[tuple[list[str], str]] = []
    # A save that never finished.
    torn = tmp_path / "checkpoints" / "step-00000005.tmp"
    shutil.copytree(src, torn)
    (torn / "manifest.json").unlink()
    cases.append(([str(torn), "--to", "fsdp"], "is incomplete"))
    # A corrupt file: same size, other bytes (found by the sha256 check, on by default).
    bad = tmp_path / "corrupt" / "step-00000005"
    shutil.copytree(src, bad)
    victim = next((bad / "deepspeed").glob("*optim_states.pt"))
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    cases.append(([str(bad), "--to", "fsdp"], "failed verification against its manifest"))
    # A truncated file: caught by the size check, always.
    short = tmp_path / "short" / "step-00000005"
    shutil.copytree(src, short)
    victim = next((short / "deepspeed").glob("*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:-10])
    cases.append(([str(short), "--to", "fsdp"], "damaged"))
    # Tensor-parallel shards (a second model-parallel rank's files).
    tp = tmp_path / "tp" / "step-00000005"
    shutil.copytree(src, tp)
    for f in list((tp / "deepspeed").glob("*mp_rank_00*")):
        shutil.copy(f, f.with_name(f.name.replace("mp_rank_00", "mp_rank_01")))
    cases.append(([str(tp), "--to", "fsdp"], "tensor/model-parallel"))
    # The same backend, nothing to change.
    cases.append(([str(src), "--to", "deepspeed", "--world-size", "2"], "already a DeepSpeed"))
    cases.append(([str(_step(runs["fsdp"], EVERY)), "--to", "fsdp"], "already an FSDP"))
    # Not a checkpoint at all.
    (tmp_path / "empty").mkdir()
    cases.append(([str(tmp_path / "empty"), "--to", "fsdp"], "not a checkpoint"))
    for i, (args, message) in enumerate(cases):
        res = convert(*args, "--out", tmp_path / f"out-{i}")
        assert res.returncode != 0, args
        assert message in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr, res.stderr
        assert not (tmp_path / f"out-{i}").exists()
        assert not (tmp_path / f"out-{i}.tmp").exists()
    # The file and both digests are named; --no-verify skips the sha256 check (this
    # flipped byte is in the zip's own records, so the reader then names the file).
    import hashlib

    victim = next((bad / "deepspeed").glob("*optim_states.pt"))
    found = hashlib.sha256(victim.read_bytes()).hexdigest()
    res = convert(bad, "--to", "fsdp", "--out", tmp_path / "checked")
    assert f"{victim.name}: sha256 {found}, manifest expects" in res.stderr, res.stderr
    res = convert(bad, "--to", "fsdp", "--no-verify", "--out", tmp_path / "unchecked")
    assert "failed verification" not in res.stderr and victim.name in res.stderr, res.stderr
    # A flipped byte inside the tensor data parses fine: only the sha256 finds it (the
    # conversion used to succeed and certify the damage in a fresh manifest).
    quiet = tmp_path / "quiet" / "step-00000005"
    shutil.copytree(src, quiet)
    victim = next((quiet / "deepspeed").glob("*optim_states.pt"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    res = convert(quiet, "--to", "fsdp", "--out", tmp_path / "quiet-out")
    assert res.returncode == 1 and f"{victim.name}: sha256" in res.stderr, res.stderr
    assert not (tmp_path / "quiet-out").exists()
    convert_ok(quiet, "--to", "fsdp", "--no-verify", "--out", tmp_path / "quiet-out")
    # An existing --out is never replaced.
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep me")
    res = convert(src, "--to", "fsdp", "--out", tmp_path / "taken")
    assert res.returncode != 0 and "already exists" in res.stderr
    assert (tmp_path / "taken" / "mine.txt").read_text() == "keep me"


def test_auto_resume_of_a_foreign_checkpoint_says_how_to_convert(runs, tmp_path: Path) -> None:
    spec = _spec(tmp_path, "ds-over-fsdp", DS)
    shutil.copytree(_step(runs["fsdp"], EVERY), _step(tmp_path / "ds-over-fsdp", EVERY))
    res = train(spec)
    assert res.returncode != 0
    assert "written by backend 'fsdp'" in res.stdout
    assert "shardctl convert" in res.stdout and "--to deepspeed --out" in res.stdout


def test_precision_is_explicit(runs, tmp_path: Path) -> None:
    """fp32 → bf16-pure only when asked (it loses bits); bf16 masters going to
    DeepSpeed are upcast to fp32 and the command says so."""
    src = _step(runs["ds3"], EVERY)
    refused = convert(src, "--to", "fsdp", "--precision", "bf16-pure", "--out", tmp_path / "a")
    assert refused.returncode == 2 and "--allow-downcast" in refused.stderr
    assert not (tmp_path / "a").exists()
    out = convert_ok(src, "--to", "fsdp", "--precision", "bf16-pure", "--allow-downcast",
                     "--out", tmp_path / "pure")  # fmt: skip
    assert "rounded to bf16" in out
    pure = _portable(tmp_path / "pure")
    assert pure.master_dtype == "bfloat16"
    assert json.loads((tmp_path / "pure" / "manifest.json").read_text())["precision"] == (
        "bf16-pure"
    )
    out = convert_ok(tmp_path / "pure", "--to", "deepspeed", "--world-size", "2",
                     "--out", tmp_path / "ds")  # fmt: skip
    assert "upcast to fp32" in out
    back = _portable(tmp_path / "ds")
    from shardctl.train.portable.state import materialize

    for name in pure.names:  # bf16 → fp32 is exact
        assert torch.equal(
            materialize(pure.master[name], "float32"), materialize(back.master[name])
        )
    # A bf16 engine names its files bf16_zero_pp_rank_*: the run that resumes looks for them.
    assert sorted((tmp_path / "ds" / "deepspeed").glob("bf16_zero_pp_rank_*_optim_states.pt"))
    bf16_ds = {"backend": "deepspeed", "sharding": "full_shard", "precision": "bf16-mixed"}
    resumed = _resume(tmp_path, "ds-bf16", bf16_ds, tmp_path / "ds")
    losses = _losses(resumed)
    assert sorted(losses) == list(range(EVERY + 1, STEPS + 1))
    assert all(math.isfinite(x) for x in losses.values())


def test_to_fsdp_needs_no_torch_and_hashes_while_writing(runs, tmp_path: Path) -> None:
    """The DeepSpeed → DCP path writes DCP's files itself (start-up is the cost that
    matters on small checkpoints); the manifest's sha256 is computed during the write
    and must be the files' own."""
    import hashlib

    code = (
        "import sys; from pathlib import Path; "
        "from shardctl.train.portable import convert_checkpoint; "
        "convert_checkpoint(Path(sys.argv[1]), 'fsdp', Path(sys.argv[2]), verify=False); "
        "print('torch' in sys.modules)"
    )
    out = tmp_path / "ck"
    res = subprocess.run(
        [sys.executable, "-c", code, str(_step(runs["ds3"], EVERY)), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "False"
    manifest = json.loads((out / "manifest.json").read_text())
    for rel, entry in manifest["files"].items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == entry["sha256"], rel


def test_zero3_sub_groups_and_two_param_groups_convert(tmp_path: Path) -> None:
    """ZeRO-3 cuts every param group into sub-groups of `sub_group_size` elements (by
    default 1e9: any model above a billion parameters). The conversion must put every
    parameter back in its own param group, with DeepSpeed's own view of its fp32
    master and Adam moments."""
    import warnings

    from helpers.ckpt_run import run, torchrun_argv
    from helpers.consolidate_util import MAKE_CKPT
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    moments = tmp_path / "moments.pt"
    args = ["--backend", "deepspeed", "--zero-stage", "3", "--sub-group-size", "3000"]
    args += ["--steps", "2", "--no-reference", "--moments", str(moments), "--out", str(step)]
    made = run(torchrun_argv(2, MAKE_CKPT, *args), timeout=300)
    assert made.returncode == 0, made.stdout[-4000:]
    convert_ok(step, "--to", "fsdp", "--out", tmp_path / "fsdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(tmp_path / "fsdp" / "dcp"), str(tmp_path / "flat.pt"))
    sd = torch.load(tmp_path / "flat.pt", weights_only=False)
    expected = torch.load(moments, weights_only=False)
    groups = sd["optim"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert set(groups[0]["params"]) == {n for n, t in expected.items() if t["fp32"].dim() > 1}
    assert set(groups[1]["params"]) == {n for n, t in expected.items() if t["fp32"].dim() <= 1}
    for name, ds in expected.items():
        assert torch.equal(sd["model"][name], ds["fp32"]), name
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["optim"]["state"][name][kind], ds[kind]), (name, kind)
        assert sd["optim"]["state"][name]["step"].item() == 2.0
