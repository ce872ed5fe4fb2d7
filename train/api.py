"""Checkpoints and preemption for your own training script (torch is the only need).

The same atomic checkpoints as `python -m shardctl.train` (`step-N.tmp/` → every
rank done → manifest with sizes and sha256 → one rename; retention; verified
resume) and the same preemption contract (SIGUSR2/SIGTERM → every rank saves the
same step → rank 0 writes `<run dir>/PREEMPTED` → every rank exits 42), for any loop:

    import torch.distributed as dist
    from shardctl.train import api

    ckpt = api.Checkpointer.from_env()      # under shardctl: dir, every_steps, keep, resume
    dist.init_process_group("gloo")         # (or api.init_distributed())
    model = build_model()                   # fully_shard(...) it, wrap it in DDP, or not
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = ckpt.resume(api.model_state(model, optimizer))   # 0 when nothing to resume
    for step in range(start + 1, args.steps + 1):
        loss = model(batch_for(step)).mean()                 # data: a function of step
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt.step_done(step)    # saves every `every_steps`; on a preemption signal
                                # (any rank): saves, PREEMPTED, exit 42 on every rank
    ckpt.finish(args.steps)     # final checkpoint (if not just saved), DONE marker

Steps count finished optimizer steps: checkpoint `step-N` holds the state after N
steps and `resume` returns N, so the loop runs step N+1 next.

Configuration (first found wins): the arguments of `from_env` / `Checkpointer`; the
run contract's environment (`SHARDCTL_CHECKPOINT_DIR`, `SHARDCTL_RUN_DIR`, and the
`checkpoint` section of the job spec at `SHARDCTL_SPEC`); the defaults of
`CheckpointConfig`. Outside shardctl (plain torchrun) give `directory=`.

What is saved: `resume(states, per_rank=...)` binds the state once (DCP and
DeepSpeed load in place, so the same objects are saved later). `states` is
sharded or replicated state, written once by all ranks together:
`model_state(model, optimizer)` (FSDP2 / DDP / plain module, through DCP, resumable on
any world size; other `Stateful`s may join it, e.g. an lr scheduler) or
`deepspeed_state(engine)` (DeepSpeed's own format). `per_rank` is what differs per
rank (a data position); each rank's RNG streams and the step are saved with it.

Do not retry: a permanent error (a bad config, a missing data set) that every retry
would repeat ends with `api.permanent_failure("why")` (any rank, no collective): it
records FAILED with the reason and exits `EXIT_DO_NOT_RETRY` (78). Any script that
exits 78 says the same. The run stops on every cluster (never requeued or restarted)
and `status` shows the reason.

Every method but `from_env`, `run_env` and `close` is a collective: all ranks call it,
in the same order.

Metrics: `log_metrics(step, loss=..., lr=...)` (every rank may call it; rank 0 writes)
appends to `<run dir>/logs/metrics.jsonl` and sends the same scalars to the trackers
of the spec's `logging:` section (TensorBoard, W&B, MLflow), as the built-in loop does.
With more than one rank, `step_done` also shares every rank's step time (from the
previous `step_done`'s return, or `resume`'s, to this call) in the agreement it already
makes, and the line gets step_s_min / step_s_median / step_s_max over ranks and
slowest_rank, each rank's times averaged over the steps since the previous line: the
numbers `shardctl status` reads to name a rank that is consistently the slowest.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from shardctl.orchestrator.errors import CheckpointError, PermanentError, UsageError
from shardctl.orchestrator.outcome import done_marker, preempted_marker
from shardctl.orchestrator.rundir import (
    DONE_FILE,
    ENV_ATTEMPT,
    ENV_CHECKPOINT_DIR,
    ENV_JOB_NAME,
    ENV_RUN_DIR,
    ENV_SPEC,
    EXIT_DO_NOT_RETRY,
    EXIT_PREEMPTED,
    PREEMPTED_FILE,
    RunDir,
)

from . import heartbeat as _heartbeat
from . import stop as stop_rule
from .api_states import DeepSpeedEngineState, RankState, Strategy, deepspeed_state, model_state
from .backends.base import Stateful
from .memory_tier import (
    MemoryTier,
    check_room,
    default_memory_dir,
    last_logged_step,
    record_restore,
    restore_newest,
)
from .preemption import PreemptionFlag

_IMPORTED = time.time()

__all__ = [
    "EXIT_DO_NOT_RETRY",
    "EXIT_PREEMPTED",
    "CheckpointConfig",
    "Checkpointer",
    "DeepSpeedEngineState",
    "DoNotRetry",
    "Preempted",
    "RunEnv",
    "Strategy",
    "close_metrics",
    "collective_timeout",
    "deepspeed_state",
    "heartbeat",
    "init_distributed",
    "log_metrics",
    "model_state",
    "permanent_failure",
    "run_env",
]


# ------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class RunEnv:
    """The run contract as this process sees it; every field None outside shardctl."""

    run_dir: str | None = None
    checkpoint_dir: str | None = None
    job_name: str | None = None
    attempt: int = 0
    """0 on the first start, +1 on each requeue or restart."""
    spec_path: str | None = None


def run_env(environ: Mapping[str, str] | None = None) -> RunEnv:
    """Read the SHARDCTL_* variables the launch script sets on every rank."""
    env = os.environ if environ is None else environ

    def get(name: str) -> str | None:
        return env.get(name) or None  # an empty variable is an unset one

    raw_attempt = get(ENV_ATTEMPT) or "0"
    try:
        attempt = int(raw_attempt)
    except ValueError:
        raise UsageError(f"{ENV_ATTEMPT}={raw_attempt!r} is not an integer") from None
    return RunEnv(
        run_dir=get(ENV_RUN_DIR),
        checkpoint_dir=get(ENV_CHECKPOINT_DIR),
        job_name=get(ENV_JOB_NAME),
        attempt=attempt,
        spec_path=get(ENV_SPEC),
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """What `CheckpointManager` needs (the attribute names of the spec's `checkpoint`
    section), plus `every_steps` for `step_done`."""

    dir: str
    every_steps: int = 100
    """Steps between periodic checkpoints (`step_done` saves when step % every_steps == 0)."""
    keep: int = 3
    """Complete checkpoints kept; at least 2: the newest may still be being written."""
    async_save: bool = False
    """Stage the state and write it in the background (DCP only)."""
    resume: str = "auto"
    """`auto` (newest complete checkpoint), `never`, or the path of one step folder."""
    memory_every_steps: int | None = None
    """The memory tier (`shardctl.train.memory_tier`): a copy in node-local memory every
    K steps (on more than one node also held in the partner node's memory,
    `shardctl.train.memory_partner`), 1 to every_steps - 1; None: off."""
    memory_dir: str | None = None
    """Where the memory copies go; None: `/dev/shm/shardctl/<job>-<hash of the run dir>`."""

    def __post_init__(self) -> None:
        if not str(self.dir).strip():
            raise UsageError("checkpoint directory is empty; give a folder for step-N checkpoints")
        if not (isinstance(self.every_steps, int) and self.every_steps >= 1):
            raise UsageError(f"every_steps={self.every_steps!r}; accepted: an integer >= 1")
        if not (isinstance(self.keep, int) and self.keep >= 2):
            raise UsageError(
                f"keep={self.keep!r}; accepted: an integer >= 2 (the newest checkpoint may "
                "still be being written when an older one is needed)"
            )
        if not str(self.resume).strip():
            raise UsageError(
                "resume is empty; accepted: 'auto', 'never' or the path of a step folder"
            )
        k = self.memory_every_steps
        if k is not None and not (
            isinstance(k, int) and not isinstance(k, bool) and 1 <= k < self.every_steps
        ):
            raise UsageError(
                f"memory_every_steps={k!r}; accepted: an integer from 1 to every_steps - 1 "
                f"({self.every_steps - 1}): a memory copy is only worth its cost between "
                "durable checkpoints; or None (memory tier off)"
            )


def _load_spec(path: str) -> Any:
    from shardctl.orchestrator.spec import read_job_yaml

    return read_job_yaml(path)


def _spec_strategy(spec: Any) -> Strategy:
    s = spec.strategy
    # `auto` is resolved by the built-in loop only; a script's real precision is unknown.
    precision = None if s.precision == "auto" else s.precision
    return Strategy(s.sharding, s.zero_stage, precision)


# ------------------------------------------------------------------ the library


class Preempted(SystemExit):
    """Raised on every rank after a preemption save; exits the process with code 42
    unless caught (catch it to clean up, then re-raise)."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.step, self.reason = step, reason


