"""The memory tier: a checkpoint every K steps in node-local memory, and on more than
one node a copy of each node's in its partner node's memory.

`checkpoint.memory_every_steps: K` makes every rank also save its state (model,
optimizer, train state: what a durable checkpoint holds) every K steps into a tmpfs
folder that outlives the rank's process (`checkpoint.memory_dir`, default
`/dev/shm/shardctl/<name>-<hash of the run dir>`). Nothing here is a new format or a
new storage: the copy is a `CheckpointManager` whose storage is a `PosixStorage`
rooted on that folder (no fsync: memory has no disk to reach), so it is staged,
hashed, committed by its manifest and listed exactly like a durable checkpoint. Only
the newest copy is kept (retention 1: the previous copy goes once the new one is
committed, so a crash mid-copy still leaves one).

On a restart (`restore_newest`), the newest step across the tiers wins: the memory
copy when its step is newer than the newest durable checkpoint and it verifies
(sha256 of every file), else the durable tier as always. The ranks of one node share
its tmpfs and the manifest lists every rank's files, so every rank restores the same
step. A copy that fails its hash is refused with a log line and the durable tier
serves. Rank 0 records which tier served in `<run dir>/logs/restores.jsonl`, which
`shardctl status` shows.

The copy runs behind training where the backend saves asynchronously (FSDP's DCP:
the state is staged into CPU memory, then written, hashed and committed by a
background thread, as `checkpoint.async` does for the durable tier; the tier has its
own copy of the `StateIO`, so its staging buffers are not the durable save's); with
DeepSpeed (synchronous saves only) it blocks. The next copy waits for the one before.
The stall each copy costs the loop is kept in `MemoryTier.stall_s` and measured by
`benchmarks/memory_tier.py`.

On more than one node (`memory_partner.py`) each node keeps its own ranks' files in
`<memory_dir>/node-<n>/` and a copy of them is sent to its partner node (node n's
partner is node (n + 1) mod nodes), each with its own manifest and sha256; a restart
loads the newest step every node's slice has a verified copy of (own node first, then
the partner's copy, then the durable tier), agreed by every rank.

What it survives: a rank's process dying (a crash, SIGKILL, a hang ended by the
watchdog) while the node lives; on more than one node also one node's memory lost
(its partner's copy serves). Not a node lost with its partner, nor a requeue onto other
nodes: the durable tier serves.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from copy import copy as shallow_copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..orchestrator.checkpoint_list import STEP_RE
from ..orchestrator.durable import free_bytes, write_text_atomic
from ..orchestrator.errors import CheckpointError, PermanentError, StorageError
from ..orchestrator.fence import AttemptFence
from ..orchestrator.rundir import attempt_token
from ..orchestrator.storage import STAGING_SUFFIX, PosixStorage
from .backends.base import Stateful, StateIO
from .memory_partner import Layout, PartnerCopies, node_dir

log = logging.getLogger(__name__)

MEMORY_ROOT = Path("/dev/shm/shardctl")
RESTORES_FILE = "restores.jsonl"  # in the run dir's logs/
OWNER_FILE = "logs/memory-tier.json"  # in the run dir: the folder of this run's copies
# A copy is staged beside the one it replaces: the tmpfs holds two at once.
COPIES_HELD = 2
# AdamW keeps two moments per parameter, in the parameter's dtype.
OPTIMIZER_STATES = 2


def default_memory_dir(name: str, run_dir: str | Path) -> Path:
    """`/dev/shm/shardctl/<name>-<12 hex of sha256(absolute run dir)>`: one folder per
    run, so two runs of the same name never share copies."""
    digest = hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:12]
    return MEMORY_ROOT / f"{name}-{digest}"


@dataclass(frozen=True)
class MemoryConfig:
    """What `CheckpointManager` reads of its config, for the memory copies."""

    dir: str
    keep: int = 1
    async_save: bool = False
    resume: str = "auto"


def state_bytes(parameters: Any) -> int:
    """An estimate of one copy of a node's state: every parameter, unsharded, plus
    the optimizer's two moments of the same size (the trainer state is small)."""
    total = sum(p.numel() * p.element_size() for p in parameters)
    return total * (1 + OPTIMIZER_STATES)


