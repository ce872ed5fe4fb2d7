"""The `shardctl` command line: a thin click layer over the library.

This is the only module that turns `ShardctlError`s into messages and exit codes
(2 for bad input, 1 for failures). Heavy imports (torch, deepspeed, kubernetes,
submitit) happen inside the commands that need them, never at start-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .. import __version__
from .common import (
    ClusterChoice,
    WorkloadCommand,
    command_argument,
    echo_json,
    handle_errors,
    output_option,
    set_option,
)

if TYPE_CHECKING:
    from ..clusters.base import Cluster, JobRef
    from ..spec import JobSpec


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from ..assets import chart_dir, manifests_dir

    # Where the shipped Kubernetes files are: the hints shardctl prints name them.
    click.echo(f"shardctl {__version__}")
    click.echo(f"  Helm chart: {chart_dir()}")
    click.echo(f"  manifests:  {manifests_dir()}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and where the Helm chart and manifests are installed.",
)
def cli() -> None:
    """One job spec → launch artifacts → this machine, Slurm or Kubernetes.

    \b
    shardctl init job.yaml                 write a commented starter spec
    shardctl validate job.yaml             check it (exit 2 on bad input)
    shardctl render job.yaml --cluster slurm --out rendered/
    shardctl submit job.yaml               train here with torchrun
    shardctl convert accelerate.yaml --to deepspeed
    """


@cli.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--cluster", type=ClusterChoice(), default="local", show_default=True,
    help="The cluster it is checked for, as `submit` would: on local and Slurm the files "
    "the ranks read (script, corpus, resume ...) must exist here.",
)  # fmt: skip
@set_option
@output_option
@handle_errors
def validate(
    spec: Path, output: str, cluster: str = "local", overrides: tuple[str, ...] = ()
) -> None:
    """Validate SPEC; print the derived settings."""
    from ..clusters import get_cluster
    from ..errors import SpecError
    from ..launch import precision_words
    from ..spec import load_spec

    job = load_spec(spec, overrides, cluster)
    # What `submit` refuses for this cluster (k8s: an image, a volume for several pods).
    problems = get_cluster(cluster).submit_problems(job)
    if problems:
        raise SpecError(problems, spec_source(spec, overrides))
    refuse_missing_inputs(job, cluster, source=spec_source(spec, overrides), imports=False)
    if output == "json":
        echo_json(job.to_yaml_dict())
        return
    s = job.strategy
    click.echo(
        f"{spec}: valid — {job.name}: {job.resources.nodes} node(s) × "
        f"{job.resources.procs_per_node} proc(s) = world size {job.world_size}"
        f"{_spare_words(job)}, "
        f"{job.launcher} → {s.backend} (sharding {s.sharding}, ZeRO stage {s.zero_stage}), "
        f"{precision_words(job)}, checkpoints in {job.checkpoint_dir}{_memory_words(job)}"
    )


def _spare_words(job: JobSpec) -> str:
    """Slurm's hot spares as `validate` says them (they hold nodes but train on none)."""
    spares = job.slurm.spare_nodes if job.slurm is not None else 0
    return f" (+ {spares} spare node(s) standing by in the allocation)" if spares else ""


def _memory_words(job: JobSpec) -> str:
    """The memory tier as `validate` says it, or nothing when it is off."""
    k = job.checkpoint.memory_every_steps
    if k is None:
        return ""
    where = job.checkpoint.memory_dir or "/dev/shm/shardctl (the node's tmpfs)"
    return f" (+ a copy in memory every {k} steps, in {where})"


def spec_source(spec: Path, overrides: tuple[str, ...]) -> str:
    """The spec as an error names it, with its --set changes (as `load_spec` names it)."""
    return str(spec) + (f" with --set {' '.join(overrides)}" if overrides else "")


def refuse_missing_inputs(job: JobSpec, cluster: str, *, source: str, imports: bool) -> None:
    """Where `cluster`'s ranks read the spec's files where this machine does, refuse a
    spec whose files or packages are not here (`inputs.py`), before any rank starts;
    `imports`: also import its factories (a child interpreter, seconds)."""
    from ..spec import reads_local_paths

    if not reads_local_paths(cluster):
        return
    from ..errors import SpecError
    from ..inputs import credential_problems, import_problems, input_problems

    problems = input_problems(job, cluster) + (import_problems(job) if imports else [])
    if cluster == "local":  # the ranks run here: a bucket needs this machine's credentials
        problems += credential_problems(job)
    if problems:
        raise SpecError(problems, source)


@contextlib.contextmanager
def one_writer(run_dir: str, *, here: bool, replace: bool) -> Iterator[None]:
    """Hold the run dir's submit claim and refuse (or, `replace`, cancel) a live job of
    it on any cluster (`clusters/owner.py`). A run dir on a Kubernetes volume is not
    on this machine: Kubernetes refuses a second job of the same name itself."""
    if not here:
        yield
        return
    from ..clusters.owner import live_jobs, refusal, replace_live, submit_claim
    from ..errors import ClusterError

    with submit_claim(run_dir):
        live = live_jobs(run_dir)
        if live and not replace:
            raise ClusterError(refusal(run_dir, live))
        if live:
            click.echo(
                "replacing " + "; ".join(job.describe() for job in live) + ": cancelling", err=True
            )
            replace_live(live)
        yield


