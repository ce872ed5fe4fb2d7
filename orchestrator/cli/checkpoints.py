"""`shardctl checkpoints`: list (and verify) the checkpoints of a run.

Reads only folders and manifests (no torch import), so it answers in well under
a second on a login node. `--verify` re-hashes every file against its manifest.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from .common import handle_errors, human_size, output_option


def collect(path: Path, check_hashes: bool) -> dict[str, Any]:
    """What `shardctl checkpoints` shows, as plain data."""
    from ...train.manifest import list_checkpoints, resolve_checkpoint_dir, verify

    folder, one = resolve_checkpoint_dir(path)
    infos = list_checkpoints(folder.parent if one else folder)
    if one:
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
        row["status"] = "complete" if info.complete else "incomplete"
        row["problems"] = [] if info.complete else [info.why_incomplete]
        if check_hashes and info.complete:
            problems = verify(info.path)
            row["problems"] = problems
            row["status"] = "corrupt" if problems else "verified"
        rows.append(row)
    usable = [r for r in rows if r["status"] in ("complete", "verified")]
    return {
        "checkpoint_dir": str(folder.parent if one else folder),
        "checkpoints": rows,
        "latest_complete": usable[-1]["path"] if usable else None,
        "verified": check_hashes,
    }


@click.command("checkpoints")
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "--verify",
    "check_hashes",
    is_flag=True,
    help="Re-hash every file against the manifest (exit 1 if any checkpoint is corrupt).",
)
@output_option
@handle_errors
def checkpoints_cmd(path: Path, check_hashes: bool, output: str) -> None:
    """List the checkpoints of PATH: a run directory, its checkpoints/ folder or one
    step-NNNNNNNN folder. Shows step, complete or not, size, world size, backend."""
    data = collect(path, check_hashes)
    rows = data["checkpoints"]
    if output == "json":
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    elif not rows:
        click.echo(f"no checkpoints in {data['checkpoint_dir']}")
    else:
        header = f"{'STEP':>10}  {'STATUS':<10}  {'SIZE':>10}  {'WORLD':>5}  {'BACKEND':<9}  PATH"
        click.echo(header)
        for r in rows:
            world = "-" if r["world_size"] is None else str(r["world_size"])
            click.echo(
                f"{r['step']:>10}  {r['status']:<10}  {human_size(r['size_bytes']):>10}  "
                f"{world:>5}  {r['backend'] or '-':<9}  {r['path']}"
            )
            for problem in r["problems"]:
                click.echo(f"{'':>12}{problem}")
        latest = data["latest_complete"] or "none — training would start at step 0"
        if check_hashes:
            click.echo(f"resume (auto) would use: {latest}")
        else:
            click.echo(f"newest complete: {latest} (sizes checked; --verify checks sha256)")
    if any(r["status"] == "corrupt" for r in rows):
        sys.exit(1)
