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

DeepSpeed's autotuner, which shardctl never runs, imports mlflow when DeepSpeed is
imported if mlflow is installed: half of DeepSpeed's import, about 3.5 s of CPU on
every rank (measured on a 2-core AMD EPYC). The backend imports DeepSpeed with mlflow
hidden for that one import (`import_deepspeed`); the mlflow tracker, or anything
else, imports mlflow normally afterwards.

State I/O (`DeepSpeedStateIO`): `engine.save_checkpoint(save_dir=<step dir>,
tag="deepspeed")` writes `deepspeed/` (model, optimizer, and the lr scheduler if one
was given to `deepspeed.initialize`), synchronously — DeepSpeed has no staged save
here, so `checkpoint.async` falls back to synchronous saves. A ZeRO 1-3 checkpoint of
another world size, which `engine.load_checkpoint` refuses, is loaded through
`train/portable` instead: every rank reads the full per-parameter weights and Adam
state and keeps its own partition (logged as "resharding ...").
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from pathlib import Path
from typing import Any

from shardctl.orchestrator.errors import CheckpointError
from shardctl.orchestrator.spec import JobSpec

from ..distributed import DistEnv
from ..manifest import package_version
from ..model import logits_of
from ..optim import build_optimizer, set_lr
from . import strategy_fields
from .base import SaveFuture

TAG = "deepspeed"
"""The sub-folder of a step folder DeepSpeed writes (its checkpoint `tag`)."""


def extensions_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardctl" / "torch_extensions"


class _HideMlflow(MetaPathFinder):
    """Makes `import mlflow` fail while it sits first on `sys.meta_path`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "mlflow" or name.startswith("mlflow."):
            raise ModuleNotFoundError(f"{name} is hidden while DeepSpeed is imported", name=name)


def import_deepspeed() -> None:
    """Import DeepSpeed without the mlflow import of its autotuner (module docstring).
    A no-op when DeepSpeed is imported already; mlflow imported already costs nothing."""
    if "deepspeed" in sys.modules:
        return
    hide = _HideMlflow()
    sys.meta_path.insert(0, hide)
    try:
        import deepspeed  # noqa: F401
    finally:
        sys.meta_path.remove(hide)


def _prepare_deepspeed(device_type: str) -> None:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    import_deepspeed()
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
        # The engine holds model and optimizer; it is saved and loaded whole.
        self.state_io = DeepSpeedStateIO(self.engine, spec.strategy)

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


# ---------------------------------------------------------------------- state I/O


class DeepSpeedStateIO:
    """`StateIO` of DeepSpeed: the engine's own checkpoint format under `deepspeed/`."""

    backend = "deepspeed"
    sync_only_reason = "engine.save_checkpoint writes synchronously"

    def __init__(self, engine: Any, strategy: Any) -> None:
        self.engine = engine
        self.strategy = strategy

    def _engine(self) -> Any:
        if self.engine is None:
            raise CheckpointError("strategy.backend deepspeed: no DeepSpeed engine to save or load")
        return self.engine

    def manifest_fields(self) -> dict[str, Any]:
        return {"backend": self.backend, **strategy_fields(self.strategy)}

    def versions(self) -> dict[str, str | None]:
        return {"deepspeed": package_version("deepspeed")}

    def save(self, step_dir: Path, group: Any) -> None:
        self._engine().save_checkpoint(save_dir=str(step_dir), tag=TAG)

    def save_async(self, step_dir: Path, group: Any) -> SaveFuture:
        raise CheckpointError(f"strategy.backend deepspeed: {self.sync_only_reason}")

    def check_resumable(self, step_dir: Path, manifest: dict[str, Any], world_size: int) -> None:
        # Any world size: another one is loaded through the portable path (`load`).
        return None

    def load(self, step_dir: Path, manifest: dict[str, Any], group: Any) -> None:
        import torch.distributed as dist

        saved_ws = int(manifest["world_size"])
        world = dist.get_world_size() if dist.is_initialized() else 1
        if saved_ws != world and manifest.get("zero_stage") != 0:
            self._load_resharded(step_dir, manifest, saved_ws, world)
            return
        load_path, _client = self._engine().load_checkpoint(
            str(step_dir),
            tag=TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if load_path is None:
            raise CheckpointError(f"{step_dir}: DeepSpeed found no checkpoint under {TAG}/")

    def _load_resharded(
        self, step_dir: Path, manifest: dict[str, Any], saved_ws: int, world: int
    ) -> None:
        """DeepSpeed's loader refuses partitions of another world size: every rank reads
        the full per-parameter state and keeps its own partition (train/portable)."""
        import logging

        from ..portable.engine_in import load_into_engine
        from ..portable.state import read_state

        log = logging.getLogger(__name__)
        if int(os.environ.get("RANK", "0") or 0) == 0:
            log.warning(
                "resharding DeepSpeed ZeRO-%s checkpoint %s from %d to %d ranks: every rank "
                "reads the full weights and Adam state and keeps its partition",
                manifest.get("zero_stage"),
                step_dir,
                saved_ws,
                world,
            )
        engine = self._engine()
        load_into_engine(engine, read_state(step_dir, manifest))
        _restore_engine_counters(engine, step_dir / TAG)

    def close(self) -> None:
        return None


def _restore_engine_counters(engine: Any, ds_dir: Path) -> None:
    """What DeepSpeed's loader restores beside the partitions: the engine's step and
    sample counters and the state of an lr scheduler given to `deepspeed.initialize`
    (read from the model-states file without loading its tensors)."""
    from ..consolidate.torchzip import load_refs

    files = sorted(ds_dir.glob("*model_states.pt"))
    if not files:
        raise CheckpointError(f"{ds_dir}: no *model_states.pt file")
    saved = load_refs(files[0], trusted=True)
    engine.global_steps = int(saved.get("global_steps") or 0)
    engine.global_samples = int(saved.get("global_samples") or 0)
    engine.skipped_steps = int(saved.get("skipped_steps") or 0)
    scheduler_state = saved.get("lr_scheduler")
    if engine.lr_scheduler is not None and scheduler_state is not None:
        engine.lr_scheduler.load_state_dict(scheduler_state)
