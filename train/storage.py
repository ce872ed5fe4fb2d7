"""The checkpoint storage seam moved to `shardctl.orchestrator.storage` (torch-free,
so the CLI, the no-progress rule and the watchdog list checkpoints without `train/`);
its names stay importable from here for the callers written before."""

from ..orchestrator.storage import (
    COMMIT_MARKER,
    STAGING_SUFFIX,
    TRASH_PREFIX,
    CheckpointStorage,
    EntryStat,
    PosixStorage,
)

__all__ = [
    "COMMIT_MARKER",
    "STAGING_SUFFIX",
    "TRASH_PREFIX",
    "CheckpointStorage",
    "EntryStat",
    "PosixStorage",
]
