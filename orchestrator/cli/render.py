"""`shardctl render`: write every launch artifact of a job spec for one cluster.

The files are exactly those of the cluster's dry run (`submit --dry-run` shows
the same), computed once. Without `--out` they go to `<run dir>/rendered/<cluster>/`,
next to the run they launch. A file in the way that shardctl did not write is
never overwritten (see clusters/writer.py). Importing this module must stay cheap:
no torch, deepspeed, kubernetes or submitit, here or in what the dry run pulls in.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..assets import shipped_paths
from .common import (
    ClusterChoice,
    WorkloadCommand,
    command_argument,
    echo_json,
    handle_errors,
    set_option,
)


@click.command("render", cls=WorkloadCommand)
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@command_argument
@click.option(
    "--cluster", type=ClusterChoice(), default="local", show_default=True,
    help="Which cluster's artifacts (local always included: job.yaml, env.sh, launch.sh ...).",
)  # fmt: skip
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder to write to.  [default: <run dir>/rendered/<cluster>]",
)
@click.option(
    "--output", "-o", type=click.Choice(["text", "json"]), default="text", show_default=True,
    help="Human-readable summary or one JSON document on stdout.",
)  # fmt: skip
@set_option
@handle_errors
def render_cmd(
    spec: Path,
    command: tuple[str, ...],
    cluster: str,
    out: Path | None,
    output: str,
    overrides: tuple[str, ...] = (),
) -> None:
    """Render every launch artifact of SPEC for a cluster and write them to a folder.

    \b
    Runtime values (node rank, node count, master address) stay the cluster's
    own variables, expanded on each node when launch.sh runs there:
      shardctl render job.yaml --cluster slurm --out rendered/
      sbatch rendered/job.sbatch       # Slurm, by hand (or: shardctl submit)
      bash rendered/launch.sh          # anywhere else: once per node
    """
    from ..clusters import get_cluster
    from ..clusters.writer import write_rendered
    from ..rundir import RunDir
    from ..spec import load_spec, with_command

    job = with_command(load_spec(spec, overrides, cluster), command)
    backend = get_cluster(cluster)
    files = backend.dryrun(job).artifacts
    target = out if out is not None else RunDir.of(job.run_dir).rendered(cluster)
    written = write_rendered(files, target)
    # Files of an earlier render (say, a hostfile before the launcher changed) are
    # left alone, but named, so nobody mistakes them for part of this one.
    others = sorted(
        p.name
        for p in target.iterdir()
        if p.is_file() and p.name not in files and not p.name.startswith(".")
    )
    if output == "json":
        doc = {
            "spec": str(spec),
            "name": job.name,
            "cluster": cluster,
            "out": str(target),
            "files": [{"name": p.name, "path": str(p), "bytes": n} for p, n in written],
            "not_rendered_now": others,
        }
        echo_json(doc)
        return
    width = max(len(p.name) for p, _ in written)
    click.echo(f"rendered {job.name} for {cluster} into {target}/")
    for path, size in written:
        click.echo(f"  {path.name:<{width}}  {size:>7,} B")
    if others:
        click.echo(f"  (also in the folder, not from this render: {', '.join(others)})")
    hint = backend.next_step_for(job)
    click.echo(hint.format(out=target, name=job.name, spec=spec, **shipped_paths()))