def room_problem(directory: str | Path, copy_bytes: int, nodes: int = 1) -> str | None:
    """One line when `directory`'s file system cannot hold the tier (two copies of
    `copy_bytes` at once; on more than one node, two of this node's share and two of
    the share it holds for its peer), else None. A path that is, or lies under, a file
    or a folder this process may not write is said too (every retry would find it)."""
    unusable = _unusable(Path(directory))
    if unusable is not None:
        return (
            f"checkpoint.memory_dir {str(directory)!r}: {unusable}; accepted: a folder "
            "this user may write on a tmpfs (unset: /dev/shm/shardctl/...)"
        )
    free = free_bytes(directory)
    share = -(-copy_bytes // nodes)
    copies = COPIES_HELD if nodes == 1 else 2 * COPIES_HELD
    needed = copies * share
    if free is None or free >= needed:
        return None
    what = (
        "parameters and optimizer state, the newest copy and the one being written"
        if nodes == 1
        else f"this node's 1/{nodes} of the parameters and optimizer state and the share "
        "it holds for its peer node, the newest copy of each and the one being written"
    )
    return (
        f"checkpoint.memory_dir {str(directory)!r}: {_size(free)} free, but the memory tier "
        f"needs about {_size(needed)} ({copies} copies of {_size(share)}: {what}); "
        "accepted: a larger tmpfs (e.g. /dev/shm's size), another checkpoint.memory_dir, "
        "or checkpoint.memory_every_steps unset"
    )


def _size(n: int) -> str:
    """`1000 bytes`, `1.4 KiB`, `2.3 GiB`."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


class MemoryTier:
    """The memory copies of one rank: `due(step)`, `copy(step, trainer)`, `clear()`;
    `restore_newest` reads them back through `manager`."""

    def __init__(
        self,
        every: int,
        directory: str | Path,
        state_io: StateIO,
        *,
        rank: int,
        world_size: int,
        model_meta: dict[str, Any] | None = None,
        background: bool = True,
        run_dir: str | Path | None = None,
    ) -> None:
        from .checkpoint import CheckpointManager

        self.every = every
        self.dir = Path(directory)
        # torchrun numbers ranks node by node; one node: the copies stay in one folder.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
        self.layout = Layout(rank, world_size, local_world)
        self.background = background and state_io.sync_only_reason is None
        # The tier's own StateIO when it saves in the background: its own staging
        # buffers, released by its own close (the durable manager closes the original).
        self.state_io = shallow_copy(state_io) if self.background else state_io
        if self.background and hasattr(self.state_io, "_stager"):
            self.state_io._stager = None  # type: ignore[attr-defined]
        fence = AttemptFence.from_env()
        where = self.dir if self.layout.nodes == 1 else node_dir(self.dir, self.layout.node)
        storage = PosixStorage(
            where, durable=False, fence=fence.check if fence is not None else None
        )
        # A collective (the manager makes its gloo group): every rank builds it.
        self.manager = CheckpointManager(
            MemoryConfig(str(self.dir), async_save=self.background),
            self.state_io,
            rank=rank,
            world_size=world_size,
            directory=where,
            model_meta=model_meta,
            storage=storage,
        )
        # More than one node: the copies and their partner copies (`memory_partner.py`).
        self.partner = (
            PartnerCopies(self.manager, self.state_io, self.dir, self.layout)
            if self.layout.nodes > 1
            else None
        )
        self.rank = rank
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.stall_s: list[float] = []  # seconds each copy held the training loop

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def copy(self, step: int, trainer: Stateful | None) -> None:
        """Save `step` into memory (a collective; staged, then written behind training
        where the backend allows). A tmpfs that fills up turns the tier off for this
        attempt (said once): the durable tier goes on."""
        t0 = time.perf_counter()
        try:
            if self.partner is not None:
                self.partner.copy(step, trainer, background=self.background)
            else:
                self.manager.save(step, trainer, final=not self.background)
        except StorageError as exc:
            log.error("memory tier off for this attempt: %s", exc)
            self.every = 0
            return
        except (CheckpointError, OSError) as exc:
            if self.partner is None:
                raise
            # Across nodes every failure is shared with every rank (gathered), so all
            # turn the tier off together and training goes on with the durable tier.
            log.error("memory tier off for this attempt: %s", exc)
            self.every = 0
            return
        self.stall_s.append(time.perf_counter() - t0)

    def clear(self) -> None:
        """Once a durable checkpoint of the last step exists (the run finished or was
        preempted) the copies are older than it: rank 0 frees the memory they hold,
        after every rank's copy in flight committed (a collective)."""
        if self.partner is not None:
            self.partner.clear()
            return
        self.manager.wait()
        self.manager._barrier()
        if self.rank != 0 or not self.dir.is_dir():
            return
        storage = self.manager.storage
        storage.clean_stale(lambda name: bool(STEP_RE.match(name)))
        for name in storage.listdir(""):
            if STEP_RE.match(name) and not name.endswith(STAGING_SUFFIX):
                storage.delete(name)
        with contextlib.suppress(OSError):
            self.dir.rmdir()  # only when empty: a folder the user named may hold more

    def known_to_run(self) -> bool:
        """Whether the copies here are this run's (a collective; rank 0 asks): the run
        dir names this folder in `logs/memory-tier.json`, written once a run resumed.
        A run dir deleted and started afresh has no such file, so the copies an
        earlier run of the same name left in memory are not taken for its own."""
        if self.run_dir is None:
            return True  # a script without a run dir: nothing to tell runs apart

        def named_here() -> bool:
            try:
                return json.loads((self.run_dir / OWNER_FILE).read_text()).get("dir") == str(
                    self.dir
                )
            except (OSError, ValueError, AttributeError):
                return False

        return bool(self.manager._rank0_do(named_here))

    def claim(self) -> None:
        """Rank 0: name this folder in the run dir (`known_to_run`)."""
        if self.rank == 0 and self.run_dir is not None:
            (self.run_dir / OWNER_FILE).parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.run_dir / OWNER_FILE, json.dumps({"dir": str(self.dir)}) + "\n")

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def close(self) -> None:
        """Wait for a copy in flight; release the tier's own staging buffers (a
        shared `StateIO` is the durable manager's to close)."""
        if self.partner is not None:
            self.partner.wait(quiet=True)
        if self.background:
            self.manager.close()
        else:
            self.manager.wait()


