"""Training backends: FSDP2 (`fsdp`) and DeepSpeed ZeRO (`deepspeed`).

Each module holds everything about one backend — how the model is sharded, one
training step's pieces, and how its state is checkpointed (its `StateIO`) — and
implements the protocols of `base`. Nothing outside this package branches on
`strategy.backend`: the loop and the checkpoint manager see only the protocols.
Importing this package imports neither torch nor deepspeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import StateIO, TrainingBackend

if TYPE_CHECKING:
    from shardctl.orchestrator.spec import JobSpec

    from ..distributed import DistEnv

__all__ = ["StateIO", "TrainingBackend", "build_backend", "strategy_fields"]


def strategy_fields(strategy: Any) -> dict[str, Any]:
    """The manifest entries both backends record, from a spec's (resolved) strategy."""
    return {
        "sharding": strategy.sharding,
        "zero_stage": strategy.zero_stage,
        "precision": strategy.precision,
    }


def build_backend(model: Any, spec: JobSpec, env: DistEnv) -> TrainingBackend:
    """Shard `model` with the backend `spec.strategy.backend` names (a collective).

    `spec.strategy.precision` must be concrete here (`auto` resolved before).
    """
    if spec.strategy.backend == "deepspeed":
        from .deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(model, spec, env)
    from .fsdp import FsdpBackend

    return FsdpBackend(model, spec, env)
