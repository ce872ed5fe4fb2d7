"""Pieces every CLI module shares: error reporting, `--output`, JSON and size printing.

Kept apart from `cli.py` so that the command modules `cli.py` registers can use them
without a circular import. Nothing heavy is imported here.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..errors import MissingDependencyError, ShardctlError

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
            echo_error(f"error: {exc}")
            sys.exit(exc.exit_code)
        except ModuleNotFoundError as exc:
            # An optional extra missing where no command says so itself: name the extra.
            extra = OPTIONAL_PACKAGES.get(exc.name or "")
            if extra is None:
                raise
            ctx = click.get_current_context(silent=True)
            command = ctx.command_path if ctx is not None else "shardctl"
            missing = MissingDependencyError(exc.name or "", extra, command)
            echo_error(f"error: {missing}")
            sys.exit(missing.exit_code)

    return wrapper  # type: ignore[return-value]


# The optional packages and the extra of pyproject.toml that installs each; only a
# package that is missing as a whole (not a module inside it) is named this way.
OPTIONAL_PACKAGES = {
    **dict.fromkeys(
        ("torch", "numpy", "safetensors", "transformers", "deepspeed", "accelerate"), "train"
    ),
    "matplotlib": "train",
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "submitit": "slurm",
    "kubernetes": "k8s",
}


def colour_wanted() -> bool | None:
    """False when NO_COLOR (https://no-color.org) is set to anything non-empty; else None,
    which lets click decide: colour on a terminal, none when the stream is a pipe or file."""
    return False if os.environ.get("NO_COLOR") else None


def echo_error(message: str) -> None:
    """An error on stderr: red on a terminal, plain under NO_COLOR or when redirected."""
    click.secho(message, fg="red", err=True, color=colour_wanted())


class WorkloadCommand(click.Command):
    """A command that takes `-- COMMAND` (see `command_argument`).

    click hands a bare `--` over as no command at all, so the spec's own workload
    would run where the user meant to give another: refuse it instead."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[-1] == "--" and args.index("--") == len(args) - 1:
            raise click.UsageError(
                "nothing follows --; it expects the workload to run instead of the spec's: "
                "a script and its arguments (-- train.py --lr 1e-3) or -m MODULE [ARGS...]. "
                "Leave out -- to run the spec's own workload.",
                ctx,
            )
        return super().parse_args(ctx, args)


def command_argument(fn: F) -> F:
    """`-- SCRIPT [ARGS...]` or `-- -m MODULE [ARGS...]` after the spec: the workload
    to run instead of the spec's own (see spec.with_command)."""
    return click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- COMMAND]")(fn)


def set_option(fn: F) -> F:
    """`--set KEY.PATH=VALUE`, repeatable: the spec with those fields changed."""
    return click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY.PATH=VALUE",
        help="Change a field of the spec (repeatable; the value is YAML), e.g. "
        "--set train.lr=0.0003 --set resources.nodes=2. Validated like the file.",
    )(fn)


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


class ClusterChoice(click.Choice):  # type: ignore[type-arg]
    """`--cluster`: a built-in cluster's name or an installed plugin's. The plugins'
    entry points are read only for a name that is not built in (they cost start-up)."""

    def __init__(self) -> None:
        from ..clusters import CLUSTER_NAMES

        super().__init__(CLUSTER_NAMES)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value not in self.choices:
            from ..clusters import plugin_names

            plugins = plugin_names()
            if value in plugins:
                return value
            # Refused with every name accepted here, the plugins' too.
            return click.Choice((*self.choices, *plugins)).convert(value, param, ctx)
        return super().convert(value, param, ctx)


class Seconds(click.FloatRange):
    """A wait in seconds from `low` to `high`. Past `high` a deadline outruns what the
    clock can count (an OverflowError deep in a lock's wait); NaN passes a plain
    range check (every comparison with it is false), so it is refused here."""

    name = "seconds"

    def __init__(self, low: float, high: float) -> None:
        super().__init__(min=low, max=high)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if seconds != seconds:  # NaN
            self.fail(f"{value!r} is not a number; accepted: {self.min:g} to {self.max:g} seconds",
                      param, ctx)  # fmt: skip
        return seconds
