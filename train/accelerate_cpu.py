"""A script's `Accelerator()` under `accelerate launch` with a DeepSpeed config on CPU
runs DeepSpeed on all the ranks, as `validate` said.

accelerate 1.x has two ways to go wrong there, and shardctl's launch avoids both:

- With `ACCELERATE_USE_CPU=true` (or `Accelerator(cpu=True)`) it drops DeepSpeed and
  wraps the model in DDP: the first `save_state` then fails on
  `'DistributedDataParallel' object has no attribute 'save_checkpoint'`. shardctl
  does not export it (`orchestrator/launch.backend_env`); a script's own `cpu=True`
  is said on rank 0.
- Without it, on a host with no GPU, `PartialState` finds no communication backend:
  DeepSpeed still starts its own group of all the ranks, but accelerate records one
  process, so every rank is "process 0", reads the whole dataset and writes rank 0's
  files. `install()` hands accelerate `gloo` where it found no backend, so it counts
  the ranks of DeepSpeed's group (`num_processes`, `process_index`).

The shared-memory all-reduce op DeepSpeed would compile on CPU (30-60 s) is switched
off first, as the built-in loop's DeepSpeed backend does (`_prepare_deepspeed`).

`shardctl.train.entry` calls `install()` before the user's code. It acts only where
accelerate's launcher asked for DeepSpeed (`ACCELERATE_USE_DEEPSPEED=true`) on a CPU
job (`DS_ACCELERATOR=cpu`, which shardctl exports for every DeepSpeed job) and then
imports accelerate, which the script is about to import anyway; elsewhere it imports
nothing. Checked with accelerate 1.15 (`PartialState._prepare_backend`).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

# Set on the wrapper, so that a second install wraps once.
WRAPPED = "_shardctl_deepspeed_on_cpu"
CPU_BACKEND = "gloo"


def wanted(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether this rank is a DeepSpeed rank of `accelerate launch` on CPU."""
    deepspeed = environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    return deepspeed and environ.get("DS_ACCELERATOR", "") == "cpu"


def install() -> None:
    """On a DeepSpeed-on-CPU rank of `accelerate launch`, give accelerate the gloo
    backend it cannot find on its own (see the module docstring)."""
    if not wanted():
        return
    from accelerate.state import PartialState

    original = PartialState._prepare_backend
    if getattr(original, WRAPPED, False):
        return

    @functools.wraps(original)
    def prepare_backend(self: Any, cpu: bool = False, *args: Any, **kwargs: Any) -> Any:
        backend, distributed_type = original(self, cpu, *args, **kwargs)
        if cpu:
            _say_deepspeed_dropped()
        elif backend is None:
            from .backends.deepspeed import _prepare_deepspeed

            _prepare_deepspeed("cpu")
            backend = CPU_BACKEND
        return backend, distributed_type

    setattr(prepare_backend, WRAPPED, True)
    PartialState._prepare_backend = prepare_backend  # type: ignore[method-assign]


def _say_deepspeed_dropped() -> None:
    # The script asked for cpu=True itself (the Trainer's use_cpu=True): accelerate
    # then drops DeepSpeed whatever the config says; say it once, on rank 0.
    if os.environ.get("RANK", "0") == "0":
        print(
            "shardctl: the script's Accelerator(cpu=True) (or TrainingArguments(use_cpu="
            "True)) makes accelerate drop DeepSpeed and train with DDP; under shardctl's "
            "`launcher: accelerate` with strategy.backend deepspeed, leave it out",
            file=sys.stderr,
            flush=True,
        )
