"""Atomic sharded checkpoints: save, verify, resume.

Usage inside every rank (after `torch.distributed.init_process_group`; the
constructor is a collective — every rank creates its manager, in the same order
relative to other process-group creations, because it makes its own gloo group):

    mgr = CheckpointManager(
        spec.checkpoint,            # its own section of the spec, nothing else
        backend.state_io,           # how the backend's sharded state is written/read
        rank=rank, world_size=world, model_meta=meta,
    )
    start = mgr.restore(trainer) or 0
    for step in range(start + 1, total + 1):
        ...
        if step % every == 0 or preempted:
            mgr.save(step, trainer, final=preempted)
    mgr.save(total, trainer, final=True)   # blocking
    mgr.close()

What goes where (layout in `shardctl.train.manifest`):
- The backend's state (model, optimizer, ...) goes where its `StateIO` puts it
  (`shardctl.train.backends`): `dcp/` for FSDP (DCP reshards on load, so a run can
  resume on another world size), `deepspeed/` for DeepSpeed (ZeRO 1-3 resume only
  at the world size that wrote them). The manifest records what the `StateIO` says
  about itself (backend, sharding, zero stage, the concrete precision).
- The trainer (any `Stateful`): `trainer.state_dict()` of each rank goes to
  `train_state/rank-NNNNN.pt` (torch.save), because RNG state and data position
  differ per rank. On restore at the SAME world size each rank gets back its own
  dict, exactly.

World-size change policy (trainer state): every rank receives rank 0's dict, and
then, if the trainer has a method `reshard(old_world_size, new_world_size)`, it
is called after `load_state_dict`. The trainer must therefore keep its data
position GLOBAL (e.g. optimizer steps or samples consumed by all ranks together,
from which each rank derives its own slice) and re-seed per-rank RNG
deterministically in `reshard` (`reseed_rng(seed, step, rank)` below does that).
Whether the backend's state loads on another world size is the `StateIO`'s call
(`check_resumable`).

Atomicity: everything is written to the storage's staging folder for `step-N`
(`step-N.tmp/` on POSIX); once every rank finished, the files are made durable and
hashed (spread over the ranks), rank 0 writes `manifest.json` and the storage
publishes `step-N/` at once (`shardctl.orchestrator.storage`: on POSIX fsyncs and one
rename). A crash at any instant leaves the previous set of complete checkpoints;
staging leftovers are removed at the next save. Retention runs only after the rename and keeps the
`checkpoint.keep` newest complete checkpoints, always including the new one.

Async save (`checkpoint.async: true`, where the `StateIO` supports it — FSDP): the
state is staged (copied to CPU memory) in `save`, which then returns; the backend
writes from a background thread on the manager's own gloo group, and the same
thread hashes, writes the manifest and renames once every rank's write finished
(ranks agree through collectives on that group). The next `save`, `wait` or
`close` waits for it and re-raises its error.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..orchestrator.durable import one_line, storage_error
from ..orchestrator.errors import CheckpointError, StorageError
from ..orchestrator.fence import AttemptFence, StaleAttemptError, current_attempt
from ..orchestrator.rundir import ENV_RUN_DIR
from ..orchestrator.storage import CheckpointStorage, checkpoint_storage, is_object_url
from . import heartbeat
from .backends.base import Stateful, StateIO
from .manifest import (
    FORMAT_VERSION,
    STEP_RE,
    CheckpointInfo,
    complete_candidates,
    describe_files,
    latest_complete,
    list_checkpoints,
    list_files,
    package_version,
    read_manifest,
    share_of,
    step_dirname,
    verify,
    write_manifest,
)

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "Stateful",
    "capture_rng",
    "latest_complete",
    "list_checkpoints",
    "reseed_rng",
    "restore_rng",
    "verify",
]

log = logging.getLogger(__name__)

TRAINER_DIR = "train_state"
# Long enough for the slowest rank to write a large shard to slow storage; a
# stuck peer still fails the save (wait() raises) instead of hanging forever.
CKPT_GROUP_TIMEOUT = timedelta(minutes=30)


# ------------------------------------------------------------------ RNG helpers


def capture_rng() -> dict[str, Any]:
    """The RNG states a training step can consume: python, numpy, torch CPU (+ CUDA)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional for the loop
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def reseed_rng(seed: int, step: int, rank: int) -> None:
    """Deterministic per-rank RNG for a run resumed at another world size: the
    saved per-rank streams cannot be mapped onto a different set of ranks."""
    derived = (seed * 1_000_003 + step * 7919 + rank) % (2**63)
    random.seed(derived)
    torch.manual_seed(derived)
    try:
        import numpy as np

        np.random.seed(derived % (2**32))
    except ImportError:
        pass


