"""The training loop: one `while`, in the order of the algorithm.

    set lr → micro-steps (forward, backward; grad accumulation) → clip → step →
    zero_grad → agree on loss, preemption and per-rank times (one all-reduce) →
    log → maybe checkpoint → maybe stop

Backends (`shardctl.train.backends`: FSDP2, DeepSpeed) implement `TrainingBackend`:
`set_lr`, `micro_step` and `step`, plus the `state_io` the checkpoint manager saves
through; the loop does not know which one it drives. Step numbers count finished
optimizer steps: checkpoint `step-N` holds the state after N steps, and resuming
from it runs step N+1 next.

Determinism: every rank seeds identically before building the model (same initial
weights), then re-seeds per rank; the data order is a function of the seed and the
global sample index; the trainer state (step, data position, RNG of every rank) is
saved per rank. So a run stopped and resumed at the same world size ends bit-for-bit
where an uninterrupted run ends.

Stragglers: on logged steps every rank also puts its step time and data time into the
same all-reduce (one slot per rank each, the others' slots 0, so the sum holds every
rank's value), and rank 0 logs min / median / max over ranks and the slowest rank
(`metrics.rank_times`). A rank's step time runs from the end of its previous step
(checkpoint saves left out, like tokens/s) to its arrival at this step's agreement;
its data time is the part spent in `next_batch`. What these numbers can show: ranks
wait for each other inside the model's own collectives (FSDP all-gathers and
reduce-scatters, DeepSpeed's too), so a slow rank's forward and backward make every
rank slow alike; a straggler stands out by the work it does after the last of those
collectives (the gradient-norm reduction of clipping is one: then the optimizer step)
and, in data time, by its data loading. A rank held up before the first collective
(by its data) shows as the others waiting: then data_slowest_rank names it.

Run-directory markers written by rank 0 (see `shardctl.train.preemption` for codes):
`DONE` (JSON: step) once every step ran, the final checkpoint exists and the optional
consolidation finished; `PREEMPTED` (JSON: step, reason) when the run stopped for a
preemption signal after saving — launchers like torchrun report any non-zero rank exit
as 1, so this file is how a supervisor tells "checkpointed, resume me" from a crash.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import random
import re
import time
from pathlib import Path
from typing import Any

from shardctl.orchestrator.errors import CheckpointError, PermanentError, StorageError
from shardctl.orchestrator.outcome import done_marker, preempted_marker
from shardctl.orchestrator.rundir import (
    DONE_FILE,
    PREEMPTED_FILE,
    RunDir,
)
from shardctl.orchestrator.spec import JobSpec
from shardctl.orchestrator.storage import is_object_url

from . import distributed, heartbeat
from . import stop as stop_rule
from .backends import TrainingBackend, build_backend
from .distributed import DistEnv
from .memory_tier import (
    MemoryTier,
    Restored,
    check_room,
    default_memory_dir,
    last_logged_step,
    record_restore,
    restore_newest,
)
from .precision import resolve as resolve_precision
from .preemption import EXIT_OK, EXIT_PREEMPTED, PreemptionFlag

log = logging.getLogger("shardctl.train")

# The agreement buffer: the loss, the stop agreement's slots (`shardctl.train.stop`),
# then the per-rank step and data times.
_STOP_AT = 1
_AGREE_FIXED = _STOP_AT + stop_rule.SLOTS


# A loss above this many times ln(vocab_size) has diverged (`train.on_divergence`): a
# model predicting uniformly scores ln(vocab_size) and training only lowers it, while a
# learning rate far too high sends it to hundreds.
DIVERGED_LOSS_FACTOR = 10.0

# How `CheckpointManager` passes rank 0's error to every rank.
_RANK0_WRAPPER = re.compile(r"^checkpoint step failed on rank 0: \w+: ")


def is_complete(spec: JobSpec) -> bool:
    return RunDir.of(spec.run_dir).is_complete(spec.train.steps)


class TrainerState:
    """The loop's own `Stateful`: step, data position and this rank's RNG streams."""

    def __init__(self, seed: int, rank: int, data: Any) -> None:
        self.seed = seed
        self.rank = rank
        self.data = data
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        from .checkpoint import capture_rng

        return {"step": self.step, "data": self.data.state_dict(), "rng": capture_rng()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from .checkpoint import restore_rng

        self.step = int(state["step"])
        self.data.load_state_dict(state["data"])
        restore_rng(state["rng"])

    def start_at(self, step: int) -> None:
        """Resume at `step` without saved trainer state (a converted foreign checkpoint):
        the data from its start, this rank's RNG seeded as a reshard seeds it."""
        from .checkpoint import reseed_rng

        self.step = step
        reseed_rng(self.seed, step, self.rank)

    def reshard(self, old_world_size: int, new_world_size: int) -> None:
        # The data position is global, so only the per-rank RNG streams need rebuilding.
        from .checkpoint import reseed_rng

        reseed_rng(self.seed, self.step, self.rank)


