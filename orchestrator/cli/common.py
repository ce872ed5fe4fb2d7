"""Pieces every CLI module shares: error reporting, `--output`, JSON and size printing.

Kept apart from `cli.py` so that the command modules `cli.py` registers can use them
without a circular import. Nothing heavy is imported here.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..errors import ShardctlError

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Turn library errors into one clear message on stderr and the error's exit code.

    This is the only place where `ShardctlError`s become exit codes (2 bad input, 1 failure).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ShardctlError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(exc.exit_code)

    return wrapper  # type: ignore[return-value]


def output_option(fn: F) -> F:
    return click.option(
        "--output",
        "-o",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help="Human-readable text or one JSON document on stdout.",
    )(fn)


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def human_size(n: float) -> str:
    """Bytes as B / KiB / MiB / GiB / TiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