class DoNotRetry(SystemExit):
    """Raised by `permanent_failure`: exits the process with `EXIT_DO_NOT_RETRY` (78)."""

    def __init__(self, reason: str) -> None:
        super().__init__(EXIT_DO_NOT_RETRY)
        self.reason = reason


def permanent_failure(reason: str) -> NoReturn:
    """Stop the run for good: a permanent error every retry would repeat (a bad
    config). Records `<run dir>/FAILED` with code 78 and `reason` (the first rank to
    fail wins; `shardctl status` shows it), then raises `DoNotRetry`, which exits 78
    unless caught. Not a collective: any rank may call it."""
    from shardctl.orchestrator.outcome import failed_marker

    from .entry import write_failed

    env = run_env()
    rank = int(os.environ.get("RANK", "0") or 0)
    if env.run_dir:
        # This attempt began before this module was imported: a FAILED from before is stale.
        marker = failed_marker(EXIT_DO_NOT_RETRY, rank, reason)
        write_failed(RunDir.of(env.run_dir), _IMPORTED, marker)
    _say(f"do not retry: {reason}; exiting with code {EXIT_DO_NOT_RETRY}")
    raise DoNotRetry(reason)


class Checkpointer:
    """Periodic, final and preemption checkpoints of a user training loop.

    Construct it early on every rank: it installs the SIGUSR2/SIGTERM handlers, so a
    signal that arrives while the model is still being built stops the run at its
    first step instead of killing it unsaved. `close()` (or `finish`) puts the previous
    handlers back.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        run_dir: str | Path | None = None,
        strategy: Strategy | None = None,
        model_meta: dict[str, Any] | None = None,
        seed: int = 0,
        rng: bool = True,
        install_signals: bool = True,
        env: RunEnv | None = None,
    ) -> None:
        self.config = config
        self.run_dir = RunDir.of(run_dir) if run_dir is not None else None
        self.strategy = strategy or Strategy()
        self.model_meta = model_meta
        self.seed, self.rng = seed, rng
        self.env = env or RunEnv()
        self.flag = PreemptionFlag()
        if install_signals:
            self.flag.install()
        self._manager: Any = None
        self._memory: MemoryTier | None = None
        self._rank_state: RankState | None = None
        self._agree: Any = None
        self._agree_group: Any = None
        self._saved_step: int | None = None
        self._t_returned = time.perf_counter()
        self.rank, self.world_size = 0, 1

    @classmethod
    def from_env(
        cls,
        *,
        directory: str | Path | None = None,
        default_directory: str | Path | None = None,
        every_steps: int | None = None,
        keep: int | None = None,
        async_save: bool | None = None,
        resume: str | None = None,
        memory_every_steps: int | None = None,
        memory_dir: str | Path | None = None,
        run_dir: str | Path | None = None,
        **kwargs: Any,
    ) -> Checkpointer:
        """Configure from the arguments, then the run contract, then the defaults.

        The directory: `directory`, else `$SHARDCTL_CHECKPOINT_DIR`, else the spec's
        checkpoint dir, else `default_directory` (a script's own default for runs
        outside shardctl). The rest (every_steps, keep, async, resume, the memory
        tier's memory_every_steps and memory_dir): the argument, else the spec's
        `checkpoint` section, else `CheckpointConfig`'s default.
        The run dir (where PREEMPTED/DONE go; none: no markers): `run_dir`, else
        `$SHARDCTL_RUN_DIR`, else the spec's. Other keywords go to `Checkpointer`.
        """
        env = run_env()
        spec = _load_spec(env.spec_path) if env.spec_path else None
        section = spec.checkpoint if spec is not None else None
        where = (
            directory
            or env.checkpoint_dir
            or (spec.checkpoint_dir if spec is not None else None)
            or default_directory
        )
        if where is None:
            raise UsageError(
                "no checkpoint directory: outside shardctl give Checkpointer.from_env("
                f"directory=...); under shardctl the launch script sets ${ENV_CHECKPOINT_DIR}"
            )

        def pick(arg: Any, name: str) -> Any:
            if arg is not None:
                return arg
            if section is not None:
                return getattr(section, name)
            return CheckpointConfig.__dataclass_fields__[name].default

        config = CheckpointConfig(
            dir=str(where),
            every_steps=pick(every_steps, "every_steps"),
            keep=pick(keep, "keep"),
            async_save=pick(async_save, "async_save"),
            resume=pick(resume, "resume"),
            memory_every_steps=pick(memory_every_steps, "memory_every_steps"),
            memory_dir=_text_or_none(pick(memory_dir, "memory_dir")),
        )
        where_run = run_dir or env.run_dir or (spec.run_dir if spec is not None else None)
        if spec is not None:
            kwargs.setdefault("strategy", _spec_strategy(spec))
        return cls(config, run_dir=where_run, env=env, **kwargs)

    # -- the session ---------------------------------------------------------------

    def resume(
        self, states: Mapping[str, Any], *, per_rank: Mapping[str, Stateful] | None = None
    ) -> int:
        """Bind `states` (and `per_rank`), load the checkpoint `config.resume` picks
        into them, and return its step; 0 when training starts from scratch.

        Call it once, after the process group exists (when WORLD_SIZE > 1) and the
        model and optimizer are built (and sharded): DCP loads into them in place.
        A damaged newest checkpoint (a `.tmp` leftover, a file that fails its hash) is
        skipped for the previous complete one.
        """
        if self._manager is not None:
            raise UsageError("resume() was already called; it binds the state once per run")
        import torch

        from .checkpoint import CheckpointManager

        self.rank, self.world_size = _rank_and_world()
        io = _state_io(states, self.strategy)
        self._rank_state = RankState(per_rank or {}, rng=self.rng, seed=self.seed, rank=self.rank)
        self._manager = CheckpointManager(
            self.config,
            io,
            rank=self.rank,
            world_size=self.world_size,
            model_meta=self.model_meta,
        )
        # [the stop agreement's slots, then the step time of rank 0..W-1 (each rank
        # fills its own slot)]:
        # one small all-reduce per step, on a gloo group of its own: the manager's
        # group carries an async save's collectives from a background thread, and two
        # threads on one group could order them differently per rank; the default
        # group may be NCCL, which wants a CUDA tensor.
        self._agree = torch.zeros(_AGREE_FIXED + self.world_size, dtype=torch.float64)
        self._agree_group = _own_gloo_group()
        if self.world_size > 1:
            global _step_times
            _step_times = _StepTimes(self.world_size)
        self._memory = self._memory_tier(io, states)
        restored = restore_newest(self._manager, self._memory, self._rank_state)
        step = restored.step or 0
        if self.rank == 0 and self.run_dir is not None:
            record_restore(self.run_dir.root, restored, last_logged_step(self.run_dir.root))
        self._rank_state.step = step
        _heartbeat.beat(step, "step")
        self._saved_step = step or None  # finish(step) right away need not save again
        if self.rank == 0:
            if self.run_dir is not None:  # this start supersedes the last preemption
                self.run_dir.preempted_file.unlink(missing_ok=True)
            _say(f"{restored.words()} (checkpoints in {self.config.dir})")
        self._t_returned = time.perf_counter()  # the first step's time starts here
        return step

    def step_done(self, step: int) -> bool:
        """After optimizer step `step`: agree with every rank on a preemption signal;
        save when `step % every_steps == 0`; when any rank was signalled, save and stop
        (`stop`: PREEMPTED, exit 42 everywhere). Returns whether it saved.

        The same all-reduce carries every rank's step time: from the previous call's
        return (a save inside it left out) to this call. Ranks wait for each other in
        the model's own collectives (DDP/FSDP gradient reductions), so a slow rank
        stands out by what it does after the last of them (the optimizer step,
        logging, evaluation) and before the first (loading its batch shows as the
        others waiting)."""
        manager = self._need_manager("step_done")
        self._rank_state.step = step  # type: ignore[union-attr]
        stop, signum = self._agree_to_stop(step, time.perf_counter() - self._t_returned)
        _heartbeat.beat(step)  # the node's watchdog: this rank advanced
        if stop:
            self.stop(step, reason=self.flag.reason(signum), signal=signum)
        saved = step % self.config.every_steps == 0
        if saved:
            manager.save(step, self._rank_state)
            self._saved_step = step
        elif self._memory is not None and self._memory.enabled and self._memory.due(step):
            self._memory.copy(step, self._rank_state)  # between durable saves only
        self._t_returned = time.perf_counter()
        return saved

    def stop(
        self, step: int, reason: str = "stopped by the script", *, signal: int | None = None
    ) -> None:
        """Save `step` (blocking), rank 0 writes PREEMPTED {"kind", "step", "signal",
        "reason"} (`signal`: the one that stopped the ranks, if one did), and every rank
        raises `Preempted` (exit code 42: "saved, resume me")."""
        manager = self._need_manager("stop")
        self._rank_state.step = step  # type: ignore[union-attr]
        if self._saved_step != step:
            manager.save(step, self._rank_state, final=True)
        manager.wait()
        self._clear_memory()
        self._saved_step = step
        if self.rank == 0:
            if self.run_dir is not None:
                self.run_dir.write_marker(PREEMPTED_FILE, preempted_marker(step, signal, reason))
            _say(f"preempted ({reason}): saved step {step}; exiting with code {EXIT_PREEMPTED}")
            close_metrics("preempted")
        # Leave together, once the marker exists: a launcher tears down the other ranks
        # as soon as one exits, and a rank killed then reports a signal, not 42.
        if self._agree_group is not None:
            import torch.distributed as dist

            dist.barrier(group=self._agree_group)
        self.close()
        raise Preempted(step, reason)

    def finish(self, step: int) -> None:
        """Save the final `step` (unless `step_done` just did), wait for it, rank 0
        writes DONE {"step"}; then `close`."""
        manager = self._need_manager("finish")
        self._rank_state.step = step  # type: ignore[union-attr]
        if self._saved_step != step:
            manager.save(step, self._rank_state, final=True)
            self._saved_step = step
        manager.wait()
        self._clear_memory()
        _heartbeat.beat(step, "finish")
        if self.rank == 0:
            if self.run_dir is not None:
                self.run_dir.write_marker(DONE_FILE, done_marker(step))
            _say(f"finished at step {step}; checkpoints in {self.config.dir}")
        self.close()

    def close(self) -> None:
        """Wait for a background save, release staging memory, restore the signal
        handlers. Idempotent; not a collective."""
        self.flag.uninstall()
        if self._memory is not None:
            memory, self._memory = self._memory, None
            memory.close()
        if self._manager is not None:
            manager, self._manager = self._manager, None
            manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------

    def _clear_memory(self) -> None:
        """The memory copies are older than the durable save just made: free them."""
        if self._memory is not None:
            self._memory.clear()

    def _memory_tier(self, io: Any, states: Mapping[str, Any]) -> MemoryTier | None:
        """The memory tier when `memory_every_steps` is set (a collective), its tmpfs
        checked for room before the first step."""
        k = self.config.memory_every_steps
        if k is None:
            return None
        where = self.config.memory_dir or default_memory_dir(
            self.env.job_name or "script", self.run_dir.root if self.run_dir else self.config.dir
        )
        memory = MemoryTier(
            k, where, io, rank=self.rank, world_size=self.world_size, model_meta=self.model_meta,
            run_dir=self.run_dir.root if self.run_dir is not None else None,
        )  # fmt: skip
        parameters = _parameters_of(states)
        try:
            if parameters is not None:
                check_room(memory, parameters)
        except PermanentError as exc:  # the same tmpfs on every retry
            permanent_failure(str(exc))
        return memory

    def _need_manager(self, what: str) -> Any:
        if self._manager is None:
            raise UsageError(
                f"{what}() before resume(states): resume binds the state to checkpoint "
                "(it returns 0 when there is nothing to resume); or after finish/close"
            )
        return self._manager

    def _agree_to_stop(self, step: int, step_s: float = 0.0) -> tuple[bool, int | None]:
        """Whether the ranks stop after `step`, and the signal that names it (the one
        agreement, `shardctl.train.stop`); every rank gets the same answer. `step_s`:
        this rank's step time, shared with every rank in the same all-reduce (kept for
        `log_metrics`)."""
        agree = self._agree
        agree.zero_()  # the other ranks' times of the previous step
        stop_rule.fill(agree, 0, self.flag.local(step), self.flag.signum)
        agree[_AGREE_FIXED + self.rank] = step_s
        if self._agree_group is not None:
            stop_rule.all_reduce(agree, group=self._agree_group)
        if self.world_size > 1 and _step_times is not None:
            _step_times.add(agree[_AGREE_FIXED:].tolist())
        agreed = stop_rule.read(agree[:_AGREE_FIXED].tolist())
        return agreed.stop, agreed.signum


# The agreement buffer: the stop agreement's slots (`shardctl.train.stop`), then the
# per-rank step times.
_AGREE_FIXED = stop_rule.SLOTS


class _StepTimes:
    """Every rank's step time summed over the steps since the last `log_metrics` line
    (fed by `step_done` with more than one rank; read by rank 0's `log_metrics`)."""

    def __init__(self, world_size: int) -> None:
        self.sums = [0.0] * world_size
        self.steps = 0

    def add(self, per_rank: list[float]) -> None:
        self.sums = [a + b for a, b in zip(self.sums, per_rank, strict=True)]
        self.steps += 1

    def take(self) -> dict[str, float | int] | None:
        """The per-rank fields of the next metrics line (each rank's mean step time),
        and start over; None when no step was done since the last line."""
        if not self.steps:
            return None
        from .metrics import rank_times

        means = [total / self.steps for total in self.sums]
        self.sums, self.steps = [0.0] * len(self.sums), 0
        return rank_times(means)


_step_times: _StepTimes | None = None  # the Checkpointer's, once resume() knows the world


def _text_or_none(value: Any) -> str | None:
    return str(value) if value is not None else None


def _parameters_of(states: Mapping[str, Any]) -> Any:
    """The parameters of the model in `states` (a `model_state` view or a DeepSpeed
    engine), for the memory tier's size estimate; None when there is no model."""
    for view in states.values():
        engine = getattr(view, "engine", None)
        model = getattr(view, "model", None) or getattr(engine, "module", None)
        if model is not None and hasattr(model, "parameters"):
            return model.parameters()
    return None


def _state_io(states: Mapping[str, Any], strategy: Strategy) -> Any:
    from .api_states import state_io

    return state_io(states, strategy)


def _own_gloo_group() -> Any:
    """A new gloo group of every rank (a collective), or None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


def _rank_and_world() -> tuple[int, int]:
    """From the process group when there is one, else the launcher's variables; a
    multi-rank launch without a process group cannot agree on anything."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from .distributed import read_env

    rank, world, _, _ = read_env()
    if world > 1:
        raise CheckpointError(
            f"WORLD_SIZE={world} but no process group exists; call "
            "torch.distributed.init_process_group() (or api.init_distributed()) before resume()"
        )
    return rank, world


def _say(text: str) -> None:
    # Scripts rarely configure logging; these few lines must reach the job log.
    print(f"[shardctl] {text}", file=sys.stderr, flush=True)


def heartbeat(step: int | None = None, phase: str = "step") -> None:
    """Tell the node's watchdog this rank is alive and advancing, outside `step_done`:
    call it in a long evaluation (`phase="eval"`) or any phase that runs longer than the
    hang timeout without steps. `step`: the last finished step (None: unchanged).
    A no-op outside shardctl."""
    _heartbeat.beat(step, phase)


def collective_timeout() -> timedelta:
    """The spec's `watchdog.collective_timeout_s` as a timedelta (30 minutes outside
    shardctl): pass it to your own `init_process_group(timeout=...)`, or to
    `TrainingArguments(ddp_timeout=int(collective_timeout().total_seconds()))`.
    `init_distributed` uses it already."""
    from .distributed import collective_timeout as timeout

    return timeout()


def init_distributed(device: str | None = None) -> Any:
    """Join the process group from the launcher's variables (gloo on CPU, NCCL on
    CUDA; `device` defaults to cuda when available) and return a `DistEnv` (rank,
    world_size, local_rank, device). A world of one also gets a group."""
    import torch

    from .distributed import init

    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return init(kind)


# ------------------------------------------------------------------ metrics

_metrics: Any = None  # rank 0's MetricsLogger, made by the first log_metrics
_metrics_ready = False  # log_metrics has decided (a logger, or nothing on this rank)
_metrics_started = 0.0
_metrics_opened = False  # begin() ran and close_metrics is registered at exit


def log_metrics(step: int, scalars: Mapping[str, Any] | None = None, /, **more: Any) -> None:
    """Log scalars at `step`: rank 0 appends a line to `<run dir>/logs/metrics.jsonl`
    (so `shardctl plot` works) and sends them to the spec's trackers (`logging:`:
    TensorBoard under `<run dir>/tensorboard` by default, W&B, MLflow); other ranks
    return at once. Values are numbers or one-element tensors; not a collective.
    With more than one rank and a `Checkpointer`, the line also holds step_s_min /
    step_s_median / step_s_max and slowest_rank over the steps `step_done` saw since
    the previous line (your own scalars of those names win).

        api.log_metrics(step, loss=loss.item(), lr=scheduler.get_last_lr()[0])

    The first call reads the run contract (`SHARDCTL_RUN_DIR`, the spec at
    `SHARDCTL_SPEC`) and opens the trackers; outside shardctl (no run dir) nothing is
    written, with one warning. The trackers are closed at exit, or by `close_metrics`.
    """
    logger = _default_metrics()
    if logger is None:
        return
    values: dict[str, float] = {}
    for key, value in {**(scalars or {}), **more}.items():
        try:
            values[str(key)] = float(value)
        except (TypeError, ValueError):
            raise UsageError(
                f"log_metrics: {key}={value!r} is not a number; accepted: int, float or a "
                "one-element tensor"
            ) from None
    global _metrics_opened
    if not _metrics_opened:  # the first line: the trackers continue after `step - 1`
        _metrics_opened = True
        logger.begin(max(step - 1, 0))
        import atexit

        # Registered after the trackers opened: atexit runs last-in first-out, so this
        # drains the queue before W&B's own exit hook tears its run down.
        atexit.register(close_metrics)
    ranks = _step_times.take() if _step_times is not None else None
    logger.log_scalars(step, {**(ranks or {}), **values})


def close_metrics(outcome: str | None = None) -> None:
    """Flush and close `log_metrics`' file and trackers (at exit this happens by itself).
    `outcome`: finished, preempted or failed (what MLflow and W&B record); by default
    read from the run's markers (FAILED, PREEMPTED) written since the process started."""
    global _metrics
    logger, _metrics = _metrics, None
    if logger is None:
        return
    if outcome is None:
        outcome = _outcome_from_markers(logger.run_dir)
    logger.close(outcome)


def _outcome_from_markers(run_dir: Path) -> str:
    """What the trackers record, from the markers written since the process started,
    as the one classifier reads them (`shardctl.orchestrator.outcome`)."""
    from shardctl.orchestrator.outcome import Evidence, Kind, classify

    kind = classify(Evidence.gather(run_dir, _metrics_started, None)).kind
    if kind in (Kind.FAILED, Kind.PERMANENT):
        return "failed"
    return "preempted" if kind in (Kind.PREEMPTED, Kind.CANCELLED) else "finished"


def _metrics_rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0") or 0)


def _default_metrics() -> Any:
    global _metrics, _metrics_ready, _metrics_started
    if _metrics_ready:
        return _metrics
    _metrics_ready = True
    _metrics_started = time.time()
    env = run_env()
    spec = _load_spec(env.spec_path) if env.spec_path else None
    if spec is not None:  # every rank: a missing tracker package stops them all
        from .trackers import check_installed

        check_installed(spec.logging)
    if _metrics_rank() != 0:
        return None
    run_dir = env.run_dir or (spec.run_dir if spec is not None else None)
    if run_dir is None:
        _say(
            f"log_metrics: no run directory (${ENV_RUN_DIR} is unset outside shardctl); "
            "metrics are not written"
        )
        return None
    from .metrics import MetricsLogger

    _metrics = MetricsLogger(
        run_dir,
        enabled=True,
        total_steps=0,
        logging=spec.logging if spec is not None else None,
        job_name=(spec.name if spec is not None else None) or env.job_name,
        console=False,
    )
    return _metrics