def _seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _vocab_size(model: Any, meta: dict[str, Any]) -> int | None:
    """How many token ids the model embeds (its config's, else its input embedding's)."""
    vocab = (meta.get("hf_config") or {}).get("vocab_size")
    if isinstance(vocab, int):
        return vocab
    embeddings = getattr(model, "get_input_embeddings", None)
    table = embeddings() if callable(embeddings) else None
    rows = getattr(table, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def _check_vocab(spec: JobSpec, vocab: int | None) -> None:
    d = spec.train.data
    if (d.text is not None or d.builtin is not None) and vocab is not None and vocab < 256:
        raise PermanentError(
            f"train.data is byte-level text (token ids 0..255) but the model's vocab_size is "
            f"{vocab}; accepted: vocab_size >= 256"
        )


class Trainer:
    def __init__(self, spec: JobSpec, env: DistEnv) -> None:
        import torch

        from .checkpoint import CheckpointManager, reseed_rng
        from .data import build_data
        from .model import build_model

        self.spec, self.env = spec, env
        t = spec.train
        # Same seed on every rank: identical initial weights before sharding.
        _seed_all(t.seed)
        model, self.model_meta = build_model(spec)
        vocab = _vocab_size(model, self.model_meta)
        _check_vocab(spec, vocab)
        self.loss_ceiling = DIVERGED_LOSS_FACTOR * math.log(vocab) if vocab else math.inf
        self.backend: TrainingBackend = build_backend(model, spec, env)
        # From here on each rank has its own RNG stream (dropout etc.).
        reseed_rng(t.seed, 0, env.rank)
        # Every batch's ids are checked against the vocabulary: an id past it is a
        # configuration error, not an index error deep inside the model.
        self.data = build_data(spec, env.rank, env.world_size, vocab)
        self.state = TrainerState(t.seed, env.rank, self.data)
        self.ckpt = CheckpointManager(
            spec.checkpoint,
            self.backend.state_io,
            rank=env.rank,
            world_size=env.world_size,
            model_meta=self.model_meta,
        )
        self.memory = self._memory_tier(model)
        self.run_dir = RunDir.of(spec.run_dir)
        self.tokens_per_step = t.micro_batch_size * t.seq_len * t.grad_accum * env.world_size
        # One buffer, one all-reduce (sum) per step: [loss, the stop agreement's slots,
        # then the step time of rank 0..W-1, then the data time of rank 0..W-1]. A rank
        # fills only its own time slots, and only on logged steps (0 otherwise).
        self._agree = torch.zeros(
            _AGREE_FIXED + 2 * env.world_size, dtype=torch.float64, device=env.device
        )
        self.stop_signal: int | None = None

    def _memory_tier(self, model: Any) -> MemoryTier | None:
        """The memory tier (`checkpoint.memory_every_steps`), its tmpfs checked for room
        before training starts; None when off."""
        c, env = self.spec.checkpoint, self.env
        if c.memory_every_steps is None:
            return None
        where = c.memory_dir or default_memory_dir(self.spec.name, self.spec.run_dir)
        memory = MemoryTier(
            c.memory_every_steps,
            where,
            self.backend.state_io,
            rank=env.rank,
            world_size=env.world_size,
            model_meta=self.model_meta,
            run_dir=self.spec.run_dir,
        )
        check_room(memory, model.parameters())
        return memory

    def _restore(self) -> Restored:
        """The checkpoint to resume from, the fastest tier that verifies; a
        `checkpoint.resume` folder that cannot be resumed is a configuration error
        (every retry would find the same folder)."""
        mode = self.spec.checkpoint.resume
        try:
            return restore_newest(self.ckpt, self.memory, self.state)
        except CheckpointError as exc:
            if mode in ("auto", "never"):
                raise
            # Rank 0's own error, without the wrapper every rank shares it in.
            why = str(exc.__cause__ if isinstance(exc.__cause__, CheckpointError) else exc)
            why = _RANK0_WRAPPER.sub("", why)
            if not why.startswith("checkpoint.resume"):
                why = f"checkpoint.resume {mode!r}: {why}"
            raise PermanentError(why) from None

    def _agree_on(
        self,
        loss: Any,
        flag: PreemptionFlag,
        step: int,
        times: tuple[float, float] | None = None,
    ) -> tuple[float, bool, dict[str, float | int] | None]:
        """Mean loss over ranks, whether the ranks stop after `step` (`stop`: the one
        agreement, which also sets `stop_signal`), and with `times` (this rank's step
        and data time; every rank passes them or none does) the per-rank fields of the
        metrics line."""
        agree, world = self._agree, self.env.world_size
        agree[0] = loss
        stop_rule.fill(agree, _STOP_AT, flag.local(step), flag.signum)
        if times is not None:
            agree[_AGREE_FIXED + self.env.rank] = times[0]
            agree[_AGREE_FIXED + world + self.env.rank] = times[1]
        stop_rule.all_reduce(agree)
        # One copy to the host for everything read (each element read is a sync on
        # an accelerator); the times only when they were filled in.
        values = (agree if times is not None else agree[:_AGREE_FIXED]).tolist()
        agreed = stop_rule.read(values, _STOP_AT)
        if agreed.signum is not None:
            self.stop_signal = agreed.signum
        ranks = None
        if times is not None:
            from .metrics import rank_times

            agree[_AGREE_FIXED:].zero_()  # the next unlogged step adds nothing
            per_rank = values[_AGREE_FIXED:]
            ranks = rank_times(per_rank[:world], per_rank[world:])
        return values[0] / world, agreed.stop, ranks

    def _diverged(self, step: int, loss: float) -> PermanentError | None:
        """The error that stops a run whose loss diverged at `step` (`loss` is the mean
        over ranks, so every rank decides alike); None while it has not, or when
        `train.on_divergence` is `continue`."""
        if self.spec.train.on_divergence == "continue":
            return None
        if math.isfinite(loss) and loss <= self.loss_ceiling:
            return None
        from .manifest import complete_candidates

        self.ckpt.wait()  # every rank alike: a save in the background is part of "kept"
        kept = complete_candidates(self.ckpt.storage)
        newest = f"{kept[0].name} is the newest checkpoint" if kept else "no checkpoint yet"
        bound = (
            f"at most {self.loss_ceiling:.1f}, {DIVERGED_LOSS_FACTOR:g} × ln(vocab_size)"
            if math.isfinite(self.loss_ceiling)
            else "a finite loss"
        )
        return PermanentError(
            f"the loss diverged at step {step}: {loss:.6g} (accepted: {bound}); stopped "
            f"with step {step}'s weights unsaved, {newest}. Lower train.lr "
            "(or raise train.warmup_steps, set train.clip), or set train.on_divergence: "
            "continue to train on"
        )

    def _arrived(self, t_last: float) -> float:
        """This rank's step time so far; on CUDA after the queued kernels ran (a host
        sync: called on logged steps only)."""
        if self.env.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.env.device)
        return time.perf_counter() - t_last

    def fit(self) -> tuple[int, int]:
        """Train until the last step or a preemption; (exit code, last step)."""
        from .metrics import MetricsLogger
        from .optim import lr_at

        spec, t, env = self.spec, self.spec.train, self.env
        metrics = MetricsLogger(
            self.run_dir.root,
            enabled=env.is_main,
            total_steps=t.steps,
            logging=spec.logging,
            job_name=spec.name,
        )
        flag = PreemptionFlag()
        flag.install()
        outcome = "failed"  # what the trackers record if the loop raises
        try:
            restored = self._restore()
            step = restored.step or 0
            self.state.step = step
            heartbeat.beat(step, "step")
            if env.is_main:
                # How far the previous attempt got, read before this one logs a step.
                record_restore(self.run_dir.root, restored, last_logged_step(self.run_dir.root))
            metrics.begin(step)  # rank 0: the trackers continue from this step
            if env.is_main:
                self.run_dir.preempted_file.unlink(missing_ok=True)
                metrics.info(
                    f"{spec.name}: {spec.strategy.backend} on {env.world_size} rank(s), "
                    f"{restored.words()}; {t.steps} steps in total"
                )
            # Everything built so far (libraries, model, data) lives until the end:
            # moved out of the cyclic GC's reach, a full collection during a step
            # does not walk it again (cheaper, fewer per-rank pauses to wait on).
            gc.collect()
            gc.freeze()
            scale = 1.0 / t.grad_accum
            every = spec.checkpoint.every_steps
            t_last = time.perf_counter()
            while step < t.steps:
                lr = lr_at(step, t)
                self.backend.set_lr(lr)
                loss_sum: Any = 0.0
                data_s = 0.0
                for micro in range(t.grad_accum):
                    t_data = time.perf_counter()
                    batch = self.data.next_batch()
                    data_s += time.perf_counter() - t_data
                    # Kept as a tensor: no host sync per micro-step on accelerators.
                    loss_sum = loss_sum + self.backend.micro_step(
                        batch, micro == t.grad_accum - 1, scale
                    )
                grad_norm = self.backend.step()  # clip → optimizer step → zero_grad
                step += 1
                self.state.step = step
                # Per-rank times ride along on the steps that will be logged anyway.
                timed = env.world_size > 1 and (step % t.log_every == 0 or step == t.steps)
                times = (self._arrived(t_last), data_s) if timed else None
                loss_avg, stop, ranks = self._agree_on(loss_sum / t.grad_accum, flag, step, times)
                heartbeat.beat(step)  # the node's watchdog: this rank advanced
                now = time.perf_counter()
                diverged = self._diverged(step, loss_avg)
                logged = step % t.log_every == 0 or step == t.steps or stop or diverged is not None
                if env.is_main and logged:
                    tps = self.tokens_per_step / max(now - t_last, 1e-9)
                    metrics.log(
                        step,
                        loss=loss_avg,
                        lr=lr,
                        grad_norm=grad_norm,
                        tokens_per_s=tps,
                        ranks=ranks,
                    )
                if diverged is not None:  # before its weights become a checkpoint
                    raise diverged
                save_s = 0.0
                if step % every == 0 or step == t.steps or stop:
                    final = step == t.steps or stop
                    save_s = time.perf_counter()
                    self.ckpt.save(step, self.state, final=final)
                    save_s = time.perf_counter() - save_s
                elif self.memory is not None and self.memory.enabled and self.memory.due(step):
                    # Between durable saves only: a durable save of this step is newer.
                    save_s = time.perf_counter()
                    self.memory.copy(step, self.state)
                    save_s = time.perf_counter() - save_s
                if stop:
                    self.ckpt.wait()
                    if self.memory is not None:  # the durable save is newer
                        self.memory.clear()
                    if env.is_main:
                        reason = flag.reason(self.stop_signal)
                        marker = preempted_marker(step, self.stop_signal, reason)
                        self.run_dir.write_marker(PREEMPTED_FILE, marker)
                        metrics.info(
                            f"preempted ({reason}): saved step {step}; "
                            f"exiting with code {EXIT_PREEMPTED}"
                        )
                    outcome = "preempted"
                    return EXIT_PREEMPTED, step
                # The next step's clock counts everything since this step's end (logging
                # included) except the time spent saving a checkpoint.
                t_last = time.perf_counter() - save_s
            self.ckpt.wait()
            if self.memory is not None:  # the final durable checkpoint is newer
                self.memory.clear()
            heartbeat.beat(step, "finish")  # consolidation (rank 0) is not a step
            outcome = "finished"
            return EXIT_OK, step
        finally:
            flag.uninstall()
            if self.memory is not None:
                self.memory.close()
            self.ckpt.close()
            metrics.close(outcome)


