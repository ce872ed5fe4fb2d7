"""Consolidation of real 2-rank checkpoints: FSDP2 (DCP) and DeepSpeed ZeRO 1/2/3.

Each case trains a tiny Llama for 3 steps on 2 CPU ranks (torchrun, gloo), saves a
checkpoint in the shardctl layout and the logits of the trained model on a probe
batch; consolidation must give a folder `from_pretrained` loads with no missing or
unexpected keys and — in fp32 — bit-identical logits. DeepSpeed cases are also
compared tensor by tensor with DeepSpeed's own zero_to_fp32 reconstruction.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.consolidate_util import torchrun_ckpt
from safetensors.torch import load_file
from shardctl.train.consolidate import consolidate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CASES = {
    # id: (maker args, logits must be bit-identical)
    "fsdp-fp32-tied": (["--backend", "fsdp", "--tied"], True),
    "zero1-fp32": (["--backend", "deepspeed", "--zero-stage", "1"], True),
    "zero2-bf16-tied": (
        ["--backend", "deepspeed", "--zero-stage", "2", "--precision", "bf16", "--tied"],
        False,
    ),
    "zero3-fp32-tied": (["--backend", "deepspeed", "--zero-stage", "3", "--tied"], True),
    "zero0-fp32-tied": (["--backend", "deepspeed", "--zero-stage", "0", "--tied"], True),
    "zero0-bf16": (["--backend", "deepspeed", "--zero-stage", "0", "--precision", "bf16"], False),
}


def _load_dir(out: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        merged.update(load_file(f))
    return merged


@pytest.mark.parametrize("case", list(CASES))
def test_consolidated_model_loads_and_gives_the_trained_logits(case, tmp_path):
    from transformers import AutoModelForCausalLM

    args, exact = CASES[case]
    step = tmp_path / "run" / "checkpoints" / "step-00000003"
    torchrun_ckpt(step, *args)
    ref = torch.load(step.parent / "reference.pt")

    result = consolidate(tmp_path / "run", tmp_path / "run" / "model", max_shard_bytes=60_000)
    assert result.checkpoint == step
    assert (tmp_path / "run" / "model" / "model.safetensors.index.json").exists()
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "model", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.dtype == torch.float32
    with torch.no_grad():
        logits = model.eval()(input_ids=ref["input_ids"]).logits
    if exact:
        assert torch.equal(logits, ref["logits"])
    else:
        # The saved model computed in bf16; the consolidated fp32 masters in fp32. The
        # difference is bf16 rounding of weights and activations (~2^-8 relative).
        assert torch.allclose(logits, ref["logits"], atol=5e-2, rtol=0)

    consolidated = _load_dir(tmp_path / "run" / "model")
    if args[1] == "deepspeed" and args[3] != "0":
        # DeepSpeed's own reconstruction of the fp32 masters, for comparison (its
        # zero_to_fp32 does not read stage-0 checkpoints).
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        theirs = get_fp32_state_dict_from_zero_checkpoint(str(step), tag="deepspeed")
        theirs = {k: v.contiguous() for k, v in theirs.items()}
        if "--tied" in args:
            theirs.pop("lm_head.weight")
        assert consolidated.keys() == theirs.keys()
        for name, tensor in theirs.items():
            assert torch.equal(consolidated[name], tensor.float()), name

    bf16 = consolidate(step, tmp_path / "bf16", dtype="bf16")
    assert bf16.total_bytes * 2 == result.total_bytes
    halves = _load_dir(tmp_path / "bf16")
    assert all(torch.equal(halves[k], v.to(torch.bfloat16)) for k, v in consolidated.items())


# ---------------------------------------------------------- the real training loop


def _assert_on_finish_model(run: Path, stdout: str, theirs: dict[str, torch.Tensor]) -> None:
    """The model consolidate_on_finish wrote loads with transformers and equals
    `theirs`: the final checkpoint read back by its own framework's tools."""
    from transformers import AutoModelForCausalLM

    assert f"consolidated model written to {run / 'model'}" in stdout
    model, info = AutoModelForCausalLM.from_pretrained(run / "model", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, theirs[name].float()), name


def test_consolidate_on_finish_of_the_real_loop_fsdp(tiny_run) -> None:
    """`python -m shardctl.train` with consolidate_on_finish (the shared tiny run: FSDP2,
    fp32, tied embeddings); DCP's own single-process load of the same checkpoint into
    a fresh model is the reference."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    step = tiny_run.final_step
    manifest = json.loads((step / "manifest.json").read_text())
    fresh = LlamaForCausalLM(LlamaConfig(**manifest["model"]["hf_config"]))
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(step / "dcp"), no_dist=True)
    _assert_on_finish_model(tiny_run.run_dir, tiny_run.stdout, state["model"])


def test_consolidate_on_finish_of_the_real_loop_deepspeed(tmp_path: Path) -> None:
    """The same with DeepSpeed ZeRO-3 bf16-mixed; DeepSpeed's zero_to_fp32 is the
    reference."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from helpers.train_run import tiny_spec, train_ok

    spec = tiny_spec(
        tmp_path,
        "run",
        strategy={"backend": "deepspeed", "zero_stage": 3, "precision": "bf16-mixed"},
        train={"model": {"llama": {"tie_word_embeddings": True}}},
        checkpoint={"consolidate_on_finish": True},
    )
    res = train_ok(spec)
    step = tmp_path / "run" / "checkpoints" / "step-00000004"
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(step), tag="deepspeed")
    _assert_on_finish_model(tmp_path / "run", res.stdout, theirs)


# -------------------------------------------------------------------------- memory


# ru_maxrss counts the memory of the process a child was forked (or vforked) from until
# its exec; a small interpreter in between keeps this big pytest process out of it.
_SPAWN = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL); "
    "_, status, usage = os.wait4(p.pid, 0); "
    "print(usage.ru_maxrss * 1024 if os.waitstatus_to_exitcode(status) == 0 else -1)"
)


def _peak_rss(cmd: list[str]) -> int:
    """ru_maxrss (bytes) of one child process run to completion."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SPAWN, *cmd], capture_output=True, text=True)
    assert out.returncode == 0 and int(out.stdout) > 0, out.stderr[-3000:]
    return int(out.stdout)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_peak_memory_does_not_grow_with_the_model(tmp_path, dtype):
    """10 tensors of 64 MiB (640 MiB) against one of 1 KiB: the peak RSS of the
    consolidating process grows by far less than one tensor, not by the model."""
    import sys

    from helpers.consolidate_util import make_dcp_step

    largest = 64 * 2**20
    big = {f"w{i}": torch.full((largest // 4,), float(i)) for i in range(10)}
    small = {"w0": torch.ones(256)}
    shardctl = str(Path(sys.executable).parent / "shardctl")
    peaks = {}
    for name, sd in (("small", small), ("big", big)):
        step = make_dcp_step(tmp_path / name / "checkpoints", 1, sd, hf_config=None)
        del sd
        out = tmp_path / name / "model"
        peaks[name] = _peak_rss(
            [shardctl, "consolidate", str(step), "--out", str(out), "--dtype", dtype,
             "--no-progress", "--max-shard-size", "200MiB"]
        )  # fmt: skip
    del big
    assert peaks["big"] - peaks["small"] < largest, peaks
    written = _load_dir(tmp_path / "big" / "model")
    assert len(written) == 10 and float(written["w7"][123]) == 7.0
