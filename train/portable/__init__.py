"""Move a run between FSDP and DeepSpeed, and between world sizes, optimizer included.

`convert_checkpoint(step_dir, "fsdp" | "deepspeed", out)` turns one complete shardctl
checkpoint into a complete checkpoint of the other backend (or of DeepSpeed at
another world size / ZeRO stage): model weights, Adam's moments and step counts
(`state.py` reads them per parameter from either format), the trainer state
(`train_state/`: step, data position, RNG streams — copied; a run on another
world size follows the usual reshard policy), a manifest with sha256 of every
file, and one atomic publish at the end (`train/storage.py`).

- to FSDP (`dcp_out.py`): one process, no process group, one tensor in memory at a
  time. The DCP folder is world-size free.
- to DeepSpeed (`zero_out.py`): one process writes DeepSpeed's ZeRO files for N ranks
  itself (model states, each rank's flat fp32 partition and Adam state; the layout
  arithmetic is `zero_layout.py`), one tensor piece in memory at a time. The engine
  way (`ds_out.py`: N CPU ranks start a ZeRO engine over a stand-in module, load the
  state and save it; memory grows with the model) remains for `--ds-writer engine` and
  for a DeepSpeed version whose layout the direct writer was not checked against.

A DeepSpeed run also resumes a checkpoint of another world size by itself through
`engine_in.load_into_engine` (see `backends/deepspeed.py`).

Torch-light like consolidation: nothing heavier than torch is imported unless a
DeepSpeed checkpoint is written through its engine.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...orchestrator.durable import storage_error
from ...orchestrator.errors import CheckpointError, UsageError
from ...orchestrator.spec import SHARDING_TO_ZERO, ZERO_TO_SHARDING
from ..manifest import (
    FORMAT_VERSION,
    MANIFEST,
    VerifyAlongside,
    describe_files,
    list_files,
    package_version,
    write_manifest,
)
from ..storage import PosixStorage

BACKENDS = ("fsdp", "deepspeed")
DS_WRITERS = ("direct", "engine")
TRAIN_STATE = "train_state"
MAX_WORLD_SIZE = 65536


@dataclass
class ConvertReport:
    source: str
    out: str
    step: int
    source_backend: str
    backend: str
    world_size: int | None
    zero_stage: int | None
    precision: str
    nbytes: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    writer: str | None = None  # to DeepSpeed: "direct" (zero_out) or "engine" (ds_out)
    layout: str = "shardctl"  # whose layout the output has (foreign_io.LAYOUTS)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def finished(
        cls, out: Path, to: str, world_size: int | None, state: Any, started: float, **fields: Any
    ) -> ConvertReport:
        """The report of a conversion that wrote `state` for backend `to` at `out`, begun
        at `started` (`time.perf_counter`); `fields` are the rest of the report. A world
        size is said only for DeepSpeed: an FSDP checkpoint loads on any."""
        return cls(
            out=str(out),
            backend=to,
            world_size=world_size if to == "deepspeed" else None,
            nbytes=state.nbytes,
            seconds=time.perf_counter() - started,
            **fields,
        )


def convert_checkpoint(
    source: Path,
    to: str,
    out: Path,
    *,
    world_size: int | None = None,
    zero_stage: int | None = None,
    precision: str | None = None,
    allow_downcast: bool = False,
    verify: bool = True,
    ds_writer: str = "direct",
    sub_group_size: int | None = None,
    layout: str = "source",
) -> ConvertReport:
    """Convert the complete checkpoint `source` (a step folder, or a checkpoints/run
    folder: its newest complete one) to backend `to`, published at `out`.

    To DeepSpeed, `ds_writer` "direct" writes the ZeRO files in this process (the
    engine way when the direct writer cannot: a note says why), "engine" has N CPU
    ranks' ZeRO engine write them; `sub_group_size` is ZeRO-3's when the run that
    resumes does not use DeepSpeed's default.

    A checkpoint another tool wrote (accelerate, the Trainer, DeepSpeed, a DCP script)
    is written in `layout` (default: the source tool's; `foreign_io.LAYOUTS`)."""
    from ..consolidate import check_files, read_manifest, resolve_checkpoint
    from ..foreign import ForeignCheckpoint
    from .state import read_state

    t0 = time.perf_counter()
    _check_shape(world_size, zero_stage)
    step_dir = resolve_checkpoint(Path(source))
    if isinstance(step_dir, ForeignCheckpoint):
        from .foreign_io import convert_foreign

        if ds_writer != "direct" or sub_group_size is not None or allow_downcast:
            raise UsageError(
                "--ds-writer, sub_group_size and --allow-downcast are for shardctl's own "
                f"checkpoints; {step_dir.path} is a {step_dir.format} checkpoint"
            )
        return convert_foreign(
            step_dir, to, Path(out), layout=layout, world_size=world_size,
            zero_stage=zero_stage, precision=precision,
        )  # fmt: skip
    if layout not in ("source", "shardctl"):
        raise UsageError(
            f"--layout {layout}: {step_dir} is a shardctl checkpoint, written in shardctl's "
            "layout (other layouts are for checkpoints of accelerate, the Trainer, DeepSpeed "
            "or DCP)"
        )
    manifest = read_manifest(step_dir)
    _check_request(step_dir, manifest, to, world_size, zero_stage, precision)
    if ds_writer not in DS_WRITERS:
        raise UsageError(f"--ds-writer {ds_writer!r}; accepted: {', '.join(DS_WRITERS)}")
    if to == "fsdp" and ds_writer != "direct":
        raise UsageError(
            f"--ds-writer {ds_writer} chooses how a DeepSpeed checkpoint is written; it is "
            "accepted with --to deepspeed only"
        )
    out = Path(out)
    _check_out(out, step_dir)
    check_files(step_dir, manifest, verify=False)  # sizes now, sha256 alongside the reads

    # Published like a checkpoint: staged in `<out>.tmp/` (a leftover of an earlier
    # conversion that died there is removed), made visible by one rename. Staged
    # first: an --out that cannot be written is named before the source is read.
    storage = PosixStorage(out.parent)
    hashing: VerifyAlongside | None = None

    def stop_hashing() -> None:  # no thread left reading behind the error
        if hashing is not None:
            with contextlib.suppress(CheckpointError):
                hashing.problems()

    needed = sum(int(f["size"]) for f in manifest["files"].values())
    with published(storage, out, step_dir, needed, on_error=stop_hashing) as tmp:
        hashing = VerifyAlongside(step_dir, manifest) if verify else None
        try:
            state = read_state(step_dir, manifest)
        except CheckpointError:
            if hashing is not None:  # a damaged file is named by its sha256, not its parse
                hashing.check()
            raise
        notes: list[str] = []
        target_precision = _target_precision(manifest, state, to, precision, allow_downcast, notes)
        if to == "fsdp":
            from .dcp_out import write_dcp

            dtype = "bfloat16" if target_precision == "bf16-pure" else "float32"
            hashes = {f"dcp/{k}": v for k, v in write_dcp(state, tmp / "dcp", dtype).items()}
            ws, stage, writer = int(manifest["world_size"]), None, None
        else:
            stage = zero_stage or state.zero_stage or int(manifest.get("zero_stage") or 3)
            assert world_size is not None
            ws = world_size
            hashes, writer = _write_deepspeed(
                state, step_dir, tmp, stage, ws, target_precision, int(manifest["step"]),
                ds_writer, sub_group_size, notes,
            )  # fmt: skip
        _copy_train_state(step_dir, tmp)
        new_manifest = _manifest(manifest, step_dir, state, to, ws, stage, target_precision)
        files = [rel for rel in list_files(tmp) if rel != MANIFEST]
        storage.sync(tmp, files)
        new_manifest["files"] = describe_files(tmp, sorted(files), hashes)
        if hashing is not None:
            hashing.check()  # a manifest never certifies what came from damaged files
        write_manifest(tmp, new_manifest)
    return ConvertReport.finished(
        out, to, ws, state, t0, source=str(step_dir), step=int(manifest["step"]),
        source_backend=str(manifest["backend"]), zero_stage=stage, precision=target_precision,
        notes=notes, writer=writer,
    )  # fmt: skip


@contextlib.contextmanager
def published(
    storage: PosixStorage,
    out: Path,
    source: Path,
    needed: int,
    on_error: Callable[[], None] | None = None,
) -> Iterator[Path]:
    """The staging folder of the new folder `out`, made visible by one rename once the
    block ends: a conversion's output appears whole or not at all.

    On any error in the block or the publish, the staging folder is removed,
    `on_error` runs, and the error goes on; a full, over-quota or read-only disk as one
    line naming the `needed` bytes (`storage_error`) and the untouched `source`."""
    try:
        tmp = storage.new_staging(out.name)
        yield tmp
        if out.exists():  # appeared while we were writing
            raise CheckpointError(f"--out {out} appeared while converting; nothing replaced")
        storage.publish(out.name)
    except BaseException as exc:
        storage.discard(out.name)
        if on_error is not None:
            on_error()
        problem = storage_error(
            exc,
            out.parent,
            what=f"the converted checkpoint {out}",
            needed=needed,
            aftermath=f"the half-written {storage.staging_path(out.name)} was removed; "
            f"the source {source} is untouched",
        )
        if problem is not None:
            raise problem from None
        raise


def _write_deepspeed(
    state: Any,
    step_dir: Path,
    tmp: Path,
    stage: int,
    world_size: int,
    precision: str,
    step: int,
    ds_writer: str,
    sub_group_size: int | None,
    notes: list[str],
) -> tuple[dict[str, str], str]:
    """The DeepSpeed files in `tmp`; their sha256 where known, and the writer used."""
    from .ds_out import PRECISIONS, TAG, deepspeed_config, run_ranks
    from .zero_layout import SUB_GROUP_SIZE
    from .zero_out import Target, deepspeed_version, unsupported, write_zero

    if precision not in PRECISIONS:
        raise CheckpointError(
            f"a DeepSpeed checkpoint for precision {precision!r} cannot be written here; "
            f"accepted: {', '.join(PRECISIONS)} (fp16's loss scaler has no FSDP twin)"
        )
    config = deepspeed_config(stage, precision)
    if sub_group_size is not None:
        config["zero_optimization"]["sub_group_size"] = sub_group_size
    version = deepspeed_version()
    if ds_writer == "direct":
        reason = unsupported(state, version)
        if reason is None:
            assert version is not None
            target = Target(
                stage, world_size, precision, step, config, version,
                sub_group_size or SUB_GROUP_SIZE,
            )  # fmt: skip
            return write_zero(state, tmp, target), "direct"
        notes.append(
            f"written by a DeepSpeed engine on {world_size} CPU processes, whose memory grows "
            f"with the model: {reason}"
        )
    run_ranks(step_dir, tmp, stage, world_size, precision, sub_group_size)
    if not (tmp / TAG).is_dir():
        raise CheckpointError(f"DeepSpeed wrote no {TAG}/ folder into {tmp}")
    return {}, "engine"


def _check_shape(world_size: int | None, zero_stage: int | None) -> None:
    """The DeepSpeed shape asked for, checked before any source is read: another tool's
    checkpoint takes the same bounds as shardctl's (a world size of 0 divided by zero)."""
    if world_size is not None and not 1 <= world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size {world_size}; accepted: 1 to {MAX_WORLD_SIZE}")
    if zero_stage is not None and zero_stage not in (1, 2, 3):
        raise UsageError(f"--zero-stage {zero_stage}; accepted: 1, 2 or 3")


def _check_request(
    step_dir: Path,
    manifest: dict[str, Any],
    to: str,
    world_size: int | None,
    zero_stage: int | None,
    precision: str | None,
) -> None:
    if to not in BACKENDS:
        raise UsageError(f"--to {to!r}; accepted: {', '.join(BACKENDS)}")
    src = manifest["backend"]
    if to == "fsdp":
        if world_size is not None or zero_stage is not None:
            raise UsageError(
                "--world-size and --zero-stage shape a DeepSpeed checkpoint; an FSDP (DCP) "
                "checkpoint loads on any number of ranks and any sharding, so --to fsdp takes "
                "neither"
            )
        if src == "fsdp":
            raise UsageError(
                f"{step_dir} is already an FSDP checkpoint; it resumes on any world size as it "
                "is (checkpoint.resume: its path). To switch backend: --to deepspeed"
            )
        return
    if precision is not None:
        raise UsageError(
            "--precision chooses the dtype of an FSDP checkpoint; DeepSpeed keeps fp32 masters"
        )
    if world_size is None:
        raise UsageError(
            "--to deepspeed needs --world-size N: DeepSpeed ZeRO partitions the optimizer "
            "state per rank, so the checkpoint is written for the number of ranks that will "
            "resume it"
        )
    if src == "deepspeed":
        same_ws = int(manifest["world_size"]) == world_size
        same_stage = zero_stage in (None, manifest.get("zero_stage"))
        if same_ws and same_stage:
            raise UsageError(
                f"{step_dir} is already a DeepSpeed ZeRO-{manifest.get('zero_stage')} "
                f"checkpoint for {world_size} ranks; give another --world-size or "
                "--zero-stage, or --to fsdp"
            )


def _check_out(out: Path, step_dir: Path) -> None:
    if out.exists():
        kind = "file" if out.is_file() else "folder"
        raise UsageError(
            f"--out {out} already exists (a {kind}); converting never replaces anything: "
            "choose a new folder"
        )
    if not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: its parent {out.parent} is not a folder")
    resolved = out.resolve()
    if resolved == step_dir.resolve() or step_dir.resolve() in resolved.parents:
        raise UsageError(f"--out {out} lies inside the source checkpoint {step_dir}")


def _target_precision(
    manifest: dict[str, Any],
    state: Any,
    to: str,
    precision: str | None,
    allow_downcast: bool,
    notes: list[str],
) -> str:
    source = str(manifest.get("precision") or "fp32")
    bf16_masters = state.master_dtype == "bfloat16"
    if to == "deepspeed":
        if bf16_masters:
            notes.append(
                "the bf16 masters and moments (bf16-pure) were upcast to fp32: DeepSpeed keeps "
                "fp32 masters; resume with precision bf16-mixed or fp32"
            )
            return "bf16-mixed"
        if source == "fp16-mixed":
            raise UsageError(
                "a fp16-mixed checkpoint cannot go to DeepSpeed here: DeepSpeed's fp16 "
                "engine needs its loss-scaler state, which FSDP does not keep; accepted "
                "sources: fp32, bf16-mixed, bf16-pure"
            )
        return source if source != "bf16-pure" else "bf16-mixed"
    accepted = ("fp32", "bf16-mixed", "bf16-pure", "fp16-mixed")
    if precision is not None and precision not in accepted:
        raise UsageError(f"--precision {precision!r}; accepted: {', '.join(accepted)}")
    wanted = precision or source
    if wanted == "bf16-pure" and not bf16_masters:
        if not allow_downcast:
            raise UsageError(
                "--precision bf16-pure would round the fp32 master weights and Adam moments "
                "to bf16, which loses bits for good; add --allow-downcast to do it anyway"
            )
        notes.append("the fp32 masters and moments were rounded to bf16 (--allow-downcast)")
    return wanted


def _copy_train_state(step_dir: Path, tmp: Path) -> None:
    src = step_dir / TRAIN_STATE
    if src.is_dir():
        shutil.copytree(src, tmp / TRAIN_STATE)


def _manifest(
    source: dict[str, Any],
    step_dir: Path,
    state: Any,
    to: str,
    world_size: int,
    zero_stage: int | None,
    precision: str,
) -> dict[str, Any]:
    versions = {"torch": package_version("torch"), "shardctl": package_version("shardctl")}
    if to == "deepspeed":
        versions["deepspeed"] = package_version("deepspeed")
        sharding = ZERO_TO_SHARDING[int(zero_stage or 3)]
    else:
        # FSDP has no optimizer-only sharding (ZeRO-1): its nearest is shard_grad_op.
        sharding = ZERO_TO_SHARDING.get(int(source.get("zero_stage") or 3)) or "shard_grad_op"
        zero_stage = SHARDING_TO_ZERO[sharding]
    return {
        "format_version": FORMAT_VERSION,
        "step": int(source["step"]),
        "world_size": world_size,
        "backend": to,
        "sharding": sharding,
        "zero_stage": zero_stage,
        "precision": precision,
        "model": source.get("model"),
        "versions": versions,
        # The trainer state files are the source's: one per rank of its world size.
        "train_state_world_size": int(source.get("train_state_world_size") or source["world_size"]),
        "converted_from": {
            "path": str(step_dir),
            "backend": source["backend"],
            "world_size": int(source["world_size"]),
            "zero_stage": source.get("zero_stage"),
            "precision": source.get("precision"),
        },
    }


# How the tool a layout is for loads the converted folder.
_LOAD_WITH = {
    "accelerate": "accelerator.load_state(OUT) under the new backend's plugin",
    "trainer": "trainer.train(resume_from_checkpoint=OUT) under the new backend",
    "plain": "dcp.load / engine.load_checkpoint(OUT) in your script",
}


def describe(report: ConvertReport) -> list[str]:
    """The lines `shardctl convert` prints."""
    where = (
        f"DeepSpeed ZeRO-{report.zero_stage} for {report.world_size} ranks"
        if report.backend == "deepspeed"
        else "FSDP (DCP: loads on any number of ranks)"
    )
    lines = [
        f"converted {report.source_backend} step {report.step} ({report.source}) → {where}, "
        f"{report.precision}: {report.out}",
        f"  weights, Adam moments and step counts of {report.nbytes / 2**20:.1f} MiB in "
        f"{report.seconds:.1f} s",
    ]
    lines += [f"  note: {n}" for n in report.notes]
    if report.layout != "shardctl":
        lines.append(f"  laid out for {report.layout}: {_LOAD_WITH[report.layout]}")
        return lines
    backend = "deepspeed" if report.backend == "deepspeed" else "fsdp"
    lines.append(
        f"  resume it: strategy.backend: {backend} and checkpoint.resume: {report.out}"
        + (f" on {report.world_size} ranks" if report.backend == "deepspeed" else "")
    )
    return lines
