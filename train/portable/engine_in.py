"""Load a `PortableState` into a live DeepSpeed ZeRO 1/2/3 engine, at any world size.

DeepSpeed's own `load_checkpoint` reads only partitions written by the same number
of ranks. Here every rank reads each full tensor (master, exp_avg, exp_avg_sq) from
the source, one at a time, and keeps the part its partition owns — where that part
lies is the engine's own bookkeeping:

- ZeRO 1/2: each optimizer group is one flat fp32 partition per rank; a parameter's
  `_hp_mapping` says which elements of it (`lp_fragment_address`) sit where in this
  rank's partition (`hp_fragment_address`). The module's parameters are whole on
  every rank and get the full weights.
- ZeRO 3: every parameter is padded to `world × p` elements and rank r owns elements
  `[r·p, (r+1)·p)`; `grad_position` says where they sit in this rank's flat fp32
  sub-group, and `param.ds_tensor` is the module's own (low-precision) partition.

Adam's state (created here: DeepSpeed creates it lazily at the first step) gets the
moments in the same places and each group's step count. The padding stays zero, as
in a DeepSpeed-trained run (no gradient ever reaches it).
"""

from __future__ import annotations

from typing import Any

from ...orchestrator.errors import CheckpointError
from .state import MOMENTS, PortableState, materialize


def load_into_engine(engine: Any, state: PortableState) -> None:
    """Set every trainable parameter's master weights, moments and step (all ranks)."""
    named = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    _check_names(set(named), set(state.names))
    import torch

    stage = engine.zero_optimization_stage()
    if stage in (1, 2):
        with torch.no_grad():
            _load_zero12(engine.optimizer, named, state)
    elif stage == 3:
        with torch.no_grad():
            _load_zero3(engine.optimizer, named, state)
    else:
        raise CheckpointError(
            f"DeepSpeed ZeRO stage {stage}: only stages 1, 2 and 3 load a converted or "
            "resharded checkpoint"
        )


def _check_names(model: set[str], saved: set[str]) -> None:
    if model == saved:
        return
    missing, extra = sorted(model - saved), sorted(saved - model)
    raise CheckpointError(
        "the checkpoint does not match this model: "
        + "; ".join(
            part
            for part in (
                f"{len(missing)} parameter(s) not in the checkpoint ({', '.join(missing[:3])})"
                if missing
                else "",
                f"{len(extra)} checkpoint tensor(s) not in the model ({', '.join(extra[:3])})"
                if extra
                else "",
            )
            if part
        )
    )


def _adam_state(optimizer: Any, flat: Any, step: float) -> dict[str, Any]:
    import torch

    optimizer.state[flat] = {
        "step": torch.tensor(step, dtype=torch.float32),
        **{k: torch.zeros_like(flat) for k in MOMENTS},
    }
    return optimizer.state[flat]


def _load_zero12(opt: Any, named: dict[str, Any], state: PortableState) -> None:
    names = {id(p): n for n, p in named.items()}
    for g, params in enumerate(opt.bit16_groups):
        flat = opt.single_partition_of_fp32_groups[g]
        first = names[id(params[0])]
        adam = _adam_state(opt.optimizer, flat, state.steps[first])
        targets = {"master": flat, **{k: adam[k] for k in MOMENTS}}
        for p in params:
            name = names[id(p)]
            full = materialize(state.master[name], "float32")
            p.data.copy_(full.to(p.dtype))  # the module's whole copy (every rank)
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                continue  # none of this parameter lies in this rank's partition
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            for kind, target in targets.items():
                moment = state.moments.get(kind, {}).get(name)
                value = full if moment is None else materialize(moment, "float32")
                piece = value.reshape(-1).narrow(0, lp.start, lp.numel)
                target.narrow(0, hp.start, hp.numel).copy_(piece)
    opt._hp_optimizer_states_linked = False  # re-link the fragments to the new state


def _load_zero3(opt: Any, named: dict[str, Any], state: PortableState) -> None:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank(group=opt.dp_process_group)
    world = dist.get_world_size(group=opt.dp_process_group)
    adam_of: dict[int, dict[str, Any]] = {}
    for name, p in named.items():
        group, offset, count = opt.grad_position[opt.get_param_id(p)]
        flat = opt.fp32_partitioned_groups_flat[group]
        if group not in adam_of:
            adam_of[group] = _adam_state(opt.optimizer, flat, state.steps[name])
        part = p.ds_tensor.ds_numel
        if count != part or part * world < p.ds_numel:
            raise CheckpointError(
                f"{name}: unexpected ZeRO-3 partition ({count} elements, {part} per rank)"
            )
        for kind in ("master", *MOMENTS):
            src = state.master[name] if kind == "master" else state.moments[kind][name]
            padded = torch.zeros(part * world, dtype=torch.float32)
            padded[: p.ds_numel] = materialize(src, "float32").reshape(-1)
            mine = padded.narrow(0, rank * part, part)
            target = flat if kind == "master" else adam_of[group][kind]
            target.narrow(0, offset, count).copy_(mine)
            if kind == "master":
                p.ds_tensor.data.copy_(mine.to(p.ds_tensor.dtype))
