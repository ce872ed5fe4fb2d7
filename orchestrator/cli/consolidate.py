"""`shardctl consolidate`: a sharded checkpoint → safetensors a `from_pretrained` loads.

torch, transformers and DeepSpeed are imported only when the command runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import click

from ..errors import CheckpointError, SpecError, UsageError
from ..rundir import CHECKPOINTS_DIR, SPEC_FILE, RunDir
from ..storage import is_object_url
from .common import echo_json, handle_errors, human_size, output_option

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """'5GB' (10^9, as transformers counts), '2GiB' (2^30), '500MB' or plain bytes."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise UsageError(
            f"--max-shard-size {text!r} is not a size; accepted: a positive number with "
            "an optional unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def _refuse_out_over_source(out: Path, read: list[Path], checkpoint: Path) -> None:
    """--out may not be, nor hold, what is read (the folder given, the checkpoints, the
    checkpoint chosen), nor lie in the checkpoint: with --force it is replaced by the
    model (a run dir given as --out lost its checkpoints and logs)."""
    out_abs = out.resolve()
    for source in [*read, checkpoint]:
        src = source.resolve()
        how = "is" if out_abs == src else "holds" if out_abs in src.parents else None
        if how is None and source is checkpoint and src in out_abs.parents:
            how = "lies in"
        if how is not None:
            raise UsageError(
                f"--out {out} {how} {source}, which is read; accepted: a folder outside it "
                "(without --out: the run dir's model/)"
            )


def checkpoints_and_run_dir(given: Path) -> tuple[Path | str, Path | None]:
    """Where to look for the checkpoint, and the run dir whose model/ is the default out.

    A job spec or a run dir (holding the rendered job.yaml) knows both, also when
    `checkpoint.dir` points elsewhere; a checkpoints/ or step folder lies in a run dir
    only in the default layout (`<run dir>/checkpoints/step-N`). A spec's `s3://`
    checkpoint dir is returned as the URL it is.
    """
    if given.is_file() and given.suffix in (".yaml", ".yml"):
        from ..spec import load_spec  # ~0.1 s of model building: only when a spec is given

        spec = load_spec(given)
        if is_object_url(spec.checkpoint_dir):
            return spec.checkpoint_dir, Path(spec.run_dir)
        if not Path(spec.checkpoint_dir).exists():
            # Named for the spec the user gave, not as a wrong path they never typed.
            raise CheckpointError(
                f"{given}: checkpoint.dir {spec.checkpoint_dir} does not exist: this job has "
                f"saved no checkpoint here yet (run it first: shardctl submit {given})"
            )
        return Path(spec.checkpoint_dir), Path(spec.run_dir)
    if (given / SPEC_FILE).is_file():
        from ..spec import read_job_yaml

        try:
            spec = read_job_yaml(given / SPEC_FILE)
        except SpecError:
            if not (given / CHECKPOINTS_DIR).is_dir():
                raise
            # A damaged (or another version's) job.yaml: the default layout still says
            # where the checkpoints are, as `checkpoints` lists them.
            return given / CHECKPOINTS_DIR, given
        if is_object_url(spec.checkpoint_dir):
            return spec.checkpoint_dir, given
        # The rendered job.yaml names the run dir as the nodes saw it (maybe relative,
        # maybe a run dir since moved or copied: its own checkpoints are the ones below
        # it, never the original's).
        ckpt, rendered_run = Path(spec.checkpoint_dir), Path(spec.run_dir)
        if ckpt == rendered_run or rendered_run in ckpt.parents:
            ckpt = given / ckpt.relative_to(rendered_run)
        elif not ckpt.is_absolute() or not ckpt.exists():
            ckpt = given / ckpt.name
        return ckpt, given
    # The default layout, <run dir>/checkpoints/step-N: the run dir is above.
    if (given / CHECKPOINTS_DIR).is_dir():
        return given, given
    for folder in (given, given.parent):
        if folder.name == CHECKPOINTS_DIR:
            return given, folder.parent
    return given, None


