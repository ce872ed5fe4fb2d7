"""The backend-neutral `Plan` every input is read into and every output is written from.

Readers (read_fsdp, read_deepspeed, read_spec) fill a `Plan`; writers (write_deepspeed,
write_fsdp) turn it into the other backend's accelerate config. Going through one
neutral view is what makes FSDP → DeepSpeed → FSDP give back every setting with a twin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Target = Literal["fsdp", "deepspeed"]
NoteKind = Literal["mapped", "not-mapped", "changed", "precision"]
# What `detect` found: the two accelerate flavours or a shardctl job spec.
SourceKind = Literal["accelerate-fsdp", "accelerate-deepspeed", "jobspec"]


@dataclass(frozen=True)
class Note:
    """One line of the conversion report."""

    kind: NoteKind
    setting: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "setting": self.setting, "message": self.message}

    def __str__(self) -> str:
        return f"[{self.kind}] {self.setting}: {self.message}"


@dataclass
class Plan:
    """Backend-neutral view of one distributed-training setup."""

    sharding: str = "FULL_SHARD"
    """FSDP strategy name; for DeepSpeed sources derived from the ZeRO stage."""
    zero_stage: int = 3
    offload_param: str = "none"
    offload_optimizer: str = "none"
    ram_efficient_loading: bool | None = None
    full_state_dict: bool | None = None
    """FULL_STATE_DICT / zero3_save_16bit_model true; None when the source did not say."""
    mixed_precision: str | None = None
    grad_accum: int | str | None = None
    grad_clip: float | str | None = None
    hpz_partition_size: int | None = None
    fsdp_version: int | None = None
    fsdp_extra: dict[str, Any] = field(default_factory=dict)
    """FSDP settings without a DeepSpeed twin, kept for a conversion back to FSDP."""
    top: dict[str, Any] = field(default_factory=dict)
    """Top-level accelerate keys that both backends share (num_processes ...)."""
    notes: list[Note] = field(default_factory=list)

    def note(self, kind: NoteKind, setting: str, message: str) -> None:
        self.notes.append(Note(kind, setting, message))

    def mappable(self) -> dict[str, Any]:
        """The settings that have a twin on both sides (what a round trip must keep)."""
        return {
            "sharding": self.sharding,
            "zero_stage": self.zero_stage,
            "offload": self.offload_param != "none" or self.offload_optimizer != "none",
            "ram_efficient_loading": self.ram_efficient_loading,
            "full_state_dict": self.full_state_dict,
            "mixed_precision": self.mixed_precision,
            "top": dict(self.top),
        }


@dataclass(frozen=True)
class Conversion:
    """The result: the target accelerate config, maybe a DeepSpeed JSON, and the report."""

    source: str
    """`accelerate-fsdp`, `accelerate-deepspeed` or `jobspec`."""
    target: Target
    accelerate_config: dict[str, Any]
    deepspeed_json: dict[str, Any] | None
    notes: tuple[Note, ...]
    spec_strategy: dict[str, Any] | None = None
    """For a job-spec source: the `strategy` section that selects the target backend."""

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "target": self.target,
            "accelerate_config": self.accelerate_config,
            "deepspeed_config": self.deepspeed_json,
            "spec_strategy": self.spec_strategy,
            "notes": [n.to_json() for n in self.notes],
        }