def _consolidate(spec: JobSpec, step: int) -> str:
    """Consolidate the final checkpoint into `<run_dir>/model`; the line to print."""
    from .consolidate import consolidate
    from .consolidate.outdir import foreign_entries, shown
    from .manifest import step_dirname

    ckpt: Path | str = Path(spec.checkpoint_dir) / step_dirname(step)
    if is_object_url(spec.checkpoint_dir):
        # The step's local copy (kept by its upload, else downloaded), verified as read.
        from shardctl.orchestrator.s3.local import fetch_checkpoint

        ckpt = f"{spec.checkpoint_dir.rstrip('/')}/{step_dirname(step)}"
        local = fetch_checkpoint(ckpt)
    else:
        local = ckpt
    out = RunDir.of(spec.run_dir).model
    foreign = foreign_entries(out)
    if foreign:
        # A run never deletes a user's files; the checkpoint is complete all the same.
        return (
            f"{spec.name}: not consolidating: {out} holds files shardctl did not write "
            f"({shown(foreign)}), left as they are; write the model elsewhere with: "
            f"shardctl consolidate {ckpt} --out NEW_FOLDER"
        )
    # force: a run continued with more steps replaces its own earlier model (a folder
    # holding only what a consolidation writes).
    consolidate(local, out, dtype=spec.checkpoint.consolidate_dtype, force=True)
    return f"{spec.name}: consolidated model written to {out}"


