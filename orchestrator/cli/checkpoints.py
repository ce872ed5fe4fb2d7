"""`shardctl checkpoints`: list (and verify) the checkpoints of a run.

Reads only folders and manifests (no torch import), so it answers in well under
a second on a login node. `--verify` re-hashes every file against its manifest.

Statuses, named after what the trainer does with a folder when it resumes
(`checkpoint.resume: auto`):
- `incomplete`: a save that never finished (`.tmp`, or no manifest.json); skipped.
- `corrupt`: published (final name and a manifest.json) but its manifest cannot be
  read or a file does not match it; the trainer rejects it and tries older ones.
- `complete` (sizes match) / `verified` (sha256 match too); the newest is resumed.
Exit 1 when any checkpoint is corrupt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ..checkpoint_list import committed_folder
from ..storage import is_object_url
from .common import echo_json, handle_errors, human_size, output_option


def collect(path: Path | str, check_hashes: bool) -> dict[str, Any]:
    """What `shardctl checkpoints` shows, as plain data."""
    if is_object_url(path):
        return _collect_s3(str(path), check_hashes)
    path = Path(path)
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        # A job spec, as `consolidate` takes it: its checkpoint.dir is what is listed.
        from .consolidate import checkpoints_and_run_dir

        where, _ = checkpoints_and_run_dir(path)
        if isinstance(where, str):
            return _collect_s3(where, check_hashes)
        path = where
    in_bucket = _bucket_of_run(path)
    if in_bucket is not None:
        return _collect_s3(in_bucket, check_hashes)
    from ...train.foreign import identify, list_foreign
    from ...train.manifest import list_checkpoints, resolve_checkpoint_dir, verify

    folder, one = resolve_checkpoint_dir(path)
    foreign = [identify(folder)] if one else list_foreign(folder)
    foreign_rows = [_foreign_row(f, check_hashes) for f in foreign if f is not None]
    if one and foreign_rows:
        infos = []
    else:
        infos = list_checkpoints(folder.parent if one else folder)
        # A torchtitan-style step-N/ holds DCP's .metadata, no manifest: it is shown once,
        # as the DCP checkpoint it is, never as an interrupted shardctl save.
        claimed = {row["path"] for row in foreign_rows}
        infos = [i for i in infos if i.path not in claimed]
    if one and not foreign_rows:
        infos = [i for i in infos if Path(i.path).name == folder.name]
        if not infos:  # a folder not named step-N but holding a manifest
            from ...train.manifest import CheckpointInfo, read_manifest

            problems = verify(folder, hashes=False)
            manifest: dict[str, Any] = {}
            if not problems:
                manifest = read_manifest(folder)
            infos = [
                CheckpointInfo(
                    step=int(manifest.get("step", -1)),
                    path=str(folder),
                    complete=not problems,
                    size_bytes=sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
                    world_size=manifest.get("world_size"),
                    backend=manifest.get("backend"),
                    why_incomplete=problems[0] if problems else None,
                )
            ]
    rows = []
    for info in infos:
        row = info.to_json()
        row["format"] = "shardctl"
        row["status"] = "complete" if info.complete else _why_not(Path(info.path))
        row["problems"] = [] if info.complete else [info.why_incomplete]
        if check_hashes and info.complete:
            problems = verify(info.path)
            row["problems"] = problems
            row["status"] = "corrupt" if problems else "verified"
        rows.append(row)
    rows += foreign_rows
    rows.sort(key=lambda r: (-1 if r["step"] is None else r["step"], r["path"]))
    usable = [r for r in rows if r["status"] in ("complete", "verified")]
    published = [r for r in rows if r["status"] != "incomplete"]
    # What `checkpoint.resume: auto` does with this folder (see CheckpointManager.restore).
    resume = "resume" if usable else ("error" if published else "start")
    return {
        "checkpoint_dir": str(folder.parent if one else folder),
        "checkpoints": rows,
        "latest_complete": usable[-1]["path"] if usable else None,
        "resume_auto": resume,
        "verified": check_hashes,
    }


def _bucket_of_run(path: Path) -> str | None:
    """The `s3://` checkpoint dir of the run dir `path` (its rendered job.yaml says
    so), or None."""
    from ..rundir import SPEC_FILE

    if not (path / SPEC_FILE).is_file():
        return None
    from ..errors import ShardctlError
    from ..spec import read_job_yaml

    try:
        location = read_job_yaml(path / SPEC_FILE).checkpoint_dir
    except ShardctlError:  # a job.yaml of another version: the folder is listed as it is
        return None
    return location if is_object_url(location) else None


def _collect_s3(location: str, check_hashes: bool) -> dict[str, Any]:
    """The same data for checkpoints in a bucket, read there (nothing is downloaded)."""
    from ..s3.local import checkpoint_rows

    rows = checkpoint_rows(location, check_hashes)
    usable = [r for r in rows if r["status"] in ("complete", "verified")]
    published = [r for r in rows if r["status"] != "incomplete"]
    return {
        "checkpoint_dir": location,
        "checkpoints": rows,
        "latest_complete": usable[-1]["path"] if usable else None,
        "resume_auto": "resume" if usable else ("error" if published else "start"),
        "verified": check_hashes,
    }


# Said of every checkpoint another tool wrote: its format records no hashes.
NO_SHA256 = "no sha256 recorded (not written by shardctl): sizes and structure checked"


def _foreign_row(found: Any, check_hashes: bool) -> dict[str, Any]:
    """A checkpoint another tool wrote, as a row: checked for what its format proves."""
    from ...train.manifest import dir_size

    status = "complete" if found.complete else "corrupt" if found.committed else "incomplete"
    notes = [NO_SHA256] if found.complete else []
    return {
        "step": found.step,
        "path": str(found.path),
        "complete": found.complete,
        "size_bytes": dir_size(found.path),
        "world_size": found.world_size,
        "backend": found.backend,
        "why_incomplete": found.problems[0] if found.problems else None,
        "format": found.format,
        "written_by": found.tool,
        "status": status,
        "problems": list(found.problems),
        "notes": notes,
    }


def _why_not(path: Path) -> str:
    """`incomplete` for a save that never finished, `corrupt` for a published one
    (final name and a manifest file) that is damaged."""
    return "corrupt" if committed_folder(path) else "incomplete"


def _resume_line(data: dict[str, Any]) -> str:
    latest = data["latest_complete"]
    if data["resume_auto"] == "resume":
        return latest
    if data["resume_auto"] == "error":
        return (
            "none — every published checkpoint is corrupt, so a resumed run stops with an "
            "error instead of starting over (set checkpoint.resume: never to start at step 0, "
            "or the path of one checkpoint)"
        )
    return "none — no save has finished, so a resumed run starts at step 0"


@click.command("checkpoints")
@click.argument("path")
@click.option(
    "--verify",
    "check_hashes",
    is_flag=True,
    help="Re-hash every file against the manifest (exit 1 if any checkpoint is corrupt).",
)
@output_option
@handle_errors
def checkpoints_cmd(path: str, check_hashes: bool, output: str) -> None:
    """List the checkpoints of PATH: a run directory, its checkpoints/ folder or one
    step-NNNNNNNN folder, the job spec (its checkpoint.dir), or s3://BUCKET/PREFIX (a
    checkpoint dir in a bucket, or one step in it). Shows step, complete or not, size,
    world size, backend."""
    data = collect(path, check_hashes)
    rows = data["checkpoints"]
    if output == "json":
        echo_json(data)
    elif not rows:
        from ...train.foreign import LOOKED_FOR

        click.echo(f"no checkpoints in {data['checkpoint_dir']}; looked for {LOOKED_FOR}")
    else:
        width = max(len("FORMAT"), *(len(r["format"]) for r in rows))
        click.echo(
            f"{'STEP':>10}  {'STATUS':<10}  {'SIZE':>10}  {'WORLD':>5}  {'BACKEND':<9}  "
            f"{'FORMAT':<{width}}  PATH"
        )
        for r in rows:
            world = "-" if r["world_size"] is None else str(r["world_size"])
            step = "-" if r["step"] is None else str(r["step"])
            click.echo(
                f"{step:>10}  {r['status']:<10}  {human_size(r['size_bytes']):>10}  "
                f"{world:>5}  {r['backend'] or '-':<9}  {r['format']:<{width}}  {r['path']}"
            )
            for problem in r["problems"]:
                click.echo(f"{'':>12}{problem}")
        foreign = [r for r in rows if r["format"] != "shardctl" and r["complete"]]
        if foreign:
            click.echo(f"note: {NO_SHA256} for the {len(foreign)} checkpoint(s) of other tools")
        latest = _resume_line(data)
        newest = next((r for r in rows if r["path"] == data["latest_complete"]), None)
        if all(r["format"] != "shardctl" for r in rows) and newest is None:
            # What `resume` would do is about shardctl's own checkpoints only.
            click.echo("newest complete: none")
        elif newest is not None and newest["format"] != "shardctl":
            click.echo(
                f"newest complete: {latest} ({newest['format']}: sizes and structure checked)"
            )
        elif check_hashes:
            click.echo(f"resume (auto) would use: {latest}")
        else:
            click.echo(f"newest complete: {latest} (sizes checked; --verify checks sha256)")
    if any(r["status"] == "corrupt" for r in rows):
        sys.exit(1)
