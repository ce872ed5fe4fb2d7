"""`shardctl doctor SPEC --cluster C`: pre-flight checks, one line each with the fix."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .common import ClusterChoice, echo_json, handle_errors, output_option, set_option


@click.command("doctor")
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--cluster", type=ClusterChoice(), default="local", show_default=True)
@click.option(
    "--checkpoints",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where earlier checkpoints of this job (or the same model) are, for the save "
    "times.  [default: the spec's checkpoint dir]",
)
@set_option
@output_option
@handle_errors
def doctor_cmd(
    spec: Path,
    cluster: str,
    checkpoints: Path | None,
    output: str,
    overrides: tuple[str, ...] = (),
) -> None:
    """Check SPEC against CLUSTER before anything is queued; exit 1 if a check fails.

    \b
    Node rank from each node's environment, a master address the other nodes reach,
    a free port, one shared checkpoint file system (Slurm: a short srun on every
    node), the preemption budget against the measured saves, the network interface.
    """
    from ..doctor import run_doctor
    from ..spec import load_spec

    job = load_spec(spec, overrides, cluster)
    checks = run_doctor(job, cluster, str(checkpoints) if checkpoints else None)
    failed = any(c.status == "fail" for c in checks)
    if output == "json":
        echo_json({"name": job.name, "cluster": cluster, "ok": not failed,
                   "checks": [c.to_json() for c in checks]})  # fmt: skip
    else:
        click.echo(f"{job.name} on {cluster}:")
        for check in checks:
            click.echo(f"  {check.line()}")
        counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "fail", "skip")}
        click.echo("  " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    sys.exit(1 if failed else 0)