@click.command("consolidate")
@click.argument("checkpoint")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output folder. Default: model/ in the run directory.",
)
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "bf16"]),
    default="fp32",
    show_default=True,
    help="dtype of the floating-point weights written.",
)
@click.option(
    "--max-shard-size",
    default="5GiB",
    show_default=True,
    help="Split into model-0000i-of-0000n.safetensors + index above this size.",
)
@click.option("--force", is_flag=True, help="Replace a non-empty output folder (once done).")
@click.option(
    "--verify/--no-verify",
    default=True,
    show_default=True,
    help="Check every file's sha256 against the manifest while copying (the newest "
    "checkpoint that passes is used, as resume does). --no-verify checks sizes only.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option(
    "--fsync/--no-fsync",
    default=None,
    help="fsync the output before it counts as done. Default: only when --force "
    "replaces an existing model.",
)
@output_option
@handle_errors
def consolidate_cmd(
    checkpoint: str,
    out: Path | None,
    dtype: str,
    max_shard_size: str,
    force: bool,
    verify: bool,
    no_progress: bool,
    fsync: bool | None,
    output: str,
) -> None:
    """Write the model weights of CHECKPOINT as safetensors with its HF config.

    CHECKPOINT is a step-NNNNNNNN folder, a checkpoints/ or run folder, or the job
    spec (the newest complete checkpoint is used), or s3://BUCKET/PREFIX[/step-NNNNNNNN]
    (downloaded first into a cache folder under the temporary directory; --out is
    then required). FSDP (DCP) and DeepSpeed ZeRO 1/2/3 checkpoints;
    DeepSpeed's fp32 master weights are what is written. Memory stays bounded by the
    largest tensor, whatever the model size.

    \b
    shardctl consolidate examples/runs/tiny-llama             # → examples/runs/tiny-llama/model
    shardctl consolidate examples/runs/tiny-llama --force     # again, over the model/ it wrote
    shardctl consolidate runs/x/checkpoints/step-00000200 --out hf/ --dtype bf16
    """
    from ...train.consolidate import consolidate, resolve_checkpoint

    max_bytes = parse_size(max_shard_size)
    if out is not None and is_object_url(str(out)):
        raise UsageError(
            f"--out {str(out)!r}: the model is written to a local folder; accepted: a "
            "folder path (upload it from there with the tool of your choice)"
        )
    if is_object_url(checkpoint):
        if out is None:
            raise UsageError(
                f"{checkpoint} is in a bucket, outside any run directory: say where the "
                "model goes with --out FOLDER"
            )
        from ..s3.local import fetch_checkpoint

        where, run_dir = fetch_checkpoint(checkpoint), None
    else:
        where, run_dir = checkpoints_and_run_dir(Path(checkpoint))
        if isinstance(where, str):  # the spec's checkpoint dir is in a bucket
            from ..s3.local import fetch_checkpoint

            where = fetch_checkpoint(where)
    chosen = resolve_checkpoint(where)  # a wrong path is named before the output is
    if out is None:
        if run_dir is None:
            raise UsageError(
                f"{checkpoint} is not inside a run directory (checkpoint.dir points "
                "elsewhere?): say where the model goes with --out, or give the job spec "
                "or the run directory instead"
            )
        out = RunDir.of(run_dir).model
    given = [] if is_object_url(checkpoint) else [Path(checkpoint)]
    step = chosen if isinstance(chosen, Path) else Path(chosen.path)  # another tool's
    _refuse_out_over_source(Path(out), [*given, Path(where)], step)
    result = consolidate(
        where,
        out,
        dtype=dtype,
        max_shard_bytes=max_bytes,
        progress=not no_progress and output == "text",
        force=force,
        verify=verify,
        durable=fsync,
    )
    if output == "json":
        echo_json(result.to_json())
        return
    rate = result.total_bytes / result.seconds if result.seconds else 0.0
    click.echo(
        f"consolidated {result.checkpoint} → {result.out_dir}: {result.tensors} tensors, "
        f"{human_size(result.total_bytes)} {result.dtype} in {len(result.files)} file(s), "
        f"{result.seconds:.1f} s ({human_size(rate)}/s)"
    )
    for note in result.notes:
        click.echo(f"note: {note}")
    click.echo(f"model: {result.out_dir}")
