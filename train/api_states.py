"""The state a user script hands to `shardctl.train.api`: stateful views and their I/O.

`shardctl.train.api` documents the public side; this module holds the pieces:

- `model_state(model, optimizer)`: the "model" / "optim" views the built-in FSDP
  backend checkpoints through DCP (`ModelState`, `OptimizerState`). They work for an
  FSDP2-sharded model (DTensor shards, resharded on load), a DDP-wrapped one and a
  plain `nn.Module` alike, and use the built-in loop's DCP keys, so `shardctl
  consolidate` reads a user script's checkpoint like one of its own.
- `deepspeed_state(engine)`: a DeepSpeed engine, saved in DeepSpeed's own format.
- `RankState`: the per-rank `Stateful` the `CheckpointManager` saves beside the
  sharded state (`train_state/rank-NNNNN.pt`): the step, this rank's RNG streams and
  the user's per-rank state (a data loader's position, ...).
- `state_io(states, strategy)`: the backend `StateIO` those states need.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardctl.orchestrator.errors import CheckpointError, UsageError

from .backends.base import Stateful

__all__ = ["DeepSpeedEngineState", "RankState", "Strategy", "deepspeed_state", "model_state"]


@dataclass(frozen=True)
class Strategy:
    """What the manifest records about how the state was trained (see
    `shardctl.train.backends.strategy_fields`); None where the script does not say."""

    sharding: str | None = None
    zero_stage: int | None = None
    precision: str | None = None


def model_state(model: Any, optimizer: Any = None) -> dict[str, Stateful]:
    """`{"model": ..., "optim": ...}` stateful views of `model` and its optimizer.

    Keys are plain parameter names (no FSDP or DDP prefixes), so the checkpoint loads
    back at any world size and into an unwrapped model. The optimizer view needs the
    model because torch optimizers key their state by parameter id, which means
    nothing in another process.
    """
    from .backends.fsdp import ModelState, OptimizerState

    states: dict[str, Stateful] = {"model": ModelState(model)}
    if optimizer is not None:
        states["optim"] = OptimizerState(model, optimizer)
    return states


class DeepSpeedEngineState:
    """A DeepSpeed engine in a `states` mapping (made by `deepspeed_state`). Not a
    `Stateful`: DeepSpeed writes and reads its own files (`engine.save_checkpoint`)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine


def deepspeed_state(engine: Any) -> dict[str, Any]:
    """`{"engine": ...}` for a DeepSpeed engine (model, optimizer, and the lr scheduler
    given to `deepspeed.initialize`). Other state goes in `per_rank=`: DeepSpeed's
    folder has no place for it."""
    return {"engine": DeepSpeedEngineState(engine)}


def _deepspeed_strategy(engine: Any, base: Strategy) -> Strategy:
    """The engine is the truth about its ZeRO stage: a stage-0 checkpoint may resume
    on another world size, a stage 1-3 one may not (the manifest decides)."""
    stage = base.zero_stage
    precision = base.precision
    try:
        stage = int(engine.zero_optimization_stage())
        if engine.bfloat16_enabled():
            precision = "bf16-mixed"
        elif engine.fp16_enabled():
            precision = "fp16-mixed"
        else:
            precision = precision or "fp32"
    except AttributeError:  # an engine-like object without the query methods
        pass
    return Strategy(base.sharding, stage, precision)


def state_io(states: Mapping[str, Any], strategy: Strategy) -> Any:
    """The `StateIO` for `states`: DCP for `Stateful`s, DeepSpeed's own format for an
    engine (alone: DeepSpeed's folder holds nothing else)."""
    engines = [k for k, v in states.items() if isinstance(v, DeepSpeedEngineState)]
    if engines:
        others = sorted(k for k in states if k not in engines)
        if len(engines) > 1 or others:
            raise UsageError(
                f"states: a DeepSpeed engine ({engines[0]!r}) checkpoints alone, but the "
                f"mapping also holds {sorted(engines[1:]) + others}; pass other state as "
                "per_rank= (saved by every rank beside the engine's files)"
            )
        from .backends.deepspeed import DeepSpeedStateIO

        engine = states[engines[0]].engine
        return DeepSpeedStateIO(engine, _deepspeed_strategy(engine, strategy))
    bad = sorted(k for k, v in states.items() if not isinstance(v, Stateful))
    if bad:
        raise UsageError(
            f"states {bad}: not Stateful (no state_dict/load_state_dict); wrap a model and "
            "its optimizer with api.model_state(model, optimizer), a DeepSpeed engine with "
            "api.deepspeed_state(engine)"
        )
    if not states:
        raise UsageError("states is empty: give at least the model, e.g. api.model_state(model)")
    from .backends.fsdp import DcpStateIO

    return DcpStateIO(states, strategy)


class RankState:
    """The per-rank `Stateful` of a user script: step, RNG streams, `per_rank` state.

    Saved by every rank into its own file. On a resume at the same world size every
    rank gets its own dict back (so RNG streams continue exactly); on another world
    size every rank gets rank 0's, the RNG is re-seeded from (seed, step, rank), and
    each per-rank object with a `reshard(old, new)` method is told.
    """

    def __init__(self, per_rank: Mapping[str, Stateful], *, rng: bool, seed: int, rank: int):
        bad = sorted(k for k, v in per_rank.items() if not isinstance(v, Stateful))
        if bad:
            raise UsageError(f"per_rank {bad}: not Stateful (no state_dict/load_state_dict)")
        self.per_rank = dict(per_rank)
        self.rng, self.seed, self.rank = rng, seed, rank
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        from .checkpoint import capture_rng

        return {
            "step": self.step,
            "rng": capture_rng() if self.rng else None,
            "per_rank": {k: v.state_dict() for k, v in self.per_rank.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from .checkpoint import restore_rng

        saved = state_dict.get("per_rank") or {}
        missing = sorted(set(self.per_rank) - set(saved))
        if missing:
            raise CheckpointError(
                f"the checkpoint holds no per_rank state {missing} (it has {sorted(saved)}); "
                "resume with the per_rank keys the run was saved with"
            )
        self.step = int(state_dict["step"])
        if self.rng and state_dict.get("rng") is not None:
            restore_rng(state_dict["rng"])
        for key, obj in self.per_rank.items():
            obj.load_state_dict(saved[key])

    def reshard(self, old_world_size: int, new_world_size: int) -> None:
        from .checkpoint import reseed_rng

        if self.rng:
            reseed_rng(self.seed, self.step, self.rank)
        for obj in self.per_rank.values():
            hook = getattr(obj, "reshard", None)
            if callable(hook):
                hook(old_world_size, new_world_size)