def run(spec: JobSpec) -> int:
    """Everything one rank does for a job; returns the process exit code."""
    if is_complete(spec):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{spec.name}: run complete (DONE in {spec.run_dir}); nothing to do", flush=True)
        return EXIT_OK
    # Every rank, before anything is built: a tracker the spec asks for is installed.
    from .trackers import check_installed

    check_installed(spec.logging)
    env = distributed.init(spec.resources.device, spec.world_size)
    heartbeat.beat(None, "start")
    try:
        # `auto` becomes one concrete precision here, before anything is built from it.
        spec = resolve_precision(spec, env)
        code, step = Trainer(spec, env).fit()
    except StorageError as exc:
        # A full, over-quota or read-only disk is as full on the next attempt: the
        # previous checkpoint is intact, and retrying would only rewrite it.
        raise PermanentError(str(exc)) from None
    finally:
        distributed.destroy()
    if code != EXIT_OK or not env.is_main:
        return code
    # Rank 0 alone, after the final save and outside the process group (no timeout
    # can fire on the other ranks while a large model is consolidated).
    if spec.checkpoint.consolidate_on_finish:
        print(_consolidate(spec, step), flush=True)
    RunDir.of(spec.run_dir).write_marker(DONE_FILE, done_marker(step))
    print(f"{spec.name}: finished {step} steps; checkpoints in {spec.checkpoint_dir}", flush=True)
    return EXIT_OK
