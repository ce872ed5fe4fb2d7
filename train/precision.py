"""`strategy.precision: auto` on the node: decided once per run, then kept.

At a run's first start rank 0 asks torch what its device computes natively
(`torch.cuda.get_device_capability` on CUDA, the flags of /proc/cpuinfo on CPU) and
`shardctl.orchestrator.precision.explain_auto` picks the precision. Once the run has
a checkpoint, the precision its manifest recorded wins instead: a resumed run never
changes precision midway, even when it resumes on other hardware.

Rank 0 decides and broadcasts its answer, so every rank trains in the same precision
even when the nodes differ (all ranks computing their own answer could disagree on a
mixed cluster, and a disagreement would only surface as a hang or garbage).

Everything after `resolve` sees a spec whose `strategy.precision` is concrete: the
FSDP mixed-precision policy, the DeepSpeed config built on the node, and every
checkpoint manifest. A spec with an explicit precision is returned unchanged (and
is not compared with the checkpoint's: that was, and stays, the user's call).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardctl.orchestrator.errors import CheckpointError, ShardctlError
from shardctl.orchestrator.precision import (
    AUTO,
    cpu_flags_of_this_host,
    explain_auto,
    is_concrete,
)
from shardctl.orchestrator.spec import JobSpec

from .distributed import DistEnv
from .manifest import complete_candidates, read_manifest


def with_precision(spec: JobSpec, precision: str) -> JobSpec:
    """`spec` with `strategy.precision` replaced (the spec is frozen: a copy)."""
    strategy = spec.strategy.model_copy(update={"precision": precision})
    return spec.model_copy(update={"strategy": strategy})


def of_this_host(device_type: str) -> tuple[str, str]:
    """(precision, why) that `auto` means on this host's device."""
    if device_type == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability()
        return explain_auto("cuda", cuda_capability=(major, minor))
    return explain_auto("cpu", cpu_flags=cpu_flags_of_this_host())


def recorded(checkpoint: Any) -> tuple[str, Path] | None:
    """The precision recorded by the checkpoint this run will resume from, and where.

    Follows `checkpoint.resume` as the checkpoint manager does: `never` → none, a
    path → that checkpoint, `auto` → the newest published one with a readable
    manifest (every checkpoint of a run records the same precision, so an older
    one the manager falls back to after a failed verification agrees).
    """
    mode = checkpoint.resume
    if mode == "never":
        return None
    candidates = complete_candidates(checkpoint.dir) if mode == "auto" else [Path(mode)]
    for path in candidates:
        try:
            precision = read_manifest(path).get("precision")
        except CheckpointError:
            continue  # the manager reports it when it gets there
        if is_concrete(precision):
            return precision, path
    return None


def decide(spec: JobSpec, device_type: str) -> tuple[str, str]:
    """(precision, why) for a spec asking for `auto`; what rank 0 computes."""
    found = recorded(spec.checkpoint)
    if found is not None:
        precision, path = found
        return precision, f"kept from checkpoint {path}: a run never changes precision"
    return of_this_host(device_type)


def resolve(spec: JobSpec, env: DistEnv) -> JobSpec:
    """The spec with a concrete precision. A collective when the spec says `auto`
    (every rank calls it after joining the process group)."""
    if spec.strategy.precision != AUTO:
        return spec
    box: list[Any] = [None]
    if env.is_main:
        # A failure on rank 0 is shared too: the other ranks must not wait for an
        # answer that never comes.
        try:
            box[0] = ("ok", decide(spec, env.device.type))
        except ShardctlError as exc:  # already says what failed (a bucket, a manifest)
            box[0] = ("error", str(exc))
        except Exception as exc:
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
    if env.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        # What failed comes first: seldom the precision itself (checkpoint.dir unreadable).
        raise ShardctlError(f"{value} (on rank 0, while resolving strategy.precision auto)")
    precision, why = value
    if env.is_main:
        print(f"{spec.name}: precision auto → {precision} ({why})", flush=True)
    return with_precision(spec, precision)