@dataclass(frozen=True)
class Restored:
    """Which tier a run resumed from (`tier` None: from scratch)."""

    step: int | None
    tier: str | None
    seconds: float
    refused: str | None = None  # why a newer memory copy was not used
    served: str | None = None  # which node's partner copy served which node
    received_bytes: int | None = None  # across nodes: what the restore sent over the wire

    def words(self) -> str:
        """`resumed at step 40 (from memory: checkpoint verified and loaded in 0.21 s)`;
        `(from partner: node 1 served by node 0's partner copy; checkpoint ...)`."""
        if self.step is None:
            return "starting at step 0"
        served = f"{self.served}; " if self.served else ""
        return (
            f"resumed at step {self.step} (from {self.tier}: {served}checkpoint verified "
            f"and loaded in {self.seconds:.2f} s)"
        )


def restore_newest(
    durable: Any,
    memory: MemoryTier | None,
    trainer: Stateful | None,
    *,
    fresh_nodes: set[int] | None = None,
) -> Restored:
    """Resume from the newest step across the tiers (a collective): the memory copy
    when it is newer than the newest durable checkpoint and verifies (on more than one
    node: every node's own copy, else its partner's copy), else the durable tier
    (`checkpoint.resume` as configured). An explicit `checkpoint.resume` or `never` is
    the user's choice: the memory tier is not asked.

    `fresh_nodes`: node ranks whose memory is new (a spare standing in for a lost
    node): their folders are not asked, the partner copies serve them; None reads
    `SHARDCTL_MEMORY_FRESH_NODES` (`memory_partner.FRESH_NODES_ENV`)."""
    t0 = time.perf_counter()
    refused = None
    if memory is not None and not memory.known_to_run():
        # Left by an earlier run of the same name and run dir (deleted since): not ours.
        if memory.manager.newest_step() is not None and memory.rank == 0:
            log.warning("%s holds copies of an earlier run, not used; removed", memory.dir)
        memory.clear()
    if memory is not None:
        memory.claim()
    if memory is not None and memory.partner is not None and durable.config.resume == "auto":
        newest_durable = durable.newest_step() or 0
        found = memory.partner.restore(trainer, newer_than=newest_durable, fresh=fresh_nodes)
        if found.step is not None:
            seconds = time.perf_counter() - t0
            return Restored(
                found.step, found.tier, seconds, found.why_not, found.partner_words(),
                found.received_bytes,
            )  # fmt: skip
        refused = found.why_not
        if refused and memory.rank == 0:
            log.warning("memory tier not used: %s; restoring from the durable tier", refused)
    elif memory is not None and durable.config.resume == "auto":
        newest_durable = durable.newest_step()
        newest_memory = memory.manager.newest_step()
        if newest_memory is not None and newest_memory > (newest_durable or 0):
            step = memory.manager.restore(trainer, newer_than=newest_durable or 0)
            if step is not None:
                return Restored(step, "memory", time.perf_counter() - t0)
            refused = f"the memory copy of step {newest_memory} failed verification"
            if memory.rank == 0:
                log.warning("%s in %s; restoring from the durable tier", refused, memory.dir)
    step = durable.restore(trainer)
    tier = "durable" if step is not None else None
    return Restored(step, tier, time.perf_counter() - t0, refused)


