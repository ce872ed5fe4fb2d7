"""`shardctl convert`: an accelerate config (or job spec) for the other backend — or,
given a checkpoint folder, the checkpoint itself (train/portable)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ..errors import ShardctlError, UsageError
from ..storage import is_object_url
from .common import echo_json, handle_errors

STDIN = "-"


@click.command("convert")
@click.argument("config_arg", metavar="CONFIG")
@click.option(
    "--to",
    "to",
    type=click.Choice(["deepspeed", "fsdp"]),
    required=True,
    help="The backend to convert to.",
)
@click.option(
    "--out",
    "out_arg",
    default=None,
    help="Write the accelerate config here (default: stdout). For a checkpoint: the new "
    "checkpoint folder (must not exist).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Accelerate config: replace --out and --ds-json if they exist (a checkpoint "
    "conversion never replaces anything).",
)
@click.option(
    "--ds-json",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="With --to deepspeed: also write a DeepSpeed JSON config here and point the "
    "accelerate config at it (needed for ZeRO++ hpZ, the HYBRID_SHARD twin).",
)
@click.option(
    "--fsdp-version",
    type=click.Choice(["1", "2"]),
    default=None,
    help="With --to fsdp: the accelerate FSDP key style (default 2, or 1 where only FSDP1 "
    "can express the sharding).",
)
@click.option(
    "--world-size",
    type=int,
    default=None,
    help="Checkpoint --to deepspeed: the number of ranks that will resume it (required).",
)
@click.option(
    "--zero-stage",
    type=int,
    default=None,
    help="Checkpoint --to deepspeed: ZeRO stage 1, 2 or 3 (default: the source's).",
)
@click.option(
    "--precision",
    default=None,
    help="Checkpoint --to fsdp: fp32, bf16-mixed (fp32 masters) or bf16-pure (bf16 "
    "masters; from fp32 masters only with --allow-downcast). Default: the source's.",
)
@click.option(
    "--allow-downcast",
    is_flag=True,
    help="Checkpoint: allow rounding fp32 masters and moments to bf16 (loses bits).",
)
@click.option(
    "--ds-writer",
    type=click.Choice(["direct", "engine"]),
    default=None,
    help="Checkpoint --to deepspeed: direct (the default) writes DeepSpeed's ZeRO files in "
    "this process, memory flat in the model size; engine has --world-size CPU processes "
    "start a ZeRO engine and save them (memory grows with the model).",
)
@click.option(
    "--layout",
    type=click.Choice(["source", "accelerate", "trainer", "plain", "shardctl"]),
    default=None,
    help="Checkpoint of another tool: whose layout the output has (default: source, the "
    "tool that wrote it: accelerate's save_state folder, the Trainer's checkpoint-N, or a "
    "plain DCP / DeepSpeed folder).",
)
@click.option(
    "--verify/--no-verify",
    default=None,
    help="Checkpoint: check every source file's sha256 against its manifest while "
    "converting, and write nothing when one differs (the default). --no-verify checks "
    "sizes only.",
)
@click.option(
    "--output",
    "-o",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Text (config on stdout, report on stderr) or one JSON document on stdout.",
)
@handle_errors
def convert_cmd(
    config_arg: str,
    to: str,
    out_arg: str | None,
    force: bool,
    ds_json: Path | None,
    fsdp_version: str | None,
    world_size: int | None,
    zero_stage: int | None,
    precision: str | None,
    allow_downcast: bool,
    ds_writer: str | None,
    layout: str | None,
    verify: bool | None,
    output: str,
) -> None:
    """Convert CONFIG (an accelerate config, a shardctl job spec, or a checkpoint folder)
    to the other backend.

    CONFIG - reads it from stdin (its kind is told from the content), e.g.
    `cat accelerate.yaml | shardctl convert - --to deepspeed`.

    \b
    A checkpoint (a step-NNNNNNNN folder, or a checkpoints/run folder: its newest
    complete one) becomes a complete checkpoint of the other backend at --out, with
    weights, Adam moments and step counts, the trainer state and a manifest:
    shardctl convert runs/x/checkpoints/step-00000200 --to fsdp --out ck/fsdp-200
    shardctl convert runs/x/checkpoints/step-00000200 --to deepspeed --world-size 8 --out ck/ds8
    Resume it with the other backend and checkpoint.resume: its path. Either may be
    in a bucket, s3://BUCKET/PREFIX/NAME (the source is downloaded first into a cache
    folder under the temporary directory; an s3:// --out is uploaded once converted).

    \b
    A checkpoint accelerate, the HF Trainer, DeepSpeed or a DCP script wrote is
    converted laid out for the same tool (optimizer state included; --layout picks
    another), e.g. an accelerate save_state folder under DeepSpeed → one that
    accelerator.load_state reads under FSDP:
    shardctl convert ckpt/checkpoint_3 --to fsdp --out ckpt/checkpoint_3-fsdp

    \b
    Follows Accelerate's "FSDP vs DeepSpeed" mapping: FULL_SHARD↔ZeRO-3,
    SHARD_GRAD_OP↔2, NO_SHARD↔0, HYBRID_SHARD↔3 (+hpZ), offload, RAM-efficient
    loading ⇄ zero3_init_flag, state dict type ⇄ zero3_save_16bit_model,
    mixed precision, gradient accumulation and clipping. Settings without a
    twin and the precision difference are reported, never dropped silently.
    """
    checkpoint_options = {
        "--world-size": world_size,
        "--zero-stage": zero_stage,
        "--precision": precision,
        "--allow-downcast": allow_downcast or None,
        "--ds-writer": ds_writer,
        "--layout": layout,
        "--verify/--no-verify": verify,
    }
    config, out = Path(config_arg), Path(out_arg) if out_arg is not None else None
    if is_object_url(config_arg) or (out_arg is not None and is_object_url(out_arg)):
        _convert_in_bucket(
            config_arg, to, out_arg, world_size=world_size, zero_stage=zero_stage,
            precision=precision, allow_downcast=allow_downcast, verify=verify is not False,
            output=output, ds_writer=ds_writer, layout=layout,
        )  # fmt: skip
        return
    if str(config) != STDIN and config.is_dir():
        if ds_json is not None or fsdp_version is not None or force:
            raise UsageError(
                f"{config} is a folder (a checkpoint); --ds-json, --fsdp-version and --force "
                "are for accelerate configs (a checkpoint conversion never replaces anything)"
            )
        _convert_checkpoint(config, to, out, world_size, zero_stage, precision, allow_downcast,
                            verify is not False, output, ds_writer, layout)  # fmt: skip
        return
    given = [name for name, value in checkpoint_options.items() if value is not None]
    if given:
        raise UsageError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for converting a "
            f"checkpoint folder; {config} is not a folder (an accelerate config or a job "
            "spec takes none of them)"
        )
    from ..convert import convert_file, convert_text
    from ..convert.output import json_document, render_ds_json, render_yaml, report_lines

    if ds_json is not None and to != "deepspeed":
        raise UsageError("--ds-json writes a DeepSpeed JSON config; it needs --to deepspeed")
    if fsdp_version is not None and to != "fsdp":
        raise UsageError("--fsdp-version chooses the FSDP key style; it needs --to fsdp")
    from_stdin = str(config) == STDIN
    for target in (out, ds_json):
        if target is not None and not from_stdin and target.resolve() == config.resolve():
            raise UsageError(f"{target} is the input CONFIG; refusing to overwrite it")
    _check_targets(out, ds_json, force)

    options = {
        "fsdp_version": int(fsdp_version) if fsdp_version else None,
        "deepspeed_json_path": str(ds_json) if ds_json is not None else None,
    }
    if from_stdin:
        # A relative deepspeed_config_file is then found from the working directory,
        # as `accelerate launch` finds it.
        result = convert_text(_read_stdin(), to, **options)  # type: ignore[arg-type]
    else:
        result = convert_file(config, to, **options)  # type: ignore[arg-type]
    text = render_yaml(result.accelerate_config)
    written: list[str] = []
    if ds_json is not None and result.deepspeed_json is not None:
        _write(ds_json, render_ds_json(result.deepspeed_json))
        written.append(str(ds_json))
    if out is not None:
        _write(out, text)
        written.append(str(out))

    if output == "json":
        click.echo(json_document(result, written))
        return
    if out is None:
        click.echo(text, nl=False)
    for line in report_lines(result):
        click.echo(line, err=True)
    for path in written:
        click.echo(f"wrote {path}", err=True)


def _read_stdin() -> str:
    """CONFIG `-`: the whole of stdin; never wait on a terminal or accept nothing."""
    stream = sys.stdin
    if stream is None or stream.isatty():
        # Waiting for typed YAML would look like a hang; nobody means that.
        raise UsageError(
            "CONFIG is - (read stdin) but stdin is a terminal; pipe a config in, e.g. "
            "cat accelerate.yaml | shardctl convert - --to deepspeed"
        )
    text = stream.read()
    if not text.strip():
        raise UsageError(
            "CONFIG is - (read stdin) but stdin is empty; accepted: an accelerate config or "
            "a shardctl job spec on stdin"
        )
    return text


def _check_targets(out: Path | None, ds_json: Path | None, force: bool) -> None:
    """Refuse, before anything is written, to replace a file without --force."""
    if out is not None and ds_json is not None and out.resolve() == ds_json.resolve():
        raise UsageError(f"--out and --ds-json are both {out}; give two different files")
    for option, target in (("--out", out), ("--ds-json", ds_json)):
        if target is None or not (target.exists() or target.is_symlink()):
            continue
        if target.is_dir():
            raise UsageError(f"{option} {target} is a folder; give a file path")
        if not force:
            raise UsageError(
                f"{option} {target} already exists; refusing to overwrite it (use --force)"
            )


def _write(path: Path, text: str) -> None:
    from ..durable import storage_error, write_text_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Atomic: a full disk leaves the old file (or none), never a truncated one.
        write_text_atomic(path, text, durable=False)
    except OSError as exc:
        problem = storage_error(
            exc, path.parent, what=repr(str(path)), needed=len(text.encode()),
            aftermath="any earlier file there is unchanged",
        )  # fmt: skip
        fallback = ShardctlError(f"cannot write {str(path)!r}: {exc.strerror or exc}")
        raise problem or fallback from None


def _convert_in_bucket(source: str, to: str, out: str | None, **options: Any) -> None:
    """A checkpoint conversion where the source or --out (or both) is an s3:// URL: the
    source comes down first (verified while converted), the output goes up at the end
    (its manifest last); a local --out stays where it is."""
    from ..s3.local import fetch_checkpoint, publish_folder, refuse_existing

    if out is None:
        raise UsageError(f"{source} is a checkpoint: give --out NEW_FOLDER (or s3://...)")
    if is_object_url(out):
        refuse_existing(out)
    local_source = fetch_checkpoint(source) if is_object_url(source) else Path(source)
    if not is_object_url(out):
        _convert_checkpoint(local_source, to, Path(out), **options)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shardctl-convert-") as scratch:
        local_out = Path(scratch) / out.rstrip("/").rpartition("/")[2]
        _convert_checkpoint(local_source, to, local_out, **options)
        publish_folder(local_out, out)
    # On stderr under -o json: stdout is then one JSON document.
    click.echo(f"uploaded to {out}", err=options["output"] == "json")


def _convert_checkpoint(
    source: Path,
    to: str,
    out: Path | None,
    world_size: int | None,
    zero_stage: int | None,
    precision: str | None,
    allow_downcast: bool,
    verify: bool,
    output: str,
    ds_writer: str | None = None,
    layout: str | None = None,
) -> None:
    from ...train.portable import convert_checkpoint, describe
    from ..outclaim import output_claim

    if out is None:
        raise UsageError(
            f"{source} is a checkpoint: give --out NEW_FOLDER for the converted checkpoint"
        )
    # One writer per --out: a second conversion to it is refused, naming the first,
    # instead of removing the first one's staging folder.
    with output_claim(out, "shardctl convert"):
        report = convert_checkpoint(
            source,
            to,
            out,
            world_size=world_size,
            zero_stage=zero_stage,
            precision=precision,
            allow_downcast=allow_downcast,
            verify=verify,
            **({"ds_writer": ds_writer} if ds_writer is not None else {}),
            **({"layout": layout} if layout is not None else {}),
        )
    if output == "json":
        echo_json(report.to_json())
        return
    for line in describe(report):
        click.echo(line)
