"""Slurm's round tokens for the node agent's rounds of restarts in place.

The round protocol itself (node 0 decides and writes `RESTART`, the other nodes follow
and acknowledge in `rounds/`) is the agent's, the same on every cluster
(`orchestrator/agent/rounds.py`, its names importable here too). Each round of a Slurm
allocation has its own attempt token, the same on every node (`round_token`), from
which Slurm `status` reads which requeue wrote a marker (`requeue_of_token`).
"""

from __future__ import annotations

import re

from ...agent.rounds import (
    ROUND_ACK_WAIT_S,
    ROUND_DECISION_WAIT_S,
    ROUNDS_DIR,
    ack_round,
    round_decision,
    tell_round,
    wait_for_acks,
)
from ...fence import new_token

__all__ = [
    "ROUNDS_DIR",
    "ROUND_ACK_WAIT_S",
    "ROUND_DECISION_WAIT_S",
    "ack_round",
    "requeue_of_token",
    "round_decision",
    "round_token",
    "tell_round",
    "wait_for_acks",
]


def round_token(job_id: str, requeue: int, round_: int) -> str:
    """A round's attempt token, the same on every node: `slurm-<job>-<requeue>`, then
    `-r<round>` for a restart inside the allocation."""
    token = new_token("slurm", job_id, requeue, unique=False)
    return f"{token}-r{round_}" if round_ else token


def requeue_of_token(token: str, job_id: str) -> int | None:
    """The requeue whose round wrote a marker carrying `token`, when it is a round
    token of job `job_id` (`round_token`); None for another job's or cluster's token."""
    found = re.fullmatch(rf"slurm-{re.escape(job_id)}-(\d+)(?:-r\d+)?", token)
    return int(found.group(1)) if found else None
