"""`shardctl init`: write a commented starter job spec that validates as written."""

from __future__ import annotations

import os
import re
import shlex
import stat
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


def check_name(name: str) -> None:
    """Refuse a `--name` that is not a job name before it is put into YAML (a tab or
    a newline there would break the file rather than the name)."""
    from ..spec import NAME_MAX, NAME_RE

    if len(name) > NAME_MAX or not NAME_RE.match(name):
        raise UsageError(
            f"--name {name!r} cannot be a job name; accepted: 1-{NAME_MAX} lower-case "
            "letters, digits and '-', starting and ending with a letter or digit"
        )


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _file_on_the_way(path: Path) -> Path:
    """The first folder of PATH that is in fact a file (why the OS said ENOTDIR)."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return path.parent


def check_target(path: Path, force: bool) -> None:
    """Refuse an existing PATH without --force; with it, replace a regular file only
    (the new spec is renamed into place: a device, FIFO or link would be replaced by a
    file, not written to)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise UsageError(
            f"cannot write {path}: {_file_on_the_way(path)} is a file, not a folder; "
            "accepted: a PATH whose folders are folders"
        ) from None
    except OSError as exc:
        raise UsageError(f"cannot check {path}: {exc.strerror or exc}") from None
    if stat.S_ISREG(mode):
        if not force:
            raise UsageError(f"{path} already exists; refusing to overwrite it (use --force)")
        return
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    raise UsageError(
        f"{path} exists and is {kind}; init writes a new job spec there only in place of a "
        "regular file (with --force): give another PATH"
    )


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
@click.option("--force", is_flag=True, help="Overwrite PATH if it exists (a regular file only).")
@handle_errors
def init_cmd(path: Path, backend: str, name: str | None, force: bool) -> None:
    """Write a commented starter job spec to PATH (default: job.yaml).

    Every section carries a comment saying what it does; as written the spec
    trains a tiny Llama on 2 CPU processes and passes `shardctl validate`.
    """
    check_target(path, force)
    if name is not None:
        check_name(name)
    text = starter_spec(name or job_name_from(path), backend, str(path))
    from ..durable import write_text_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: a full disk leaves no truncated job.yaml for the next init to refuse.
        write_text_atomic(path, text, durable=False)
    except OSError as exc:
        raise ShardctlError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    click.echo(f"wrote {path} ({backend}); check it with: shardctl validate {path}")