def _unusable(directory: Path) -> str | None:
    """Why no copy can be written under `directory` (its nearest existing part is a
    file, or a folder this process may not write), else None."""
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{str(existing)!r} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{str(existing)!r} is not writable by this user"
    return None


def check_room(memory: MemoryTier, parameters: Any) -> None:
    """Before training starts: a tmpfs too small for the tier stops the run with one
    line naming both sizes (every retry would find the same tmpfs)."""
    size = state_bytes(parameters)
    lay = memory.layout
    if lay.nodes == 1:
        # Rank 0 asks, every rank hears the same answer: all stop, or none does.
        problem = memory.manager._rank0_do(lambda: room_problem(memory.dir, size))
    else:  # every node's first rank asks about its own tmpfs
        mine = room_problem(memory.dir, size, lay.nodes) if lay.local_rank == 0 else None
        found = [f"node {n}: {p}" for n, p in memory.manager._all_gather((lay.node, mine)) if p]
        problem = found[0] if found else None
    if problem is not None:
        raise PermanentError(problem)


def last_logged_step(run_dir: str | Path) -> int | None:
    """The newest step in `logs/metrics.jsonl` (how far the previous attempt got, to
    `train.log_every`); None when none is logged."""
    path = Path(run_dir) / "logs" / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - (64 << 10)))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return None


def record_restore(run_dir: str | Path, restored: Restored, reached: int | None) -> None:
    """Rank 0: append which tier served and how many logged steps were lost to
    `<run dir>/logs/restores.jsonl` (read by `shardctl status`)."""
    if restored.step is None:
        return
    lost = max(0, reached - restored.step) if reached is not None else None
    entry = {
        "time": round(time.time(), 3),
        "token": attempt_token(),
        "step": restored.step,
        "tier": restored.tier,
        "lost_steps": lost,
        "seconds": round(restored.seconds, 3),
        "refused": restored.refused,
        "served": restored.served,
        "received_bytes": restored.received_bytes,
    }
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / RESTORES_FILE, "a") as f:  # one short line, one write
        f.write(json.dumps(entry) + "\n")


def last_restore(run_dir: str | Path) -> dict[str, Any] | None:
    """The newest line of `logs/restores.jsonl` (`shardctl status`), None without one;
    a torn or foreign line is skipped."""
    try:
        lines = (Path(run_dir) / "logs" / RESTORES_FILE).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("step"), int):
            return entry
    return None


def restore_words(entry: dict[str, Any]) -> str:
    """`restored from memory at step 40 (3 steps lost)`, `restored from partner at step
    40 (node 1 served by node 0's partner copy; 3 steps lost)`, for `status`."""
    lost = entry.get("lost_steps")
    lost_text = "steps lost unknown" if not isinstance(lost, int) else f"{lost} steps lost"
    if lost == 1:
        lost_text = "1 step lost"
    refused = f"; {entry['refused']}" if entry.get("refused") else ""
    served = f"{entry['served']}; " if entry.get("served") else ""
    return (
        f"restored from {entry.get('tier')} at step {entry['step']} ({served}{lost_text}{refused})"
    )
