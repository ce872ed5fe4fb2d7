"""Your own Hugging Face `Trainer` script under shardctl: preemption and resume.

Two lines make a Trainer script stop and resume like shardctl's own loop::

    trainer = Trainer(..., callbacks=[PreemptionCallback()])
    trainer.train(resume_from_checkpoint=last_complete_checkpoint(args.output_dir))

`PreemptionCallback`: SIGUSR2 or SIGTERM on any rank sets a flag (nothing else
happens in the handler). At the next optimizer-step boundary every rank all-reduces
the flag, so all of them agree to stop after the same step even when only one was
signalled; the Trainer then saves `checkpoint-N` as usual, rank 0 writes
`<run dir>/PREEMPTED` (`{"step": N, "reason"}`) and every rank exits with
`EXIT_PREEMPTED` (42). Without a signal it does nothing but that one all-reduce of
two integers per optimizer step. `SHARDCTL_STOP_AFTER_STEP` (the testing aid of
`shardctl.train.preemption`) works here too.

`last_complete_checkpoint`: the newest `checkpoint-N` of a Trainer output folder
that can really be resumed from. transformers' `get_last_checkpoint` takes the
highest N, complete or not, and `trainer.train` then crashes on a folder that was
cut off mid-save (the job was killed during the save, or the grace period ran out).

This is the one shardctl module that imports transformers; it needs nothing else
of shardctl's training extras.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any

from shardctl.orchestrator.outcome import TRAINER_OUTPUT_FILE, preempted_marker
from shardctl.orchestrator.rundir import ENV_RUN_DIR, EXIT_PREEMPTED, PREEMPTED_FILE, RunDir
from shardctl.train import heartbeat
from shardctl.train import stop as stop_rule
from shardctl.train.preemption import SIGNALS, PreemptionFlag, expect_handler
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

__all__ = [
    "PreemptionCallback",
    "checkpoint_problem",
    "last_complete_checkpoint",
    "prepare_unmodified",
]

logger = logging.getLogger(__name__)

# transformers keeps these in `transformers.trainer`, whose import costs seconds and
# pulls in accelerate; tests/test_hf.py checks that they are still the Trainer's names.
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
# accelerate's FSDP files (accelerate.utils.constants: FSDP_MODEL_NAME, OPTIMIZER_NAME).
FSDP_MODEL_PREFIX = "pytorch_model_fsdp"
FSDP_OPTIMIZER_PREFIX = "optimizer"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint writes it after every rank's data
DEEPSPEED_LATEST = "latest"  # DeepSpeed writes it after every rank's shards (a barrier)

_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


# -- resume ---------------------------------------------------------------------------


def last_complete_checkpoint(
    output_dir: str | os.PathLike[str], *, require_optimizer: bool = True
) -> str | None:
    """The newest complete `checkpoint-N` in `output_dir`, or None when there is none.

    Give the result to `trainer.train(resume_from_checkpoint=...)`: None starts from
    scratch. A torn checkpoint (see `checkpoint_problem`) is skipped with a warning
    and the next older one is tried. `require_optimizer=False` is for runs with
    `save_only_model=True`, whose checkpoints hold no optimizer by design.

    Every rank may call it: it only reads, and all ranks see the same folders.
    """
    root = Path(output_dir)
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return None
    steps = []
    for entry in entries:
        match = _CHECKPOINT_RE.match(entry.name)
        if match and entry.is_dir():
            steps.append((int(match.group(1)), entry))
    for _step, path in sorted(steps, reverse=True):
        problem = checkpoint_problem(path, require_optimizer=require_optimizer)
        if problem is None:
            return str(path)
        logger.warning("skipping torn checkpoint %s: %s", path, problem)
    return None


def checkpoint_problem(
    path: str | os.PathLike[str], *, require_optimizer: bool = True
) -> str | None:
    """Why `trainer.train` could not resume from `path`, or None when it can.

    What `Trainer._save_checkpoint` writes (transformers 4.45 … 5.x), rank 0 unless said:

    - model weights, one of: `model.safetensors`; `pytorch_model.bin`; a sharded
      `*.index.json` and its shard files; `adapter_model.*` (PEFT); FSDP through
      accelerate: `pytorch_model_fsdp.bin` (FULL_STATE_DICT) or the DCP folder
      `pytorch_model_fsdp_0/` (SHARDED_STATE_DICT, every rank); DeepSpeed:
      `global_stepN/` (every rank) named by `latest`.
    - the optimizer (not with `save_only_model`): `optimizer.pt`; FSDP `optimizer.bin`
      or the DCP folder `optimizer_0/`; DeepSpeed's `global_stepN/`.
    - `scheduler.pt`, `scaler.pt` (mixed precision), `rng_state[_<rank>].pth` (every
      rank), then `trainer_state.json` last of rank 0's files.

    Only rank 0's files are ordered: another rank may still be writing its RNG state
    when `trainer_state.json` appears, so every file present is checked for being
    whole, not only the last one. The checks read headers and directory entries,
    never whole tensors, so they take milliseconds on checkpoints of any size.
    """
    path = Path(path)
    match = _CHECKPOINT_RE.match(path.name)
    step = int(match.group(1)) if match else None
    problem = _state_problem(path / TRAINER_STATE_NAME, step)
    if problem:
        return problem
    has_deepspeed, problem = _deepspeed_files(path)
    if problem:
        return problem

    weights = _present(path, _weight_checks())
    for name, check in weights:
        problem = check(path / name)
        if problem:
            return f"{name}: {problem}"
    if not weights and not has_deepspeed:
        return "no model weights (model.safetensors, pytorch_model*.bin, FSDP or DeepSpeed files)"

    optimizers = _present(path, _optimizer_checks())
    for name, check in optimizers:
        problem = check(path / name)
        if problem:
            return f"{name}: {problem}"
    if require_optimizer and not optimizers and not has_deepspeed:
        return "no optimizer state (optimizer.pt, optimizer.bin, optimizer_0/, DeepSpeed files)"

    # Optional files, but a torn one makes torch.load fail on resume.
    for entry in sorted(path.iterdir()):
        if entry.name in (SCHEDULER_NAME, SCALER_NAME) or re.fullmatch(
            r"rng_state(_\d+)?\.pth", entry.name
        ):
            problem = _torch_file_problem(entry)
            if problem:
                return f"{entry.name}: {problem}"
    return None


def _state_problem(state_file: Path, step: int | None) -> str | None:
    try:
        state = json.loads(state_file.read_text())
    except FileNotFoundError:
        return f"no {TRAINER_STATE_NAME} (the save did not finish)"
    except (OSError, ValueError) as exc:
        return f"{TRAINER_STATE_NAME} is unreadable ({exc})"
    if not isinstance(state, dict):
        return f"{TRAINER_STATE_NAME} is not a JSON object"
    if step is not None and state.get("global_step") != step:
        return f"{TRAINER_STATE_NAME} says global_step {state.get('global_step')}, not {step}"
    return None


def _deepspeed_files(path: Path) -> tuple[bool, str | None]:
    """(whether DeepSpeed saved here, what is wrong with its files)."""
    tags = [p for p in path.glob("global_step*") if p.is_dir()]
    if not tags:
        return False, None
    try:
        tag = (path / DEEPSPEED_LATEST).read_text().strip()
    except OSError:
        names = sorted(p.name for p in tags)
        return True, f"DeepSpeed folders {names} but no '{DEEPSPEED_LATEST}' file"
    if not tag or not (path / tag).is_dir() or not any((path / tag).iterdir()):
        return True, f"'{DEEPSPEED_LATEST}' names {tag!r}, which is missing or empty"
    return True, None


def _weight_checks() -> list[tuple[str, Any]]:
    return [
        (SAFE_WEIGHTS_NAME, _safetensors_problem),
        (WEIGHTS_NAME, _torch_file_problem),
        (SAFE_WEIGHTS_INDEX_NAME, _index_problem),
        (WEIGHTS_INDEX_NAME, _index_problem),
        (ADAPTER_SAFE_WEIGHTS_NAME, _safetensors_problem),
        (ADAPTER_WEIGHTS_NAME, _torch_file_problem),
        (f"{FSDP_MODEL_PREFIX}.bin", _torch_file_problem),
        (f"{FSDP_MODEL_PREFIX}_0", _dcp_problem),
        (f"{FSDP_MODEL_PREFIX}_rank*.bin", _torch_file_problem),  # use_dcp=False
    ]


def _optimizer_checks() -> list[tuple[str, Any]]:
    return [
        (OPTIMIZER_NAME, _torch_file_problem),
        (f"{FSDP_OPTIMIZER_PREFIX}.bin", _torch_file_problem),
        (f"{FSDP_OPTIMIZER_PREFIX}_0", _dcp_problem),
        (f"{FSDP_OPTIMIZER_PREFIX}_0_rank*.bin", _torch_file_problem),  # use_dcp=False
        (f"rank*-of-*-{OPTIMIZER_NAME}", _torch_file_problem),  # XLA FSDP
    ]


def _present(path: Path, checks: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The (file name, check) pairs whose file exists; glob patterns expand."""
    out = []
    for pattern, check in checks:
        if "*" in pattern:
            out.extend((p.name, check) for p in sorted(path.glob(pattern)))
        elif (path / pattern).exists():
            out.append((pattern, check))
    return out


