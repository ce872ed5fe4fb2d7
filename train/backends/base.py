"""What a training backend is: the loop's three calls plus its state I/O.

Two protocols, both structural (a backend does not inherit from them):

`TrainingBackend` — what `shardctl.train.loop` drives once per optimizer step, in
this order: `set_lr(lr)`, `micro_step(batch, last, scale)` for each micro-batch,
then `step()` (clip → optimizer step → zero grads; returns the gradient norm). Its
`state_io` says how the backend's sharded state is checkpointed.

`StateIO` — how one backend's sharded state (model, optimizer, anything the
backend owns) goes into a step folder and back. The `CheckpointManager` owns the
folder protocol (`step-N.tmp/` → hashes → manifest → one rename, retention,
verified resume) and the per-rank trainer state; a `StateIO` only writes and reads
its own sub-folder (`dcp/` for FSDP, `deepspeed/` for DeepSpeed) and says what the
manifest records about it. It never sees the whole job spec.

No torch import here: the protocols are types, checked by `typing` alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class SaveFuture(Protocol):
    """What an asynchronous save hands back: `result()` blocks until the files are
    written, and raises what the writer raised."""

    def result(self) -> Any: ...


@runtime_checkable
class StateIO(Protocol):
    """A backend's sharded state, saved under and loaded from one step folder.

    `group` is the checkpoint manager's own process group (gloo), or None in a
    single process without a process group. Every method except `manifest_fields`
    and `versions` is a collective: every rank calls it with the same arguments.
    """

    backend: str
    """Recorded as the manifest's "backend"; a checkpoint resumes only with the
    backend that wrote it."""

    sync_only_reason: str | None
    """Why this backend cannot save asynchronously (None: it can)."""

    def manifest_fields(self) -> dict[str, Any]:
        """Top-level manifest entries about the backend: backend, sharding,
        zero_stage and the concrete precision the state was trained in."""
        ...

    def versions(self) -> dict[str, str | None]:
        """Versions of the libraries whose format this backend writes."""
        ...

    def save(self, step_dir: Path, group: Any) -> None:
        """Write this rank's part of the state under `step_dir` (files synced)."""
        ...

    def save_async(self, step_dir: Path, group: Any) -> SaveFuture:
        """Stage the state and write it in the background (only when
        `sync_only_reason` is None)."""
        ...

    def check_resumable(self, step_dir: Path, manifest: dict[str, Any], world_size: int) -> None:
        """Raise `CheckpointError` when this checkpoint cannot be loaded here
        (e.g. another world size and a format that does not reshard)."""
        ...

    def load(self, step_dir: Path, manifest: dict[str, Any], group: Any) -> None:
        """Load the state saved under `step_dir` into the live objects."""
        ...

    def close(self) -> None:
        """Release what saving kept between saves (staging buffers)."""
        ...


class TrainingBackend(Protocol):
    """One training step's pieces; the loop calls them in order (see module doc)."""

    name: str
    state_io: StateIO

    def set_lr(self, lr: float) -> None: ...

    def micro_step(self, batch: Any, last: bool, scale: float) -> Any:
        """Forward + backward of one micro-batch (`last`: the accumulation boundary;
        `scale`: 1/grad_accum); returns the unscaled loss as a detached tensor."""
        ...

    def step(self) -> float:
        """Finish the optimizer step; returns the global gradient norm (nan if unknown)."""
        ...
