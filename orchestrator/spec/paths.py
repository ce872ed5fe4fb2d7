"""Where a job spec's relative paths point: the spec file's folder, as docker compose
does, so a run never depends on the directory a command is typed in.

`load_spec` calls `resolve_paths` on the file's data before validation: every relative
path of the file is joined to the file's folder (the default `run_dir`, `runs/<name>`,
too), and every relative path given with `--set` to the current directory, like any
path typed on a command line (`submit -- SCRIPT` too, in `job.with_command`). A spec
read from stdin or built in code (`parse_spec`) keeps its paths as written: relative
to the current directory of whoever reads them.

The files the ranks read (corpus, pretrained model, resume checkpoint, TensorBoard
folder) are read where the cluster's ranks run. On a cluster whose section says
`reads_local_paths = False` (Kubernetes: the pods read them inside the pod, relative
to its working directory on the run volume), those stay as written.

An `s3://BUCKET/PREFIX` URL (`checkpoint.dir`, `checkpoint.resume`) is no path: it is
kept as written, and validation refuses a malformed one (`orchestrator/s3/url.py`).
"""

from __future__ import annotations

import copy
import posixpath
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..rundir import default_run_dir
from ..s3.url import is_s3_url

# Paths this machine reads or writes whatever the cluster: the run dir (status, logs,
# the submit claim), the checkpoint dir, and the entrypoint's code (read here to travel).
SUBMITTER_PATHS = ("run_dir", "checkpoint.dir", "entrypoint.script", "entrypoint.code_dir")
# Paths only the ranks read: taken from the spec file's folder where the ranks share
# this machine's file system (local, Slurm), kept as written inside a pod.
RANK_PATHS = (
    "train.data.text",
    "train.data.tokens",
    "train.model.pretrained",
    "checkpoint.resume",
    "checkpoint.memory_dir",
    "logging.tensorboard_dir",
)
# `checkpoint.resume` also takes these words, which are no path.
NOT_PATHS = {"checkpoint.resume": ("auto", "never")}


def path_fields(reads_local_paths: bool) -> tuple[str, ...]:
    """The dotted names of the fields resolved for a cluster."""
    return SUBMITTER_PATHS + (RANK_PATHS if reads_local_paths else ())


def resolve_paths(
    data: Any,
    base: Path,
    *,
    reads_local_paths: bool = True,
    overrides: Sequence[Sequence[str | int]] = (),
    cwd: Path | None = None,
) -> Any:
    """A copy of the spec's data (after `--set`) with its relative paths made absolute.

    `overrides`: the key paths `--set` assigned (see `overrides.parse_path`); a field
    at or below one of them came from the command line and is taken from `cwd`."""
    if not isinstance(data, dict):
        return data  # parse_spec says what the top level must be
    data = copy.deepcopy(data)
    here = (cwd or Path.cwd()).absolute()
    for field in path_fields(reads_local_paths):
        keys = field.split(".")
        typed = any(list(keys[: len(o)]) == list(o) for o in overrides)
        _resolve_one(data, keys, here if typed else base, NOT_PATHS.get(field, ()))
    name = data.get("name")
    if data.get("run_dir") is None and isinstance(name, str):
        # The default is the spec's too: beside the file, wherever it is submitted from.
        data["run_dir"] = _joined(base, default_run_dir(name))
    return data


def _resolve_one(data: dict[str, Any], keys: list[str], base: Path, words: Sequence[str]) -> None:
    node: Any = data
    for key in keys[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return
    value = node.get(keys[-1])
    # Anything that is not a plain relative path is left for validation to judge.
    if not isinstance(value, str) or not value.strip() or value in words or is_s3_url(value):
        return
    if not posixpath.isabs(value) and "\x00" not in value:
        node[keys[-1]] = _joined(base, value)


def _joined(base: Path, value: str) -> str:
    # Lexical, like a shell's `cd`: a symlink in the spec's folder is kept as named.
    return posixpath.normpath(posixpath.join(base.as_posix(), value))
