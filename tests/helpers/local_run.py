"""A job of the local cluster followed to its end from a test, never left running."""

from __future__ import annotations

from typing import Any


def follow_to_end(local: Any, ref: Any, poll_s: float = 0.3) -> int:
    """`LocalCluster.follow` of `ref` (its output dropped) until it ends; its exit code.
    Whatever ends the wait early (an error, a test timeout), a job still running is
    cancelled: no test leaves ranks behind."""
    from shardctl.orchestrator.clusters.base import JobState

    try:
        return local.follow(ref, write=lambda s: None, poll_s=poll_s)
    finally:
        if local.status(ref).state == JobState.RUNNING:
            local.cancel(ref, grace_s=5)
