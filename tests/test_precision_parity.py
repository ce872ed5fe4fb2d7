"""FSDP2 bf16-mixed and DeepSpeed bf16 train the same tiny model alike.

Both keep fp32 master weights and optimizer state, compute in bf16 and reduce
gradients in fp32; the model is loaded in bf16 here, so FSDP2 must upcast it
before sharding to keep fp32 masters, as DeepSpeed does. What still differs is
bf16 rounding noise: the order of the gradient reductions and where each casts.
Over 10 steps (lr 3e-3) the two losses agree to about 2.5e-4 on this machine.

Tolerance 1.5e-3 absolute (loss ~5): six times that noise, and well below what
training with bf16 masters does to the loss in the same steps (~5.5e-3 — what
`bf16-pure` does on purpose, and what forgetting the fp32 upcast would do). The
test checks that too, as a control: a comparison that bf16 masters would also
pass would prove nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.train_run import metrics, tiny_spec, train_ok

pytestmark = pytest.mark.slow

TOLERANCE = 1.5e-3
STEPS = 10


def _losses(tmp: Path, name: str, strategy: dict) -> dict[int, float]:
    spec = tiny_spec(
        tmp,
        name,
        strategy=strategy,
        train={"steps": STEPS, "lr": 3e-3, "grad_accum": 2, "model": {"dtype": "bf16"}},
        checkpoint={"every_steps": STEPS},
    )
    train_ok(spec)
    return {r["step"]: r["loss"] for r in metrics(tmp / name)}


def test_fsdp_bf16_mixed_matches_deepspeed_bf16(tmp_path: Path) -> None:
    fsdp = _losses(
        tmp_path,
        "fsdp",
        {"backend": "fsdp", "sharding": "full_shard", "precision": "bf16-mixed"},
    )
    ds = _losses(
        tmp_path,
        "ds",
        {"backend": "deepspeed", "sharding": None, "zero_stage": 3, "precision": "bf16-mixed"},
    )
    pure = _losses(
        tmp_path,
        "pure",
        {"backend": "fsdp", "sharding": "full_shard", "precision": "bf16-pure"},
    )
    steps = list(range(1, STEPS + 1))
    assert sorted(fsdp) == sorted(ds) == sorted(pure) == steps
    mixed_vs_ds = max(abs(fsdp[s] - ds[s]) for s in steps)
    pure_vs_ds = max(abs(pure[s] - ds[s]) for s in steps)
    assert mixed_vs_ds <= TOLERANCE, f"fsdp {fsdp}\nds {ds}"
    # The control: bf16 masters are told apart by the same tolerance.
    assert pure_vs_ds > TOLERANCE, f"pure {pure}\nds {ds}"
    assert fsdp[STEPS] < fsdp[1] - 0.3 and ds[STEPS] < ds[1] - 0.3  # both really trained
