"""A library's warning is shown once per run, not once per rank per step.

Python shows a warning once per place in the code, but forgets what it has shown
whenever any code changes the warning filters: every `warnings.catch_warnings()`
block does, and torch and DeepSpeed run some every step (Python's own `once` action
forgets too). A 6-step ZeRO-3 run on 2 ranks printed the same torch FutureWarning
20 times. `show_library_warnings_once`, called first thing on every rank, puts a
check in front of Python's display: a warning raised from a training library's own
files (torch, DeepSpeed, accelerate, transformers, safetensors) is shown the first
time only, and the deprecations, which every rank would print alike, on rank 0
only. Warnings raised from the user's own code are untouched (the filters still
decide everything, `error` included: this only holds back a repeat), and so is
everything when the user chose warning options of their own (`-W`,
`PYTHONWARNINGS`) or replaces `warnings.showwarning` themselves.

Torch-free and import-light: the libraries are found, never imported (`entry.py`
calls this before the user's script).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import Any, TextIO

LIBRARIES = ("torch", "deepspeed", "accelerate", "transformers", "safetensors")
# Warnings that say the same on every rank.
ALIKE_ON_EVERY_RANK = (FutureWarning, DeprecationWarning)


def library_roots(names: tuple[str, ...] = LIBRARIES) -> tuple[str, ...]:
    """The folders of the installed libraries among `names` (each ending in a separator)."""
    roots: list[str] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for folder in (spec.submodule_search_locations or []) if spec else []:
            roots.append(os.path.join(os.path.realpath(folder), ""))
    return tuple(roots)


class _OncePerRun:
    """`warnings.showwarning` with a library's repeats held back."""

    def __init__(self, show: Any, roots: tuple[str, ...], rank: int) -> None:
        self.show, self.roots, self.rank = show, roots, rank
        self.seen: set[tuple[type[Warning], str]] = set()

    def __call__(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if os.path.realpath(filename).startswith(self.roots):
            if self.rank != 0 and issubclass(category, ALIKE_ON_EVERY_RANK):
                return
            key = (category, str(message))
            if key in self.seen:
                return
            self.seen.add(key)
        self.show(message, category, filename, lineno, file, line)


def show_library_warnings_once(rank: int, roots: tuple[str, ...] | None = None) -> bool:
    """Install the check; False (nothing done) when the user set warning options."""
    if sys.warnoptions:  # -W or PYTHONWARNINGS: the user decides
        return False
    found = library_roots() if roots is None else roots
    warnings.showwarning = _OncePerRun(warnings.showwarning, found, rank)
    return True
