"""A library's warning is shown once per run; the user's own warnings are untouched."""

from __future__ import annotations

import sys
import uuid
import warnings
from collections.abc import Callable

import pytest
from shardctl.train import libwarnings
from shardctl.train.libwarnings import show_library_warnings_once

LIBS = "/venv/lib/python3.11/site-packages/"
ROOTS = (f"{LIBS}torch/", f"{LIBS}deepspeed/")


def _warner(module: str, category: type[Warning]) -> Callable[[], None]:
    """A function that warns as the file of `module` under site-packages does."""
    code = "import warnings\ndef warn(text, category):\n    warnings.warn(text, category)\n"
    scope: dict[str, object] = {"__name__": module}
    exec(compile(code, f"{LIBS}{module.replace('.', '/')}.py", "exec"), scope)
    text = f"{module} says {uuid.uuid4()}"
    return lambda: scope["warn"](text, category)  # type: ignore[operator]


def _shown(warn: Callable[[], None], *, rank: int | None, steps: int = 6) -> int:
    """How many times `warn` reaches the user over `steps` steps in which other code
    enters a `catch_warnings()` block (as torch and DeepSpeed do every step)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's own default, whatever pytest set
        if rank is not None:
            assert show_library_warnings_once(rank, ROOTS)
        for _ in range(steps):
            warn()
            with warnings.catch_warnings():
                pass
    return len(seen)


def test_a_library_warning_is_shown_once_instead_of_every_step() -> None:
    assert _shown(_warner("torch.distributed.c10d_logger", FutureWarning), rank=None) == 6
    assert _shown(_warner("torch.distributed.c10d_logger", FutureWarning), rank=0) == 1
    assert _shown(_warner("deepspeed.runtime.zero", UserWarning), rank=0) == 1


def test_deprecations_every_rank_shares_are_left_to_rank_0() -> None:
    assert _shown(_warner("torch.distributed.c10d_logger", FutureWarning), rank=1) == 0
    assert _shown(_warner("deepspeed.utils.logging", DeprecationWarning), rank=3) == 0
    # A library's other warnings may differ by rank: every rank shows its own, once.
    assert _shown(_warner("deepspeed.runtime.engine", UserWarning), rank=1) == 1


@pytest.mark.parametrize("module", ["__main__", "train", "torchvision.models", "mytorch"])
def test_the_users_own_warnings_are_untouched(module: str) -> None:
    for rank in (0, 1):
        assert _shown(_warner(module, FutureWarning), rank=rank) == 6


def test_warning_options_of_the_users_own_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(libwarnings.sys, "warnoptions", ["always"])
    with warnings.catch_warnings():
        before = warnings.showwarning
        assert show_library_warnings_once(0, ROOTS) is False
        assert warnings.showwarning is before


def test_the_libraries_are_found_without_being_imported() -> None:

    imported = "torch" in sys.modules
    roots = libwarnings.library_roots(("torch", "no_such_library_here"))
    assert len(roots) == 1 and roots[0].endswith(("/torch/", "\\torch\\"))
    assert ("torch" in sys.modules) == imported  # found, not imported
