"""FSDP2: `fully_shard` per transformer block plus the root; state I/O through DCP.

Sharding → how FSDP2 is applied (one table, `_LAYOUT`):

| sharding        | device mesh                     | reshard_after_forward |
|-----------------|---------------------------------|-----------------------|
| full_shard      | 1-D (world)                     | True  (ZeRO-3)        |
| shard_grad_op   | 1-D (world)                     | False (ZeRO-2)        |
| hybrid_shard    | 2-D (nodes, procs_per_node)     | True  (shard in a node, replicate across) |
| no_shard        | 2-D (world, 1)                  | False (pure replication = DDP) |

`no_shard` is FSDP2's own replication (HSDP with a shard group of one) rather than
DDP: the same parameter type (DTensor), the same DCP checkpoint format and the same
code path as the other three, so a checkpoint moves between shardings freely.

Precision (DESIGN.md's modes):
- `bf16-mixed`: parameters are upcast to fp32 *before* sharding (fp32 masters and
  optimizer state even when the model was loaded in bf16), compute in bf16
  (`param_dtype`), gradients reduced in fp32 (`reduce_dtype`). This is what
  DeepSpeed's bf16 mode does, so the two backends train alike.
- `bf16-pure`: parameters, gradients, optimizer state and reductions all bf16.
- `fp32`: no policy. `fp16-mixed` (CUDA only): fp16 compute, fp32 masters and
  reductions, with a gradient scaler.

Wrap classes: `strategy.wrap: auto` takes the model's `_no_split_modules` (transformers
names its decoder-layer class there, e.g. `LlamaDecoderLayer`); otherwise the children
of the model's first `ModuleList`. A list of class names overrides that.
Activation checkpointing uses the composable `checkpoint()` on each block, which
keeps parameter names unchanged (checkpoints stay plain-FQN).

State I/O (`DcpStateIO`): model and optimizer go into one DCP folder `dcp/` of the
step folder (top-level keys "model" and "optim"), through the `ModelState` and
`OptimizerState` views, whose keys are plain parameter FQNs. DCP reshards on load,
so an FSDP checkpoint resumes on any world size. Async save stages the state into
CPU memory and lets DCP write from a background thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardctl.orchestrator.errors import PermanentError
from shardctl.orchestrator.spec import JobSpec

from ..distributed import DistEnv
from ..model import logits_of
from ..optim import build_optimizer, set_lr
from . import strategy_fields
from .base import SaveFuture, Stateful

DCP_DIR = "dcp"

# sharding → (mesh kind, reshard_after_forward)
_LAYOUT: dict[str, tuple[str, bool]] = {
    "full_shard": ("shard", True),
    "shard_grad_op": ("shard", False),
    "hybrid_shard": ("hybrid", True),
    "no_shard": ("replicate", False),
}


def wrap_class_names(model: Any, wrap: str | list[str]) -> list[str]:
    """The block class names that become one FSDP unit each."""
    import torch

    present = {type(m).__name__ for m in model.modules()}
    if wrap != "auto":
        missing = [n for n in wrap if n not in present]
        if missing:
            raise PermanentError(
                f"strategy.wrap names {missing} but the model has no module of that class; "
                f"classes in this model: {', '.join(sorted(present))}"
            )
        return list(wrap)
    names = [n for n in (getattr(model, "_no_split_modules", None) or []) if n in present]
    if names:
        return names
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > 0:
            return sorted({type(c).__name__ for c in m})
    raise PermanentError(
        "strategy.wrap 'auto' found no transformer blocks (no _no_split_modules and no "
        "ModuleList); give the block class names in strategy.wrap"
    )


def _mesh(spec: JobSpec, env: DistEnv, kind: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    device_type = env.device.type
    if kind == "shard":
        return init_device_mesh(device_type, (env.world_size,), mesh_dim_names=("shard",))
    if kind == "hybrid":
        shape = (spec.resources.nodes, env.world_size // spec.resources.nodes)
    else:
        shape = (env.world_size, 1)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def _policies(spec: JobSpec) -> tuple[Any, Any]:
    """(dtype the parameters are stored in, MixedPrecisionPolicy or None)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    precision = spec.strategy.precision
    if precision == "bf16-mixed":
        return torch.float32, MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if precision == "fp16-mixed":
        return torch.float32, MixedPrecisionPolicy(
            param_dtype=torch.float16, reduce_dtype=torch.float32
        )
    if precision == "bf16-pure":
        return torch.bfloat16, None
    return torch.float32, None


