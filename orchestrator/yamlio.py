"""Reading YAML files with errors that name the file, line and column (no pydantic here:
`shardctl convert` uses it before it knows whether the file is a job spec)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import SpecError


def read_yaml_file(path: str | Path) -> Any:
    """Read a YAML file; unreadable files and YAML syntax errors become `SpecError`s
    that name the file and, for syntax errors, the line and column."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([f"file {str(path)!r} does not exist"], str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([f"cannot read {str(path)!r}: {exc}"], str(path)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([f"not valid YAML{where}: {problem}"], str(path)) from None
