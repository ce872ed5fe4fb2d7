"""DeepSpeed ZeRO 0/1/2/3 through `deepspeed.initialize`.

The config is `shardctl.orchestrator.dsconfig.deepspeed_config(spec)` — exactly the
JSON rendered to `ds_config.json` — and the optimizer is a torch AdamW (DeepSpeed's
own fused/CPU Adam are compiled ops, 30–60 s each on a fresh machine). The learning
rate comes from the loop's own schedule, set on the engine's optimizer every step.

Micro-steps follow DeepSpeed's contract: `engine.backward(loss)` then
`engine.step()` after *every* micro-batch; the engine divides the loss by
`gradient_accumulation_steps`, and at the accumulation boundary it clips
(`gradient_clipping`), steps the optimizer and zeroes the gradients.

On CPU, DeepSpeed's communication layer JIT-compiles a shared-memory all-reduce op
when it starts (≈30 s on 2 cores). That op only serves DeepSpeed's inference
all-reduce; training collectives go through torch.distributed (gloo), so on CPU we
mark the op unavailable instead of compiling it. Any op DeepSpeed still compiles
lands in `TORCH_EXTENSIONS_DIR` (default: a shardctl folder in the user's cache), so
it is built once per machine, not once per run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardctl.orchestrator.spec import JobSpec

from .distributed import DistEnv
from .model import logits_of
from .optim import build_optimizer, set_lr


def extensions_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardctl" / "torch_extensions"


def _prepare_deepspeed(device_type: str) -> None:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    if device_type == "cpu":
        import deepspeed.ops

        # DeepSpeed documents this cache as the one place op availability is read.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class DeepSpeedBackend:
    """One training step's pieces for a DeepSpeed engine; the loop calls them in order."""

    name = "deepspeed"

    def __init__(self, model: Any, spec: JobSpec, env: DistEnv) -> None:
        import torch

        _prepare_deepspeed(env.device.type)
        import deepspeed
        from shardctl.orchestrator.dsconfig import deepspeed_config

        # Masters are built from fp32 weights even when the model was loaded in bf16;
        # DeepSpeed's bf16 mode then casts the module and keeps fp32 copies itself.
        model.to(dtype=torch.float32)
        if spec.strategy.activation_checkpointing:
            _enable_recompute(model)
        optimizer = build_optimizer(model, spec.train)
        self.config = deepspeed_config(spec)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.config, dist_init_required=False
        )
        self.device = env.device

    def app_state(self) -> dict[str, Any]:
        # The engine holds model and optimizer; the checkpoint manager saves it whole.
        return {}

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def micro_step(self, batch: Any, last: bool, scale: float) -> Any:
        """Forward, backward and `engine.step()` of one micro-batch; the unscaled loss."""
        import torch.nn.functional as F

        batch = batch.to(self.device, non_blocking=True)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = logits_of(self.engine(input_ids=inputs))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
        self.engine.backward(loss)  # DeepSpeed applies the 1/grad_accum scale itself
        self.engine.step()
        return loss.detach()

    def step(self) -> float:
        """The engine already stepped at the boundary; report its gradient norm."""
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return float("nan")
        return float(norm)


def _enable_recompute(model: Any) -> None:
    """Recompute activations per block: transformers' switch, else torch's composable one."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if callable(enable):
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    from torch.distributed._composable import checkpoint

    from .fsdp import wrap_class_names

    names = set(wrap_class_names(model, "auto"))
    for block in [m for m in model.modules() if type(m).__name__ in names]:
        checkpoint(block)
