"""What `shardctl convert` is given: a file or stdin, parsed as YAML, and which kind it is.

The kind is decided from the content alone (no file-name conventions), so a config
piped in on stdin is read exactly like the same file named on the command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import UsageError
from .checks import ACCELERATE, UNKNOWN, Origin
from .plan import SourceKind

STDIN_NAME = "<stdin>"


@dataclass(frozen=True)
class Input:
    """One parsed input and where it came from."""

    data: Any
    source: str | None
    """The file name, or `<stdin>`; every error message starts with it."""
    base_dir: Path | None
    """Where a relative deepspeed_config_file is looked up first (the file's folder)."""


_ACCEPTED = (
    "give an accelerate config, a job spec, a checkpoint folder, or - to read a config from stdin"
)


def read_path(path: str | Path) -> Input:
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        # A FIFO waits for a writer and a device never ends: refused before it is opened.
        raise UsageError(f"CONFIG {str(path)!r} is not a regular file; {_ACCEPTED}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"CONFIG {str(path)!r} does not exist; {_ACCEPTED}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"cannot read CONFIG {str(path)!r}: not UTF-8 text (byte {exc.start}); is it a "
            "binary file?"
        ) from None
    except OSError as exc:
        raise UsageError(f"cannot read CONFIG {str(path)!r}: {exc.strerror or exc}") from None
    return read_text(text, str(path), path.parent)


def read_text(text: str, source: str = STDIN_NAME, base_dir: Path | None = None) -> Input:
    """Parse `text` (YAML, or JSON, which YAML reads too); errors name line and column."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        Origin(source, UNKNOWN).fail(f"not valid YAML{where}: {problem}")
    return Input(data, source, base_dir)


def detect(data: Any, source: str | None = None) -> SourceKind:
    """Which kind of config `data` is: accelerate-fsdp, accelerate-deepspeed or jobspec."""
    unknown = Origin(source, UNKNOWN)
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        unknown.fail(
            f"the top level must be a mapping (an accelerate config or a shardctl job spec), "
            f"got {got}"
        )
    if "distributed_type" in data or "fsdp_config" in data or "deepspeed_config" in data:
        dist = str(data.get("distributed_type", "")).upper()
        if dist == "FSDP" or (not dist and "fsdp_config" in data):
            return "accelerate-fsdp"
        if dist == "DEEPSPEED" or (not dist and "deepspeed_config" in data):
            return "accelerate-deepspeed"
        Origin(source, ACCELERATE).fail(
            f"distributed_type {data.get('distributed_type')!r} is neither backend; "
            "accepted: FSDP (with fsdp_config) or DEEPSPEED (with deepspeed_config)"
        )
    if "train" in data or "strategy" in data or "name" in data:
        return "jobspec"
    keys = ", ".join(sorted(map(str, data))) or "none"
    unknown.fail(
        f"neither an accelerate config (no distributed_type) nor a shardctl job spec (no "
        f"name/train/strategy); top-level keys: {keys}"
    )