@cli.command(cls=WorkloadCommand)
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@command_argument
@click.option("--cluster", type=ClusterChoice(), default="local", show_default=True)
@click.option(
    "--dry-run", is_flag=True, help="Print exactly what would be submitted; contact nothing."
)
@click.option(
    "--replace",
    is_flag=True,
    help="Replace the live job of this run dir: cancel it (on any cluster), wait for it to "
    "end, then submit; k8s: delete a job of the same name and its pods first (checkpoints on "
    "the PVC stay).",
)
@click.option(
    "--wait",
    "--follow",
    "wait",
    is_flag=True,
    help="Follow the run until it ends and exit with its code (local: streams the logs; "
    "slurm: streams every node's logs, through requeues; k8s: reports each state change; "
    "42: preempted and saved, submit again to resume; 143: cancelled).",
)
@set_option
@output_option
@handle_errors
def submit(
    spec: Path,
    command: tuple[str, ...],
    cluster: str,
    dry_run: bool,
    output: str,
    replace: bool = False,
    wait: bool = False,
    overrides: tuple[str, ...] = (),
) -> None:
    """Submit SPEC to a cluster (default: torchrun on this machine).

    \b
    shardctl submit job.yaml                          the spec's workload
    shardctl submit job.yaml -- train.py --lr 1e-3    your script instead (or -m MODULE)
    """
    from ..clusters import cluster_class
    from ..clusters.records import check_writable, code_version
    from ..errors import UsageError
    from ..spec import load_spec, with_command

    job = with_command(load_spec(spec, overrides, cluster), command)
    refuse_missing_inputs(job, cluster, source=spec_source(spec, overrides), imports=not dry_run)
    kind = cluster_class(cluster)
    if wait and not kind.can_follow:
        raise UsageError(
            f"--wait works with --cluster local, slurm or k8s, not --cluster {cluster}"
        )
    own_replace = replace and getattr(kind, "supports_replace", False)
    backend = kind(replace=True) if own_replace else kind()
    plan = backend.dryrun(job)
    if dry_run:
        if output == "json":
            echo_json({"cluster": cluster, "request": plan.text, "artifacts": plan.artifacts})
        else:
            click.echo(plan.text, nl=not plan.text.endswith("\n"))
        return
    # Where the job is recorded must take the record before the job starts: a job that
    # starts and then cannot be recorded runs on unseen by `ls`, `status` and `cancel`.
    check_writable()
    code = code_version(_code_folder(job, spec))  # the code as it is now, before it runs
    with one_writer(plan.spec.run_dir, here=kind.run_dir_here, replace=replace):
        # The same rule on every cluster: a finished run of this work starts nothing.
        done = backend.complete_run(plan)
        if done is not None:
            click.echo(f"{plan.spec.name}: run complete ({done}); nothing to do")
            return
        ref = backend.schedule(plan)
        ref = dataclasses.replace(ref, extra={**ref.extra, "code": code})
        _remember_or_cancel(backend, ref)
    if output == "json":
        echo_json(ref.to_json())
    else:
        click.echo(f"submitted {ref.name} to {cluster} as {ref.job_id}; run dir {ref.run_dir}")
        if not wait:
            click.echo(f"follow it with: shardctl status {ref.name}  /  shardctl logs {ref.name}")
    if wait:
        from .jobs import follow_submitted

        # A progress bar on a terminal, plain lines otherwise; the last word on stderr.
        sys.exit(follow_submitted(backend, ref, job))


def _code_folder(job: JobSpec, spec: Path) -> Path:
    """Whose git commit a job records: its entrypoint script's folder (or `code_dir`),
    where a user keeps their own training code; else the spec's folder."""
    entry = job.entrypoint
    own = None if entry is None else (entry.code_dir or entry.script)
    if own is None:
        return spec.absolute().parent
    path = spec.absolute().parent / own  # an absolute `own` stays as it is
    return path if path.is_dir() else path.parent


def _remember_or_cancel(backend: Cluster, ref: JobRef) -> None:
    """Record the job; when that fails after all (the state dir filled up since the
    check), cancel it rather than leave it running where no command can see it."""
    from ..clusters.records import remember, unwritable
    from ..errors import ShardctlError, StorageError

    try:
        remember(ref)
    except OSError as exc:
        job = f"{ref.name} ({ref.cluster} job {ref.job_id or '?'})"
        try:
            backend.cancel(ref)
            what = f"{job} started and was cancelled, since no command could see it"
        except (ShardctlError, OSError) as cancel_exc:
            what = f"{job} started and cancelling it failed ({cancel_exc}): stop it by hand"
        raise StorageError(unwritable(exc, aftermath=what)) from None


from .convert import convert_cmd  # noqa: E402
from .init import init_cmd  # noqa: E402

cli.add_command(convert_cmd)
cli.add_command(init_cmd)


from .render import render_cmd  # noqa: E402

cli.add_command(render_cmd)


from .checkpoints import checkpoints_cmd  # noqa: E402

cli.add_command(checkpoints_cmd)


from .consolidate import consolidate_cmd  # noqa: E402

cli.add_command(consolidate_cmd)


from .plot import plot_cmd  # noqa: E402

cli.add_command(plot_cmd)


from .doctor import doctor_cmd  # noqa: E402

cli.add_command(doctor_cmd)


from .jobs import cancel, logs, ls_cmd, ps_cmd, status  # noqa: E402

for _command in (status, logs, cancel, ls_cmd, ps_cmd):
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="shardctl")


if __name__ == "__main__":
    main()
