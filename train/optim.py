"""AdamW and the learning-rate schedule.

The schedule is a pure function of the step (`lr_at`), set on the optimizer at
the top of every step, so it needs no saved state of its own: the restored step
number restores it. Warmup is linear from `lr / warmup_steps` to `lr`; then the
rate decays to `lr × min_lr_ratio` at the last step (cosine or linear), or stays
at `lr` (constant).
"""

from __future__ import annotations

import math
from typing import Any

from shardctl.orchestrator.spec import Train

BETAS = (0.9, 0.95)
EPS = 1e-8


def lr_at(step: int, t: Train) -> float:
    """Learning rate for optimizer step `step` (0-based) of `t.steps`."""
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return t.lr
    min_lr = t.lr * t.min_lr_ratio
    decay_steps = max(t.steps - t.warmup_steps - 1, 1)
    progress = min(max(step - t.warmup_steps, 0) / decay_steps, 1.0)
    if t.schedule == "linear":
        return t.lr - (t.lr - min_lr) * progress
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - min_lr)


def param_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only; norms and biases (1-D) are not decayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: Any, t: Train) -> Any:
    import torch

    # torch picks the implementation (per-tensor on CPU, foreach on CUDA); neither
    # needs a compiled op.
    return torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=lr_at(0, t), betas=BETAS, eps=EPS
    )


def set_lr(optimizer: Any, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
