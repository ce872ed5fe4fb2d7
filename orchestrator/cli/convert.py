"""`shardctl convert`: an accelerate config (or job spec) for the other backend."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import ShardctlError, UsageError
from .common import handle_errors


@click.command("convert")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--to",
    "to",
    type=click.Choice(["deepspeed", "fsdp"]),
    required=True,
    help="The backend to convert to.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the accelerate config here (default: stdout).",
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
    "--output",
    "-o",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Text (config on stdout, report on stderr) or one JSON document on stdout.",
)
@handle_errors
def convert_cmd(
    config: Path,
    to: str,
    out: Path | None,
    ds_json: Path | None,
    fsdp_version: str | None,
    output: str,
) -> None:
    """Convert CONFIG (an accelerate config or a shardctl job spec) to the other backend.

    \b
    Follows Accelerate's "FSDP vs DeepSpeed" mapping: FULL_SHARD↔ZeRO-3,
    SHARD_GRAD_OP↔2, NO_SHARD↔0, HYBRID_SHARD↔3 (+hpZ), offload, RAM-efficient
    loading ⇄ zero3_init_flag, state dict type ⇄ zero3_save_16bit_model,
    mixed precision, gradient accumulation and clipping. Settings without a
    twin and the precision difference are reported, never dropped silently.
    """
    from ..convert import convert_file, render_yaml

    if ds_json is not None and to != "deepspeed":
        raise UsageError("--ds-json writes a DeepSpeed JSON config; it needs --to deepspeed")
    if fsdp_version is not None and to != "fsdp":
        raise UsageError("--fsdp-version chooses the FSDP key style; it needs --to fsdp")
    for target in (out, ds_json):
        if target is not None and target.resolve() == config.resolve():
            raise UsageError(f"{target} is the input CONFIG; refusing to overwrite it")

    result = convert_file(
        config,
        to,  # type: ignore[arg-type]
        fsdp_version=int(fsdp_version) if fsdp_version else None,
        deepspeed_json_path=str(ds_json) if ds_json is not None else None,
    )
    text = render_yaml(result.accelerate_config)
    written: list[str] = []
    if ds_json is not None and result.deepspeed_json is not None:
        _write(ds_json, json.dumps(result.deepspeed_json, indent=2, sort_keys=True) + "\n")
        written.append(str(ds_json))
    if out is not None:
        _write(out, text)
        written.append(str(out))

    if output == "json":
        click.echo(json.dumps({**result.to_json(), "written": written}, indent=2, sort_keys=True))
        return
    if out is None:
        click.echo(text, nl=False)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    if result.spec_strategy is not None:
        strategy = json.dumps(result.spec_strategy, sort_keys=False)
        click.echo(f"in the job spec, this backend is: strategy: {strategy}", err=True)
    for path in written:
        click.echo(f"wrote {path}", err=True)


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ShardctlError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