def shard_model(model: Any, spec: JobSpec, env: DistEnv) -> Any:
    """Apply activation checkpointing and FSDP2 to `model` in place; returns it."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    s = spec.strategy
    param_dtype, mp = _policies(spec)
    # Upcast (or downcast) before sharding: the sharded parameters are the masters.
    model.to(dtype=param_dtype)
    mesh_kind, reshard = _LAYOUT[s.sharding or "full_shard"]
    kwargs: dict[str, Any] = {"mesh": _mesh(spec, env, mesh_kind)}
    if mp is not None:
        kwargs["mp_policy"] = mp
    if s.offload == "params":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    names = set(wrap_class_names(model, s.wrap))
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if s.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in blocks:
            checkpoint(block)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root holds what no block does (embeddings, final norm, head); its parameters
    # are needed right after forward for the loss, so it is never resharded early.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if s.forward_prefetch:
        for this, nxt in itertools.pairwise(blocks):
            this.set_modules_to_forward_prefetch([nxt])
    return model


class FsdpBackend:
    """One training step's pieces for FSDP2; the loop calls them in order."""

    name = "fsdp"

    def __init__(self, model: Any, spec: JobSpec, env: DistEnv) -> None:
        import torch

        self.spec = spec
        self.model = shard_model(model, spec, env)
        self.optimizer = build_optimizer(self.model, spec.train)
        self.clip = spec.train.clip
        # Gradients are reduced on every micro-step only where they stay sharded
        # anyway (full/hybrid shard); the others accumulate locally like DDP's no_sync.
        self.sync_every_micro = spec.strategy.sharding in ("full_shard", "hybrid_shard")
        self.scaler = (
            torch.amp.GradScaler(env.device.type)
            if spec.strategy.precision == "fp16-mixed"
            else None
        )
        self.device = env.device
        self.state_io = DcpStateIO(
            {"model": ModelState(self.model), "optim": OptimizerState(self.model, self.optimizer)},
            spec.strategy,
        )

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def micro_step(self, batch: Any, last: bool, scale: float) -> Any:
        """Forward + backward of one micro-batch; returns the unscaled loss (detached)."""
        import torch.nn.functional as F

        if not self.sync_every_micro:
            self.model.set_requires_gradient_sync(last)
        batch = batch.to(self.device, non_blocking=True)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = logits_of(self.model(input_ids=inputs))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
        scaled = loss * scale
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.detach()

    def step(self) -> float:
        """Clip, optimizer step, zero grads; returns the global gradient norm."""
        import torch

        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        # The norm of sharded (DTensor) gradients is a partial value; `full_tensor()`
        # reduces it once, and clipping with that replicated norm needs no further
        # collective. (`clip_grad_norm_` would reduce it inside, and reading the norm
        # it returns afterwards would cost a second all-reduce every step.)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if self.clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip, norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)


# ---------------------------------------------------------------------- state I/O


class ModelState:
    """Stateful view of an (FSDP2-sharded) model for DCP.

    `state_dict()` returns the sharded state dict with the plain, unwrapped FQNs
    (`model.layers.0.self_attn.q_proj.weight`), so DCP can reshard it on load.
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state_dict)


class OptimizerState:
    """Stateful view of the optimizer of an (FSDP2-sharded) model for DCP; state is
    keyed by parameter FQN, so it reshards like the model."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class DcpStateIO:
    """`StateIO` of FSDP: every given `Stateful` into one DCP folder, `dcp/`.

    `states` maps top-level DCP keys to stateful views ("model", "optim"); any
    `Stateful` whose state dict DCP can shard works, which is also how the
    checkpoint tests drive it without an FSDP model.
    """

    backend = "fsdp"
    sync_only_reason = None

    def __init__(self, states: Mapping[str, Stateful], strategy: Any) -> None:
        self.states = dict(states)
        self.strategy = strategy
        self._stager: Any = None

    def manifest_fields(self) -> dict[str, Any]:
        return {"backend": self.backend, **strategy_fields(self.strategy)}

    def versions(self) -> dict[str, str | None]:
        return {}

    def _writer(self, step_dir: Path) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.FileSystemWriter(str(step_dir / DCP_DIR), sync_files=True)

    def save(self, step_dir: Path, group: Any) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(
            self.states,
            storage_writer=self._writer(step_dir),
            process_group=group,
            no_dist=group is None,
        )

    def save_async(self, step_dir: Path, group: Any) -> SaveFuture:
        import torch.distributed.checkpoint as dcp

        if self._stager is None:
            self._stager = _blocking_stager()
        result = dcp.async_save(
            self.states,
            storage_writer=self._writer(step_dir),
            process_group=group,
            async_stager=self._stager,
            no_dist=group is None,
        )
        # torch returns a Future, or an AsyncSaveResponse holding one.
        return getattr(result, "upload_completion", result)

    def check_resumable(self, step_dir: Path, manifest: dict[str, Any], world_size: int) -> None:
        return None  # DCP reshards on load: any world size will do

    def load(self, step_dir: Path, manifest: dict[str, Any], group: Any) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(
            self.states,
            storage_reader=dcp.FileSystemReader(str(step_dir / DCP_DIR)),
            process_group=group,
            no_dist=group is None,
        )

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _blocking_stager() -> Any:
    """What stages an async save: a copy into CPU memory, made before `save_async`
    returns (training then changes the weights while the copy is written).

    torch's `BlockingAsyncStager` (torch ≥ 2.4) copies tensor by tensor. Not the newer
    `DefaultStager`: it deep-copies every DTensor's attributes, and torch 2.11's copy
    fails on the device mesh inside (`KeyError: <class 'type'>`: measured on a CUDA
    GPU, benchmarks/README.md); torch 2.6-2.7 do not have it. In a process that uses
    CUDA the copies go to pinned buffers kept between saves (a fast device-to-host
    copy, at the cost of one checkpoint's host memory); on CPU they are made anew.
    """
    import torch
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager(cache_staged_state_dict=torch.cuda.is_initialized())
