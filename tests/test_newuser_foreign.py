"""Programs nobody on the project wrote, on both sides of shardctl: a ten-line script
that saves with `torch.distributed.checkpoint.save` in one process (no process group,
no shardctl) goes through `checkpoints`, `consolidate` and `convert --to deepspeed`,
and DeepSpeed's own `zero_to_fp32.py`, run as a program from the folder `convert`
wrote, gives back the weights the script itself saved with `torch.save`."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.ckpt_run import run
from safetensors.torch import load_file
from shardctl.orchestrator.cli import cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The user's script: a few AdamW steps, then one DCP save of model and optimizer, and
# the reference weights through plain torch.save (no shardctl code computes them).
PLAIN_DCP_SCRIPT = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

out = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    model(torch.randn(5, 8)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()
model_sd, optim_sd = get_state_dict(model, optim)
dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out + "/ckpt")
torch.save(model.state_dict(), out + "/reference.pt")
"""


def _assert_same(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _cli(*args: str) -> str:
    res = CliRunner().invoke(cli, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def test_a_plain_dcp_save_consolidates_and_deepspeeds_script_reads_its_conversion(
    tmp_path: Path,
) -> None:
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent(PLAIN_DCP_SCRIPT))
    res = run([sys.executable, str(script), str(tmp_path)], timeout=300)
    assert res.returncode == 0, res.stdout[-4000:]
    reference = torch.load(tmp_path / "reference.pt")
    ckpt = tmp_path / "ckpt"

    listing = _cli("checkpoints", str(ckpt))
    assert "complete" in listing and "dcp" in listing, listing

    _cli("consolidate", str(ckpt), "--out", str(tmp_path / "model"), "--no-progress")
    _assert_same(reference, load_file(tmp_path / "model" / "model.safetensors"))

    ds = tmp_path / "ds"
    _cli("convert", str(ckpt), "--to", "deepspeed", "--world-size", "2", "--out", str(ds))
    # DeepSpeed's recovery script, as a user runs it: from the checkpoint folder.
    res = run(
        [sys.executable, str(ds / "zero_to_fp32.py"), str(ds), str(tmp_path / "fp32"),
         "--safe_serialization"],
        timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:]
    _assert_same(reference, load_file(tmp_path / "fp32" / "model.safetensors"))
