"""What the ranks will read, checked on this machine before any rank starts.

A spec can be valid and still name a corpus that is not there, a resume folder that
was deleted or a factory that does not import; each rank would find out on its own,
after the launcher started them all. Where a cluster's ranks read the spec's paths
where this machine does (its section's `reads_local_paths`: local, Slurm on a shared
file system), `validate` and `submit` refuse such a spec with one line per problem
naming the field, and `doctor` reports the same lines.

`input_problems` is cheap (file system lookups, `importlib.util.find_spec`): it runs in
`validate` and `submit --dry-run` too. `import_problems` imports the spec's factories in
a child interpreter (a factory may import torch: seconds), so only a real `submit`
and `doctor` run it; the CLI process itself never imports the user's code.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import MissingDependencyError, SpecError
from .spec import JobSpec

# Paths are shown whole up to this length (the usual 80-character cut would hide
# which folder is meant); longer ones are cut like any value.
PATH_SHOWN_CHARS = 500


def _show(value: str) -> str:
    return repr(value) if len(value) <= PATH_SHOWN_CHARS else SpecError.show_value(value)


# A relative path was taken from the spec file's folder (spec/paths.py): say so.
RELATIVE_NOTE = " (a relative path is taken from the spec file's folder)"
# How long a factory's import may take before the check gives up without a verdict.
IMPORT_TIMEOUT_S = 120


def _missing(
    field: str, value: str, ok: Callable[[Path], bool], kind: str, accepted: str
) -> list[str]:
    """`field`'s path is not what the ranks need (`kind`), with what is accepted."""
    if ok(Path(value)):
        return []
    state = "does not exist" if not os.path.lexists(value) else f"is not {kind}"
    return [f"{field} {_show(value)} {state} here; accepted: {accepted}{RELATIVE_NOTE}"]


def script_problems(spec: JobSpec, where: str) -> list[str]:
    """An entrypoint's script (and code_dir) must exist where the nodes read it: on this
    machine's file system, which `where` says the nodes share."""
    ep = spec.entrypoint
    problems: list[str] = []
    if ep is None:
        return problems
    for name, path, ok in (
        ("entrypoint.script", ep.script, Path.is_file),
        ("entrypoint.code_dir", ep.code_dir, Path.is_dir),
    ):
        if path is not None and not ok(Path(path)):
            what = "a Python file" if name.endswith("script") else "a folder"
            problems.append(f"{name} {_show(path)} is not {what}; accepted: {what} that {where}")
    return problems


def input_problems(spec: JobSpec) -> list[str]:
    """The local files and packages the ranks will read that are not there (cheap)."""
    problems = script_problems(spec, "exists here")
    t, c = spec.train, spec.checkpoint
    if t is not None:
        d, m = t.data, t.model
        if d.text is not None:
            what = "a text file or a folder of them"
            problems += _missing("train.data.text", d.text, Path.exists, what, what)
        if d.tokens is not None:
            what = "a token file (.npy, or raw .bin)"
            problems += _missing("train.data.tokens", d.tokens, Path.is_file, what, what)
        if m.pretrained is not None:
            what = "a folder from_pretrained reads (config.json and the weights)"
            problems += _missing(
                "train.model.pretrained", m.pretrained, Path.is_dir, "a folder", what
            )
    if c.resume not in ("auto", "never"):
        what = "'auto', 'never' or the path of a complete step-NNNNNNNN folder"
        problems += _missing("checkpoint.resume", c.resume, Path.is_dir, "a folder", what)
    tensorboard = spec.logging.tensorboard_dir
    if tensorboard is not None and os.path.lexists(tensorboard) and not Path(tensorboard).is_dir():
        problems.append(
            f"logging.tensorboard_dir {_show(tensorboard)} is a file; accepted: a folder "
            "(made if missing) for TensorBoard's event files"
        )
    blockers: set[Path] = set()  # one file in the way is said once
    for field, folder in (("run_dir", spec.run_dir), ("checkpoint.dir", c.dir)):
        blocker = _file_in_the_way(folder) if folder else None
        if blocker is not None and blocker not in blockers:
            blockers.add(blocker)
            where = "" if blocker == Path(folder) else f" ({_show(str(blocker))} is a file)"
            problems.append(
                f"{field} {_show(str(folder))} cannot be a folder here{where}; accepted: a "
                f"folder, or a path where one can be made{RELATIVE_NOTE}"
            )
    return problems + tracker_problems(spec)


def _file_in_the_way(folder: str | Path) -> Path | None:
    """`folder` itself or the nearest existing folder above it, when that is a file:
    a run dir that could never be made."""
    here = Path(folder).absolute()
    while not os.path.lexists(here) and here != here.parent:
        here = here.parent
    return None if here.is_dir() else here


def tracker_problems(spec: JobSpec) -> list[str]:
    """Each tracker `logging.backends` lists whose package is not installed here."""
    # The table the ranks check (train/trackers.py is torch-free: stdlib only).
    from ..train.trackers import PACKAGES

    problems = []
    for name in spec.logging.backends or []:
        module, extra = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            missing = MissingDependencyError(module, extra, f"logging.backends {name!r}")
            problems.append(str(missing))
    return problems


# The child interpreter's side of `import_problems`: import, look the function up, and
# print why not (exit 3); another exit code or a timeout is no verdict.
_IMPORT_PROBE = """
import importlib, sys
ref = sys.argv[1]
module_name, _, attr = ref.partition(":")
try:
    module = importlib.import_module(module_name)
except Exception as exc:
    print(f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})")
    sys.exit(3)
if not callable(getattr(module, attr, None)):
    print(f"module {module_name!r} has no function {attr!r}")
    sys.exit(3)
"""


def import_problems(spec: JobSpec, python: str | None = None) -> list[str]:
    """Each `factory` of the spec that does not import, imported as a rank would: in
    `python` (default this interpreter), from the current directory, with `env:`."""
    t = spec.train
    refs = [] if t is None else [("train.model.factory", t.model.factory)]
    refs += [] if t is None else [("train.data.factory", t.data.factory)]
    problems = []
    env = {**os.environ, **spec.env}
    for field, ref in refs:
        if ref is None:
            continue
        try:
            proc = subprocess.run(
                [python or sys.executable, "-c", _IMPORT_PROBE, ref],
                env=env,
                capture_output=True,
                text=True,
                timeout=IMPORT_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue  # no verdict: the ranks will say
        if proc.returncode == 3:
            why = " ".join(proc.stdout.split()) or "it does not import"
            problems.append(
                f"{field} {_show(ref)}: {why}; accepted: 'package.module:function' "
                "importable on every node (installed, or on PYTHONPATH)"
            )
    return problems
