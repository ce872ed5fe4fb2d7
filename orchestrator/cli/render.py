"""`shardctl render`: write every launch artifact of a job spec for one cluster.

Without `--out` the files go to `<run dir>/rendered/<cluster>/` (the run dir is
the parent of `checkpoint.dir`, by default `runs/<name>`), next to the run they
launch. Importing this module must stay cheap: no torch, deepspeed, kubernetes
or submitit, here or in what `render_artifacts` pulls in.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import ShardctlError, UsageError
from .common import handle_errors

CLUSTERS = ("local", "slurm", "k8s")
NEXT_STEP = {
    "local": "start it here: bash {out}/launch.sh",
    "slurm": "submit it: shardctl submit {spec} --cluster slurm  (each node runs launch.sh)",
    "k8s": "apply it: kubectl apply -f {out}/configmap.yaml -f {out}/pytorchjob.yaml\n"
    "       or: helm install {name} helm/shardctl-job -f {out}/values.yaml",
}


def default_out_dir(run_dir: str, cluster: str) -> Path:
    return Path(run_dir) / "rendered" / cluster


def write_artifacts(files: dict[str, str], out: Path) -> list[tuple[Path, int]]:
    """Write `files` under `out`; shell scripts become executable. Returns (path, bytes)."""
    written: list[tuple[Path, int]] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            path = out / name
            path.parent.mkdir(parents=True, exist_ok=True)
            data = content.encode("utf-8")
            path.write_bytes(data)
            path.chmod(0o755 if name.endswith(".sh") else 0o644)
            written.append((path, len(data)))
    except NotADirectoryError as exc:
        raise UsageError(f"--out {str(out)!r}: {exc.strerror} ({exc.filename})") from None
    except OSError as exc:
        raise ShardctlError(f"cannot write the rendered files to {str(out)!r}: {exc}") from None
    return written


@click.command("render")
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--cluster", type=click.Choice(CLUSTERS), default="local", show_default=True,
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
@handle_errors
def render_cmd(spec: Path, cluster: str, out: Path | None, output: str) -> None:
    """Render every launch artifact of SPEC for a cluster and write them to a folder.

    \b
    Runtime values (node rank, node count, master address) stay the cluster's
    own variables, expanded on each node when launch.sh runs there:
      shardctl render job.yaml --cluster slurm --out rendered/
      bash rendered/launch.sh          # once per node
    """
    _render(spec, cluster, out, output)


def _render(spec_path: Path, cluster: str, out: Path | None, output: str) -> None:
    from ..render import render_artifacts
    from ..spec import load_spec

    spec = load_spec(spec_path)
    files = render_artifacts(spec, cluster)
    target = out if out is not None else default_out_dir(spec.run_dir, cluster)
    written = write_artifacts(files, target)
    # Files of an earlier render (say, a hostfile before the launcher changed) are
    # left alone, but named, so nobody mistakes them for part of this one.
    others = sorted(p.name for p in target.iterdir() if p.is_file() and p.name not in files)
    if output == "json":
        doc = {
            "spec": str(spec_path),
            "name": spec.name,
            "cluster": cluster,
            "out": str(target),
            "files": [{"name": p.name, "path": str(p), "bytes": n} for p, n in written],
            "not_rendered_now": others,
        }
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    width = max(len(p.name) for p, _ in written)
    click.echo(f"rendered {spec.name} for {cluster} into {target}/")
    for path, size in written:
        click.echo(f"  {path.name:<{width}}  {size:>7,} B")
    if others:
        click.echo(f"  (also in the folder, not from this render: {', '.join(others)})")
    click.echo(NEXT_STEP[cluster].format(out=target, name=spec.name, spec=spec_path))
