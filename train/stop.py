"""The ranks' stop agreement: after every step, do all ranks stop, and for which signal.

Every rank contributes whether it wants to stop after this step (a signal arrived, or
the `SHARDCTL_STOP_AFTER_STEP` testing aid) and which signal it received; one
all-reduce (a sum) later every rank holds the same answer: stop or go on, and the
one signal that names the stop. The training loop, `api.Checkpointer` and the
Hugging Face callback all agree through this module, and it is the only module of
`shardctl.train` that all-reduces a stop signal.

Layout: `SLOTS` float64 slots of a buffer the caller owns, from `offset` on —
[ranks that want to stop, then one slot per signal of `PRIORITY`: how many ranks
received it]. A caller puts its own sums in the rest of the buffer (the loop: the
loss and every rank's step and data times; the api: step times), so the agreement
rides on the collective a step makes anyway. Counts, not signal numbers: numbers
cannot be summed or averaged (SIGUSR2 + SIGTERM averaged to SIGALRM).

Which signal wins when ranks received different ones: the first of `PRIORITY`
that any rank received.

    SIGUSR2, SIGUSR1   a warning: the cluster takes the allocation back (Slurm's
                       `--signal` before the time limit, or a preemption with
                       `preempt_send_user_signal`); the run is to be requeued
    SIGTERM            an end from outside: `scancel`, `shardctl cancel`, a pod's
                       deletion or eviction (its grace period), torchrun stopping
    SIGINT             a person's Ctrl-C

A warning wins because it is the only signal that says why the run stops and that
it should go on elsewhere: a TERM in the same step is most often the cluster
following its own warning (the time limit itself, or the end of a preemption's
grace) on a rank whose step outlasted the warning's lead time. A cancel by a person
is known to the supervisor without the ranks' help (`shardctl cancel` writes
`CANCELLED`; Slurm's node task receives the TERM and no warning), so the ranks'
choice never turns a cancel into a requeue by itself. TERM before INT: both end the
run; TERM usually comes with a kill deadline.

Torch is imported only inside the functions that run a collective.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The order in which a signal wins (see the module docstring).
PRIORITY: tuple[signal.Signals, ...] = (
    signal.SIGUSR2,
    signal.SIGUSR1,
    signal.SIGTERM,
    signal.SIGINT,
)
# [ranks wanting to stop, ranks that received PRIORITY[0], PRIORITY[1], ...]
SLOTS = 1 + len(PRIORITY)


@dataclass(frozen=True)
class StopDecision:
    """What every rank agreed on after one step."""

    stop: bool
    # The winning signal (PRIORITY's first that any rank received); None when no rank
    # received one (a testing aid stopped it, or nobody wants to stop).
    signum: signal.Signals | None
    # How many ranks received each signal, for the log: {SIGUSR2: 1, SIGTERM: 1}.
    received: dict[signal.Signals, int]


def fill(buffer: Any, offset: int, wants_stop: bool, signum: int | None) -> None:
    """Write this rank's part of the agreement into `buffer[offset:offset + SLOTS]`."""
    buffer[offset] = 1.0 if wants_stop else 0.0
    for i, sig in enumerate(PRIORITY):
        buffer[offset + 1 + i] = 1.0 if signum == sig else 0.0


def read(values: Sequence[float], offset: int = 0) -> StopDecision:
    """The agreement from the summed slots (`values`: the buffer after the all-reduce,
    as host numbers)."""
    counts = {sig: round(values[offset + 1 + i]) for i, sig in enumerate(PRIORITY)}
    received = {sig: n for sig, n in counts.items() if n > 0}
    winner = next((sig for sig in PRIORITY if counts[sig] > 0), None)
    return StopDecision(stop=values[offset] > 0, signum=winner, received=received)


def all_reduce(buffer: Any, group: Any = None) -> None:
    """Sum `buffer` over every rank (of `group`): the agreement's slots and whatever the
    caller put beside them. Nothing happens without a process group or with one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size(group) > 1:
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)


def agree(wants_stop: bool, signum: int | None, device: Any = None) -> StopDecision:
    """The agreement on its own (one small all-reduce), for a caller with nothing else
    to share in the step's collective (the Hugging Face callback)."""
    import torch

    buffer = torch.zeros(SLOTS, dtype=torch.float64, device=device)
    fill(buffer, 0, wants_stop, signum)
    all_reduce(buffer)
    return read(buffer.tolist())