# ------------------------------------------------------------------ file system


def _read_or_why(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None), or (None, why it cannot be read)."""
    try:
        return read_manifest(path), None
    except CheckpointError as exc:
        return None, str(exc)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError with an errno behind `exc`: its causes, and the per-rank failures
    DCP's CheckpointException carries."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
            todo = [t for t in todo if isinstance(t, BaseException)]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def _first_failure(exc: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (whose text
    holds every failed rank's traceback), else `exc`."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, BaseException):
            return _first_failure(first)
    return exc


def _step_of(path: Path) -> int:
    match = STEP_RE.match(path.name)
    return int(match.group(1)) if match else -1


# How many ranks run on each node, as the launchers say it: torchrun (and accelerate's,
# which is torchrun) `LOCAL_WORLD_SIZE`, DeepSpeed's `LOCAL_SIZE`, else shardctl's env.sh.
RANKS_PER_NODE_ENV = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SHARDCTL_NPROC_PER_NODE")


def _fence_of_node(fence: AttemptFence | None, node: int) -> Any:
    """The check a node's storage calls before it stages or uploads. Node 0 publishes:
    always fenced. Another node is fenced where it sees the run's claim (a shared run
    dir: Slurm, this machine); where its run dir is its own (a pod's emptyDir) no claim
    is there to read, and node 0's fenced commit is what keeps a stale attempt out."""
    if fence is None:
        return None
    if node == 0 or current_attempt(fence.run_dir) is not None:
        return fence.check
    return None


def _node_layout(rank: int, world_size: int) -> tuple[int, int, int]:
    """(this rank's node, the number of nodes, ranks per node). Every launcher numbers
    ranks node by node and says how many run on each node (`RANKS_PER_NODE_ENV`);
    without it, or with a count that does not divide the world, all ranks are one
    node's."""
    said = next((os.environ[name] for name in RANKS_PER_NODE_ENV if os.environ.get(name)), "")
    try:
        per_node = int(said) if said else world_size
    except ValueError:
        per_node = world_size
    if per_node < 1 or world_size % per_node:
        per_node = world_size
    return rank // per_node, world_size // per_node, per_node


def _newest_step(storage: CheckpointStorage) -> int | None:
    found = complete_candidates(storage)
    return _step_of(found[0]) if found else None


# ------------------------------------------------------------------- the manager


class CheckpointManager:
    """Saves and restores a backend's state (through its `StateIO`) and a per-rank
    trainer `Stateful`, atomically.

    Construct it on every rank after the default process group exists (it creates
    a gloo group for its own collectives: a collective call). It is given only the
    spec's `checkpoint` section; `directory` defaults to `config.dir` (which spec
    validation fills in). `model_meta` goes into the manifest's "model" entry
    ({"source", "dtype", "hf_config"}).
    """

    def __init__(
        self,
        config: Any,
        state_io: StateIO,
        *,
        rank: int,
        world_size: int,
        directory: str | Path | None = None,
        model_meta: dict[str, Any] | None = None,
        storage: CheckpointStorage | None = None,
    ) -> None:
        self.config = config
        self.state_io = state_io
        self.rank, self.world_size = rank, world_size
        where = directory if directory is not None else config.dir
        if where is None:
            raise CheckpointError("checkpoint.dir is not set (validate the spec first)")
        # Where checkpoints live and how one is published: a folder, or an `s3://` URL
        # (staged and mirrored under the run dir, uploaded behind training). A rank
        # started by a fencing supervisor saves only while its attempt is the run's
        # current one (`orchestrator/fence.py`).
        fence = AttemptFence.from_env()
        # On more than one node, a bucket's staging is each node's own folder: no node
        # reads another's files, each uploads its own ranks' (`orchestrator/s3/storage`).
        self.node, self.nodes, self.ranks_per_node = _node_layout(rank, world_size)
        self.storage: CheckpointStorage = storage or checkpoint_storage(
            where,
            run_dir=os.environ.get(ENV_RUN_DIR),
            fence=_fence_of_node(fence, self.node),
            behind=True,
            node=self.node,
            nodes=self.nodes,
        )
        self.per_node = getattr(self.storage, "nodes", 1) > 1
        self.node_leader = rank % self.ranks_per_node == 0
        # Where readers find a checkpoint's files by path (a bucket's local mirror),
        # and the checkpoint dir as the user named it (for messages).
        self.dir = self.storage.root if is_object_url(where) else Path(where)
        self.location = str(where) if is_object_url(where) else str(self.dir)
        self.keep: int = config.keep
        self.model_meta = model_meta or {}
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = (
            dist.new_group(backend="gloo", timeout=CKPT_GROUP_TIMEOUT) if self.distributed else None
        )
        self.async_save = bool(config.async_save)
        if self.async_save and state_io.sync_only_reason is not None:
            self.async_save = False
            if rank == 0:
                log.warning(
                    "checkpoint.async is not supported with strategy.backend %s (%s); "
                    "saving synchronously",
                    state_io.backend,
                    state_io.sync_only_reason,
                )
        self._pending: threading.Thread | None = None
        self._pending_error: BaseException | None = None
        # Seconds per phase of the last save (after `wait()` for an async one):
        # blocked (the caller's stall), write (state → files), hash, publish, total.
        self.timings: dict[str, float] = {}

    # -- collectives on the checkpoint group (no-ops in a single process) ----------

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def _broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _rank0_do(self, fn: Any) -> Any:
        """Run `fn` on rank 0 and share its result, or its error, with every rank
        (so a failure on rank 0 fails every rank instead of hanging them)."""
        result: Any = None
        cause: BaseException | None = None
        if self.rank == 0:
            try:
                result = ("ok", fn())
            except StaleAttemptError as exc:  # every rank of a stale attempt stops as such
                result = ("stale", str(exc))
            except Exception as exc:
                cause = exc
                # The errno travels too: every rank can then say "full" or "read-only".
                code = exc.errno if isinstance(exc, OSError) else None
                result = ("error", (f"{type(exc).__name__}: {exc}", code))
        status, value = self._broadcast(result)
        if status == "stale":
            raise StaleAttemptError(value)
        if status == "error":
            text, code = value
            if cause is None and code is not None:
                cause = OSError(code, text)
            raise CheckpointError(f"checkpoint step failed on rank 0: {text}") from cause
        return value

    def _leaders_do(self, fn: Any) -> Any:
        """`_rank0_do`, but on the first rank of every node when each node stages its
        own files (`per_node`): each rank gets its node's result; a failure on any
        node fails every rank (none waits forever in the next collective)."""
        if not self.per_node:
            return self._rank0_do(fn)
        result: Any = None
        cause: BaseException | None = None
        if self.node_leader:
            try:
                result = ("ok", fn())
            except StaleAttemptError as exc:
                result = ("stale", str(exc))
            except Exception as exc:
                cause = exc
                code = exc.errno if isinstance(exc, OSError) else None
                result = ("error", (f"{type(exc).__name__}: {exc}", code))
        results = self._all_gather(result)
        for rank, outcome in enumerate(results):
            if outcome is None or outcome[0] == "ok":
                continue
            status, value = outcome
            if status == "stale":
                raise StaleAttemptError(value)
            text, code = value
            if cause is None and code is not None:
                cause = OSError(code, text)
            node = rank // self.ranks_per_node
            raise CheckpointError(f"checkpoint step failed on node {node}: {text}") from cause
        return results[self.node * self.ranks_per_node][1]

    # -- save -----------------------------------------------------------------------

    def save(self, step: int, trainer: Stateful | None = None, *, final: bool = False) -> None:
        """Write checkpoint `step` (a collective: every rank calls it).

        Blocking unless async save is on and `final` is False; then it returns once
        the state is staged. A step that already has a complete checkpoint is
        replaced atomically (e.g. a final save right after resuming from it).
        """
        self.wait()
        heartbeat.beat(step, "save")  # the watchdog allows a save its own time
        t0 = time.perf_counter()
        self.timings = {}
        name = step_dirname(step)
        tmp, final_dir = self.storage.staging_path(name), self.dir / name

        def prepare() -> None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._clean_stale()
            (self.storage.new_staging(name) / TRAINER_DIR).mkdir()

        try:
            self._leaders_do(prepare)  # every node stages its own files when `per_node`
            self._write_trainer_state(tmp, step, trainer)
            if not (self.async_save and not final):
                self.state_io.save(tmp, self.group)
                self.timings["write"] = time.perf_counter() - t0
                self._finalize(step, tmp, final_dir, t0)
                if final:  # the run ends (or is preempted) only once its upload is in
                    self._leaders_do(lambda: self._upload_done(final_dir))
        except StaleAttemptError:
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            problem = self._save_failed(name, exc)
            if problem is exc:
                raise
            raise problem from exc

        if self.async_save and not final:
            future = self.state_io.save_async(tmp, self.group)
            self._pending_error = None
            self._pending = threading.Thread(
                target=self._finish_async,
                args=(future, step, tmp, final_dir, t0),
                name=f"shardctl-ckpt-{step}",
                daemon=True,
            )
            self._pending.start()
        self.timings["blocked"] = time.perf_counter() - t0
        heartbeat.beat(step, "step")  # saved (or staged): training goes on

    def _finish_async(self, future: Any, step: int, tmp: Path, final_dir: Path, t0: float) -> None:
        try:
            future.result()
            self.timings["write"] = time.perf_counter() - t0
            self._finalize(step, tmp, final_dir, t0)
        except StaleAttemptError as exc:
            self._pending_error = exc
        except BaseException as exc:  # re-raised in the training thread by wait()
            self._pending_error = self._save_failed(final_dir.name, exc)

    def _save_failed(self, name: str, exc: BaseException) -> BaseException:
        """The error a failed save raises. On a full, over-quota, read-only or
        size-limited file system (torch's zip writer hides ENOSPC as "unexpected pos":
        the free space, asked right after, tells) a `StorageError` naming the checkpoint
        folder with its free and needed bytes, once the half-written staging folder is
        removed; the previous checkpoints are left as they were. Any other failure is
        `exc` as it is (its staging folder goes at the next save, as after a crash)."""
        previous = complete_candidates(self.storage)
        needed = _dir_bytes(previous[0]) if previous else None
        cause = _os_error_in(exc) or _first_failure(exc)
        # Asked before the staging folder goes: its partial files hold the space.
        if storage_error(cause, self.dir, what="", needed=needed) is None:
            return exc
        self.storage.discard(name)
        kept = (
            f"the previous checkpoint {previous[0].name} is intact"
            if previous
            else "there is no earlier checkpoint"
        )
        aftermath = f"the half-written {self.storage.staging_path(name).name} was removed; {kept}"
        what = f"checkpoint {name} (rank {self.rank})"
        problem = storage_error(cause, self.dir, what=what, needed=needed, aftermath=aftermath)
        if problem is None:  # the space came back once the staging folder went
            problem = StorageError(
                f"cannot write {what}: {self.dir} was full ({type(cause).__name__}: "
                f"{one_line(cause)}); {aftermath}"
            )
        log.error("%s", problem)
        return problem

    def _write_trainer_state(self, tmp: Path, step: int, trainer: Stateful | None) -> None:
        blob = {
            "rank": self.rank,
            "world_size": self.world_size,
            "step": step,
            "state": trainer.state_dict() if trainer is not None else None,
        }
        path = tmp / TRAINER_DIR / f"rank-{self.rank:05d}.pt"
        with open(path, "wb") as f:  # made durable with the other files, in `_finalize`
            torch.save(blob, f)

    def _finalize(self, step: int, tmp: Path, final_dir: Path, t0: float) -> None:
        """Every rank's files are written: hash them (each rank a share), write the
        manifest, publish through the storage, apply retention. A collective."""
        self._barrier()
        if self.per_node:  # each node hashes (and then uploads) the files it holds
            sizes = self._node_files(tmp)
            mine = share_of(sizes, self.rank % self.ranks_per_node, self.ranks_per_node)
        else:
            sizes = self._rank0_do(
                lambda: {rel: (tmp / rel).stat().st_size for rel in list_files(tmp)}
            )
            mine = share_of(sizes, self.rank, self.world_size)
        t_hash = time.perf_counter()
        try:
            # Make what this rank reads durable (files closed by writers).
            self.storage.sync(tmp, mine)
            part: Any = ("ok", describe_files(tmp, mine))
        except OSError as exc:  # shared with every rank, so that none waits forever
            part = ("error", f"rank {self.rank}: {exc}")
        described: dict[str, Any] = {}
        for status, value in self._all_gather(part):
            if status == "error":
                raise CheckpointError(f"hashing the files of {tmp} failed: {value}")
            described.update(value)
        t_publish = time.perf_counter()
        self.timings["hash"] = t_publish - t_hash

        def publish() -> None:
            manifest = self._manifest(step, described)
            # How long this save took (state written and hashed): `shardctl doctor`
            # compares the p95 of these with the preemption budget (signal or grace).
            manifest["save_s"] = round(time.perf_counter() - t0, 3)
            write_manifest(tmp, manifest)  # the commit marker, written last
            self.storage.publish(final_dir.name, replace=True)
            self._retention(final_dir)

        if self.per_node:
            # Node 0 commits once every other node's upload of its own files is done.
            ours = {rel: described[rel] for rel in sizes}
            self._leaders_do(
                lambda: (
                    publish() if self.node == 0 else self.storage.publish_node(final_dir.name, ours)
                )  # type: ignore[attr-defined]
            )
        else:
            self._rank0_do(publish)
        now = time.perf_counter()
        self.timings["publish"] = now - t_publish
        self.timings["total"] = now - t0
        if self.rank == 0:
            if self.location == str(self.dir):
                log.info("checkpoint %s complete", final_dir)
            else:  # complete once its manifest object is up (`_upload_done`, next save)
                log.info("checkpoint %s/%s saved; uploading", self.location, final_dir.name)

    def _node_files(self, tmp: Path) -> dict[str, int]:
        """The files of the staged save this node uploads, with their sizes: those its
        ranks wrote into its own staging folder, less any a lower node also holds (it
        uploads that one). A collective."""
        listed = self._leaders_do(
            lambda: {rel: (tmp / rel).stat().st_size for rel in list_files(tmp)}
        )
        every_node = [n for n in self._all_gather(listed if self.node_leader else None) if n]
        taken: set[str] = set()
        for node, files in enumerate(every_node):
            if node == self.node:
                return {rel: size for rel, size in files.items() if rel not in taken}
            taken.update(files)
        return {}

    def _manifest(self, step: int, files: dict[str, Any]) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": self.world_size,
            # backend, sharding, zero_stage, precision: what the backend says of itself
            **self.state_io.manifest_fields(),
            "model": self.model_meta,
            "versions": {
                "torch": torch.__version__,
                "shardctl": package_version("shardctl"),
                **self.state_io.versions(),
            },
            "files": dict(sorted(files.items())),
        }

    def _clean_stale(self) -> None:
        """Remove `.tmp` folders of crashed saves and half-deleted trash. Called by
        rank 0 at the start of a save, after any save of this job has finished."""
        for name in self.storage.clean_stale(lambda n: bool(STEP_RE.match(n))):
            log.info("removed %s (left by an interrupted save or deletion)", self.dir / name)

    def _retention(self, newest: Path) -> None:
        complete = complete_candidates(self.storage)
        keep = set(complete[: self.keep]) | {newest}
        for path in complete:
            if path not in keep:
                log.info("retention (keep %d): deleting %s", self.keep, path)
                self.storage.delete(path.name)

    def wait(self) -> None:
        """Block until the pending async save is complete; re-raise its failure."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
            if self._pending_error is not None:
                exc, self._pending_error = self._pending_error, None
                if isinstance(exc, StorageError):  # names the folder and the space itself
                    raise exc
                raise CheckpointError(f"the background checkpoint save failed: {exc}") from exc

    def _wait_for_upload(self) -> None:
        """Until the storage's upload behind training (an object store's) has ended;
        its failure is raised (that checkpoint is not committed)."""
        wait = getattr(self.storage, "wait", None)
        if wait is not None:
            wait()

    def _upload_done(self, newest: Path) -> None:
        """Wait for the upload behind training, then apply retention again: while it
        ran, the checkpoint it uploads was not yet complete, so none was deleted for it."""
        if hasattr(self.storage, "wait"):
            self._wait_for_upload()
            if self.rank == 0:  # the other nodes only waited for their own upload
                log.info("checkpoint %s/%s complete (uploaded)", self.location, newest.name)
                self._retention(newest)

    def close(self) -> None:
        self.wait()
        self._wait_for_upload()  # rank 0's: a rank never exits with its upload unfinished
        self.state_io.close()

    # -- restore --------------------------------------------------------------------

    def newest_step(self) -> int | None:
        """The step of the newest complete checkpoint here (rank 0 lists; a collective)."""
        return self._rank0_do(lambda: _newest_step(self.storage))

    def restore(
        self, trainer: Stateful | None = None, *, newer_than: int | None = None
    ) -> int | None:
        """Load the checkpoint `checkpoint.resume` designates; return its step, or
        None when training starts from scratch. A collective: every rank loads the
        same checkpoint (rank 0 lists, every rank verifies a share of the files).

        `newer_than` (a faster tier tried before the durable one: `memory_tier.py`):
        only checkpoints of a later step are tried, and when none verifies the
        answer is None (each refusal logged), not an error."""
        heartbeat.beat(None, "restore")
        mode = self.config.resume
        if mode == "never":
            return None
        explicit = mode != "auto"
        if explicit:
            candidates = [self._rank0_do(lambda: str(self._check_explicit(self._local(mode))))]
            if self.per_node and is_object_url(mode):  # every node its own copy
                candidates = [self._leaders_do(lambda: str(self._local(mode)))]
        else:
            candidates = self._rank0_do(
                lambda: [
                    str(p)
                    for p in complete_candidates(self.storage)
                    if newer_than is None or _step_of(p) > newer_than
                ]
            )
        rejected: list[str] = []
        for cand in candidates:
            path = Path(cand)
            if not explicit:  # from a bucket: brought down first (into each node's copy)
                if self.per_node:
                    path = self.dir / path.name
                self._leaders_do(lambda p=path: self._fetch(p))
            manifest, unreadable = self._rank0_do(lambda p=path: _read_or_why(p))
            if unreadable is not None:  # a damaged manifest: like a failed verification
                if explicit:
                    raise CheckpointError(f"checkpoint.resume {mode!r}: {unreadable}")
                if self.rank == 0:
                    log.warning("checkpoint %s not used: %s", path, unreadable)
                rejected.append(f"{path}:\n  {unreadable}")
                continue
            sizes = {rel: f["size"] for rel, f in manifest["files"].items()}
            mine = share_of(sizes, self.rank, self.world_size)
            problems = sorted(
                p
                for part in self._all_gather(verify(path, files=mine, manifest=manifest))
                for p in part
            )
            if not problems:
                if rejected and self.rank == 0:
                    log.warning("resuming from %s instead", path)
                self._load(path, manifest, trainer)
                if self.rank == 0:
                    log.info("resumed from %s (step %d)", path, manifest["step"])
                return int(manifest["step"])
            text = "\n  ".join(problems)
            if explicit:
                raise CheckpointError(
                    f"checkpoint.resume {mode!r}: the checkpoint is corrupt:\n  {text}"
                )
            if self.rank == 0:
                log.warning("checkpoint %s failed verification, not used:\n  %s", path, text)
            rejected.append(f"{path}:\n  {text}")
        if rejected and newer_than is not None:
            return None  # the caller goes on to the next tier
        if rejected:
            raise CheckpointError(
                f"every complete checkpoint in {self.dir} failed verification:\n"
                + "\n".join(rejected)
                + "\nset checkpoint.resume: never to start over, or a path to choose one"
            )
        if self.rank == 0 and newer_than is None:
            log.info("no complete checkpoint in %s: starting from step 0", self.location)
        return None

    def _fetch(self, path: Path) -> None:
        """Bring the checkpoint `path` (in the bucket's local mirror) down, if the
        storage is an object store's; its files are verified as they are read."""
        fetch = getattr(self.storage, "fetch", None)
        if fetch is not None:
            fetch(path.name)

    def _local(self, resume: str) -> Path:
        """The folder of `checkpoint.resume`: as given, or one in a bucket fetched into
        the run dir's mirror of it."""
        if not is_object_url(resume):
            return Path(resume)
        parent, _, name = resume.rstrip("/").rpartition("/")
        run_dir = os.environ.get(ENV_RUN_DIR)
        storage = checkpoint_storage(parent, run_dir=run_dir, node=self.node, nodes=self.nodes)
        try:
            return storage.fetch(name)  # type: ignore[attr-defined]
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint.resume {resume!r}: {exc}") from None

    def _check_explicit(self, path: Path) -> Path:
        if not path.is_dir():
            raise CheckpointError(
                f"checkpoint.resume {str(path)!r}: no such checkpoint folder; accepted: "
                "'auto', 'never' or the path of a complete step-NNNNNNNN folder"
            )
        if path.name.endswith(".tmp"):
            raise CheckpointError(
                f"checkpoint.resume {str(path)!r}: a .tmp folder is a save that never "
                "finished; choose a complete step-NNNNNNNN folder"
            )
        from .foreign import identify

        found = identify(path)
        if found is not None:
            backend = self.state_io.backend
            size = f" --world-size {self.world_size}" if backend == "deepspeed" else ""
            raise CheckpointError(
                f"checkpoint.resume {str(path)!r} is a {found.format} checkpoint written by "
                f"{found.tool}; the built-in loop resumes shardctl's layout: `shardctl convert "
                f"{path} --to {backend}{size} --layout shardctl --out NEW_FOLDER`, then "
                "checkpoint.resume: NEW_FOLDER"
            )
        read_manifest(path)  # raises with the reason when incomplete
        return path

    def _load(self, path: Path, manifest: dict[str, Any], trainer: Stateful | None) -> None:
        saved_backend = manifest.get("backend")
        backend = self.state_io.backend
        if saved_backend != backend:
            raise CheckpointError(
                f"{path} was written by backend {saved_backend!r} but this run uses "
                f"strategy.backend {backend!r}; a checkpoint resumes only with the "
                f"backend that wrote it. To switch with the optimizer state: `shardctl "
                f"convert {path} --to {backend} --out NEW_FOLDER"
                + (f" --world-size {self.world_size}" if backend == "deepspeed" else "")
                + "`, then set checkpoint.resume: NEW_FOLDER"
            )
        self.state_io.check_resumable(path, manifest, self.world_size)
        self.state_io.load(path, manifest, self.group)
        # A converted checkpoint keeps its source's trainer files (one per source rank).
        trainer_ws = int(manifest.get("train_state_world_size") or manifest["world_size"])
        if not (path / TRAINER_DIR).is_dir() and manifest.get("converted_from"):
            self._start_without_trainer_state(path, trainer, int(manifest["step"]))
            return
        self._load_trainer_state(path, trainer, trainer_ws)

    def _start_without_trainer_state(self, path: Path, trainer: Stateful | None, step: int) -> None:
        """A checkpoint converted from another tool's (`convert --layout shardctl`) holds
        the model and optimizer but not the loop's data position and RNG streams: the
        run goes on from its step with the data from its start and RNG seeded by step."""
        if self.rank == 0:
            log.warning(
                "%s was converted from another tool's checkpoint: model and optimizer state "
                "restored at step %d; it holds no data position or RNG state, so the data "
                "starts from its beginning",
                path,
                step,
            )
        hook = getattr(trainer, "start_at", None)
        if hook is not None:
            hook(step)

    def _load_trainer_state(self, path: Path, trainer: Stateful | None, old_ws: int) -> None:
        if trainer is None:
            return
        same = old_ws == self.world_size
        source = self.rank if same else 0
        # Our own files, verified against the manifest just before: they hold RNG
        # states (numpy arrays, tuples) that weights_only loading refuses.
        blob = torch.load(
            path / TRAINER_DIR / f"rank-{source:05d}.pt", map_location="cpu", weights_only=False
        )
        trainer.load_state_dict(blob["state"])
        if not same:
            if self.rank == 0:
                log.warning(
                    "resuming a world-size-%d checkpoint on %d ranks: model and optimizer are "
                    "resharded; trainer state comes from rank 0 and per-rank state is rebuilt",
                    old_ws,
                    self.world_size,
                )
            hook = getattr(trainer, "reshard", None)
            if callable(hook):
                hook(old_ws, self.world_size)
