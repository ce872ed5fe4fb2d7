"""`shardctl init`: write a commented starter job spec that validates as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click

from ..errors import ShardctlError, UsageError
from .common import handle_errors

DEFAULT_PATH = "job.yaml"


def job_name_from(path: Path) -> str:
    """A valid job name from a file name: `My_Job.yaml` → `my-job`."""
    from ..spec import NAME_MAX

    stem = path.name.split(".", 1)[0].lower()
    name = re.sub(r"[^a-z0-9]+", "-", stem)[:NAME_MAX].strip("-")
    return name or "my-job"


def starter_spec(name: str, backend: str, path: str) -> str:
    """The starter spec text; it is validated before anyone sees it."""
    from ..spec import parse_spec
    from ..templating import render_template

    # The path only appears in comments: one line, quoted so the commands copy-paste.
    shown = shlex.quote(" ".join(path.split()) or DEFAULT_PATH)
    text = render_template("starter.yaml.j2", job_name=name, backend=backend, path=shown)
    import yaml

    parse_spec(yaml.safe_load(text), "the starter spec")  # a bad --name fails here
    return text


@click.command("init")
@click.argument(
    "path", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_PATH, required=False
)
@click.option(
    "--backend",
    type=click.Choice(["fsdp", "deepspeed"]),
    default="fsdp",
    show_default=True,
    help="FSDP2 (sharding: full_shard) or DeepSpeed (zero_stage: 3).",
)
@click.option("--name", default=None, help="Job name (default: from the file name).")
@click.option("--force", is_flag=True, help="Overwrite PATH if it exists.")
@handle_errors
def init_cmd(path: Path, backend: str, name: str | None, force: bool) -> None:
    """Write a commented starter job spec to PATH (default: job.yaml).

    Every section carries a comment saying what it does; as written the spec
    trains a tiny Llama on 2 CPU processes and passes `shardctl validate`.
    """
    if path.exists() and not force:
        raise UsageError(f"{path} already exists; refusing to overwrite it (use --force)")
    text = starter_spec(name or job_name_from(path), backend, str(path))
    from ..durable import write_text_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: a full disk leaves no truncated job.yaml for the next init to refuse.
        write_text_atomic(path, text, durable=False)
    except OSError as exc:
        raise ShardctlError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    click.echo(f"wrote {path} ({backend}); check it with: shardctl validate {path}")
