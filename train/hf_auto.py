"""A Hugging Face Trainer script that shardctl runs resumes and saves on a preemption
without the two lines of `shardctl.train.hf` (docs/guides/own-script.md).

`install()` runs in `shardctl.train.entry` before the user's code, on every rank. It
imports nothing of transformers: it puts a finder on `sys.meta_path` that waits for
`transformers.trainer` to be imported by the script (a script that never imports it
pays one string comparison per import) and then wraps `Trainer.train`. The wrapper
(`shardctl.train.hf.prepare_unmodified`) passes the newest complete `checkpoint-N`
of the Trainer's `output_dir` when the script gives no `resume_from_checkpoint`, and
adds shardctl's `PreemptionCallback` unless the script added one. From the moment
the script looks for `transformers.trainer`, a preemption warning is held for that
callback (`shardctl.train.preemption.expect_handler`): it saves at the first step.

`entrypoint.hf_trainer_auto: false` in the spec (rendered as
`SHARDCTL_HF_TRAINER_AUTO=0`) leaves the Trainer as transformers made it.

Torch-free and import-light, like `entry.py`.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from shardctl.orchestrator.rundir import ENV_HF_TRAINER_AUTO

from .preemption import expect_handler

TRAINER_MODULE = "transformers.trainer"
# Set on the wrapper, so that a second install (a module reloaded) wraps once.
WRAPPED = "_shardctl_hf_trainer_auto"


def enabled() -> bool:
    """False when the spec turned the automatic part off (`entrypoint.hf_trainer_auto`)."""
    return os.environ.get(ENV_HF_TRAINER_AUTO, "1").strip() != "0"


def install() -> None:
    """Wrap `Trainer.train` once the script imports transformers' Trainer (at once if
    it already did); nothing when the spec turned it off."""
    if not enabled():
        return
    loaded = sys.modules.get(TRAINER_MODULE)
    if loaded is not None:
        expect_handler()
        wrap_trainer(loaded)
    elif not any(isinstance(f, _TrainerFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TrainerFinder())


def wrap_trainer(module: ModuleType) -> None:
    """Replace `module.Trainer.train` by a wrapper that prepares an unmodified script's
    trainer first (see the module docstring)."""
    trainer_class = getattr(module, "Trainer", None)
    original = getattr(trainer_class, "train", None)
    if original is None or getattr(original, WRAPPED, False):
        return

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Imported here: `hf` imports transformers, which is loaded by now.
        from shardctl.train.hf import prepare_unmodified

        args, kwargs = prepare_unmodified(self, args, kwargs)
        return original(self, *args, **kwargs)

    setattr(train, WRAPPED, True)
    trainer_class.train = train  # type: ignore[union-attr]


class _TrainerFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `transformers.trainer` is looked for, it asks the
    finders after it for the module and wraps the loader's `exec_module`, so that the
    Trainer class is wrapped right after the module has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TRAINER_MODULE:
            return None
        sys.meta_path.remove(self)  # once: the module is imported once
        # A Trainer script: the callback the wrapper adds installs a handler when the
        # training begins; a warning before that (its import, the model, the data) is
        # held for it rather than ending the rank with nothing saved.
        expect_handler()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_wrap(module: ModuleType) -> None:
            exec_module(module)
            wrap_trainer(module)

        loader.exec_module = exec_and_wrap  # type: ignore[union-attr]  # this spec's loader only
        return spec