def _torch_file_problem(path: Path) -> str | None:
    # torch.save writes a zip archive whose central directory comes last: a file
    # cut off anywhere before its end has none.
    if not path.is_file():
        return "not a file"
    if not zipfile.is_zipfile(path):
        return "truncated or not a torch.save archive"
    return None


def _safetensors_problem(path: Path) -> str | None:
    # An 8-byte header length, a JSON header with each tensor's byte range, then the
    # data: a whole file is exactly as long as the header says.
    try:
        with path.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        size = path.stat().st_size
    except (OSError, ValueError, struct.error) as exc:
        return f"unreadable safetensors header ({exc})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        return f"{size} bytes where its header describes {expected}"
    return None


def _index_problem(path: Path) -> str | None:
    try:
        shards = set(json.loads(path.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable index ({exc})"
    for shard in sorted(shards):
        check = _safetensors_problem if shard.endswith(".safetensors") else _torch_file_problem
        problem = check(path.parent / shard) if (path.parent / shard).exists() else "missing"
        if problem:
            return f"shard {shard}: {problem}"
    return None


def _dcp_problem(path: Path) -> str | None:
    if not (path / DCP_METADATA).is_file():
        return f"no {DCP_METADATA} (torch.distributed.checkpoint did not finish)"
    return None


# -- an unmodified script ---------------------------------------------------------------

# Whether no `train()` of this process has been prepared yet: a later one (a second
# training in the same script) starts where the script says, not from a checkpoint.
_first_train = True


def prepare_unmodified(
    trainer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What `Trainer.train(*args, **kwargs)` gets under shardctl when the script was
    not patched (`shardctl.train.hf_auto` calls this from the wrapped `train`):

    - no `resume_from_checkpoint` given (or None): the newest complete `checkpoint-N`
      of `trainer.args.output_dir` (`last_complete_checkpoint`), if there is one. A
      path, True or False given by the script is kept as it is. Only the process's
      first `train()` (a job's restart starts there); not in a hyperparameter
      search (`trial`), not with `save_only_model` (such checkpoints cannot resume).
    - a `PreemptionCallback` added last, unless the script added one itself.
    """
    global _first_train
    first, _first_train = _first_train, False
    if not any(isinstance(cb, PreemptionCallback) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(PreemptionCallback())
    given = args[0] if args else kwargs.get("resume_from_checkpoint")
    trial = args[1] if len(args) > 1 else kwargs.get("trial")
    output_dir = getattr(trainer.args, "output_dir", None)
    if not first or given is not None or trial is not None or not output_dir:
        return args, kwargs
    if getattr(trainer.args, "save_only_model", False):
        return args, kwargs
    found = last_complete_checkpoint(output_dir)
    if found is None:
        return args, kwargs
    if trainer.is_world_process_zero():  # one line in the log, whatever logging says
        print(
            f"shardctl: resuming from {found}, the newest complete checkpoint in "
            f"{output_dir} (entrypoint.hf_trainer_auto: false turns this off)",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    if args:
        return (found, *args[1:]), kwargs
    return args, {**kwargs, "resume_from_checkpoint": found}


# -- preemption -----------------------------------------------------------------------


class PreemptionCallback(TrainerCallback):
    """Stop signal on any rank → every rank saves the same step → PREEMPTED, exit 42.

    `run_dir` is where PREEMPTED goes: by default `$SHARDCTL_RUN_DIR`, else the
    Trainer's `output_dir`. The process exits from `on_save`, right after the save,
    so that nothing else (an end-of-epoch evaluation, loading the best model, the
    user's code after `trainer.train()`) eats into the grace period before the
    kill; callbacks listed after this one get no `on_save` for that last save, so
    put it last when another callback must see it (an uploader, say).

    A signal that arrives after the last step (during the final save, say) is not
    held: at the end of training the previous handlers come back and the signal is
    raised again, as if this callback had never caught it.
    """

    def __init__(
        self, run_dir: str | os.PathLike[str] | None = None, exit_code: int = EXIT_PREEMPTED
    ) -> None:
        self.run_dir = run_dir
        self.exit_code = exit_code
        self._flag = PreemptionFlag()
        expect_handler()  # a warning before on_train_begin waits for it (entry's rank)
        self._installed = False
        self._stopping_at: int | None = None  # the step being saved because of a stop
        self._reason = ""
        self._signum: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        # Installed here, not in __init__: nothing can be saved before the training
        # begins. Under shardctl's entry a warning that came earlier was held for this
        # handler (`expect_handler`), which takes it: the ranks save at the first step.
        if not self._installed:
            self._flag.install()
            self._installed = True
        if state.is_world_process_zero:  # this start supersedes the last preemption
            self._marker_dir(args).preempted_file.unlink(missing_ok=True)
            self._record_output_dir(args)
        heartbeat.beat(state.global_step, "step")

    def on_prediction_step(self, args, state, control, **kwargs):
        heartbeat.beat(None, "eval")  # an evaluation batch: alive, though no step

    def on_evaluate(self, args, state, control, **kwargs):
        heartbeat.beat(None, "step")

    def on_step_end(self, args, state, control, **kwargs):
        # Runs on every rank after every optimizer step, so the all-reduce is a
        # collective all of them reach; agreeing here keeps the ranks on one step.
        stop, signum = self._agree(self._flag.local(state.global_step), args.device)
        # The node's watchdog: this rank advanced (and a save that follows gets its time).
        heartbeat.beat(state.global_step, "save" if control.should_save or stop else "step")
        if not stop:
            return
        self._stopping_at = state.global_step
        self._reason = self._flag.reason(signum)
        self._signum = signum
        control.should_save = True
        control.should_training_stop = True
        # No evaluation in the grace period; with save_strategy="best" an evaluation
        # would also decide should_save and could veto this save.
        control.should_evaluate = False

    def on_save(self, args, state, control, **kwargs):
        heartbeat.beat(state.global_step, "step")
        if self._stopping_at is None:
            return
        step = state.global_step
        # Every rank's part (DeepSpeed and FSDP shards, rng_state_<rank>.pth) is
        # written before the marker says the checkpoint can be resumed from.
        _barrier()
        if state.is_world_process_zero:
            marker = preempted_marker(step, self._signum, self._reason)
            self._marker_dir(args).write_marker(PREEMPTED_FILE, marker)
            logger.warning(
                "preempted (%s): saved %s-%d; exiting with code %d",
                self._reason, PREFIX_CHECKPOINT_DIR, step, self.exit_code,
            )  # fmt: skip
        # torchrun stops the other ranks as soon as one exits non-zero: none leaves
        # before the marker exists.
        _barrier()
        logger.warning("rank %d: exiting with code %d", args.process_index, self.exit_code)
        # Ignored, not handled, from here: Python puts the default action back while
        # it shuts down, and torchrun SIGTERMs the ranks still running once the first
        # one has exited, which would turn a slower rank's 42 into death by signal.
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        sys.exit(self.exit_code)

    def on_train_end(self, args, state, control, **kwargs):
        heartbeat.beat(state.global_step, "finish")
        if not self._installed:
            return
        self._flag.uninstall()
        self._installed = False
        signum, self._flag.signum = self._flag.signum, None
        if signum is not None:  # came after the last step's agreement: not held back
            signal.raise_signal(signum)

    def _record_output_dir(self, args) -> None:
        """Where this Trainer's checkpoints go, for the supervisors' progress rule
        (`outcome.attempt_progress`: a requeue that saved a new checkpoint-N is
        progress); only in a run dir (under shardctl)."""
        run_dir = self.run_dir or os.environ.get(ENV_RUN_DIR)
        if run_dir and args.output_dir:
            where = {"output_dir": os.path.abspath(args.output_dir)}
            RunDir.of(run_dir).write_marker(TRAINER_OUTPUT_FILE, where)

    def _marker_dir(self, args) -> RunDir:
        return RunDir.of(self.run_dir or os.environ.get(ENV_RUN_DIR) or args.output_dir)

    def _agree(self, local: bool, device: Any) -> tuple[bool, int | None]:
        """(the ranks stop, the signal that names it) — the same on all ranks: the one
        agreement (`shardctl.train.stop`), one tiny collective per optimizer step."""
        agreed = stop_rule.agree(local, self._flag.signum, device)
        return agreed.stop, agreed.signum


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
