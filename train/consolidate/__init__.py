"""Consolidate a sharded checkpoint (FSDP/DCP or DeepSpeed ZeRO) into safetensors.

Torch-light offline tooling: no process group, no model, no GPU. It runs on a login
node or a laptop; torch is imported only where a checkpoint format needs it (DCP's
metadata, unpickling DeepSpeed's files without their data, dtype casts), inside the
functions that need it, so `shardctl consolidate --help` stays cheap.

    from shardctl.train.consolidate import consolidate
    result = consolidate(Path("runs/x/checkpoints/step-00000200"), Path("runs/x/model"))

Streaming: the readers only compute where every byte of every full tensor lies (from
DCP's `.metadata` or DeepSpeed's pickles read without their data); the writer then
copies tensor by tensor, file to file, into safetensors shards whose headers are
written first. Memory stays bounded by the largest tensor (by a 64 MiB block for the
common dim-0-sharded case), never by the model.

No process group is needed: the training loop calls `consolidate` on rank 0 once the
final checkpoint is complete — best after `destroy_process_group()`, so the other
ranks are not left waiting in a collective while a large model is written.

The output is written to `<out>.tmp/` and renamed into place when complete, so an
interrupted consolidation never leaves a half model that looks whole, and an existing
model is only replaced (with `force`) once the new one is complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...orchestrator.durable import storage_error
from ...orchestrator.errors import CheckpointError, CorruptCheckpointError, UsageError
from ...orchestrator.outclaim import output_claim
from ..foreign import ForeignCheckpoint
from ..storage import PosixStorage
from .io import SourceTensor

log = logging.getLogger(__name__)

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
_MARKER = ".shardctl-consolidating"
TIED_HEAD = "lm_head.weight"
# Wrapper modules whose names leak into FQNs (torch.compile, activation checkpointing,
# FSDP1); the unwrapped model has none of them.
_WRAPPER_PARTS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


@dataclass(frozen=True)
class ConsolidationResult:
    checkpoint: Path
    out_dir: Path
    files: list[Path]
    total_bytes: int
    tensors: int
    seconds: float
    dtype: str
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": str(self.checkpoint),
            "out_dir": str(self.out_dir),
            "files": [str(f) for f in self.files],
            "total_bytes": self.total_bytes,
            "tensors": self.tensors,
            "seconds": round(self.seconds, 3),
            "dtype": self.dtype,
            "notes": self.notes,
        }


# ------------------------------------------------------------------ finding the checkpoint
# The layout rules (what is complete, how it is verified) belong to `manifest`, shared
# with `shardctl checkpoints` and resume; this only picks the folder to consolidate.


def _newest_hint(checkpoint_dir: Path) -> str:
    from ..manifest import list_checkpoints

    complete = [c for c in list_checkpoints(checkpoint_dir) if c.complete]
    if not complete:
        return f"there is no complete checkpoint in {checkpoint_dir}"
    return f"the newest complete checkpoint is {complete[-1].path}"


def resolve_checkpoint(path: Path) -> Path | ForeignCheckpoint:
    """A complete checkpoint from a step folder, a checkpoints folder or a run folder, or
    the checkpoint another tool wrote (`train/foreign.py`)."""
    return resolve_candidates(path)[0][0]


def resolve_candidates(path: Path) -> tuple[list[Path | ForeignCheckpoint], bool]:
    """(the complete checkpoints to try, newest first; whether one was named).

    A named step folder (or one checkpoint of another tool's layout) is the only
    candidate; a checkpoints or run folder gives every complete one, in the order resume
    tries them (`manifest.latest_complete`); a folder of another tool's checkpoints (a
    Trainer output dir) gives its complete ones, newest first."""
    from ...orchestrator.checkpoint_list import committed_folder
    from ..foreign import LOOKED_FOR, identify, list_foreign
    from ..manifest import MANIFEST, list_checkpoints, resolve_checkpoint_dir

    folder, one_step = resolve_checkpoint_dir(path)
    foreign = identify(folder)
    if foreign is not None:
        if not foreign.complete:
            raise CheckpointError(
                f"the {foreign.format} checkpoint {folder} (written by {foreign.tool}) cannot "
                "be read: " + "; ".join(foreign.problems)
            )
        return [foreign], True
    if one_step:
        if not committed_folder(folder):
            raise CheckpointError(
                f"checkpoint {folder} is incomplete (no {MANIFEST}: it was still being "
                f"written or its save was interrupted); {_newest_hint(folder.parent)}"
            )
        return [folder], True
    others = list_foreign(folder)
    # A torchtitan-style step-N/ holding DCP's .metadata is the DCP checkpoint it is, as
    # `checkpoints` lists it, never an interrupted shardctl save.
    claimed = {str(c.path) for c in others}
    found = [c for c in list_checkpoints(folder) if str(c.path) not in claimed]
    if not found:
        if not others:
            raise CheckpointError(f"{path} is not a checkpoint: looked for {LOOKED_FOR}")
        usable = [c for c in reversed(others) if c.complete]
        if not usable:
            why = "; ".join(f"{c.path.name}: {c.problems[0]}" for c in others)
            raise CheckpointError(f"{folder} holds no complete checkpoint ({why})")
        return list(usable), False
    complete = [c for c in found if c.complete]
    if not complete:
        why = "; ".join(f"{Path(c.path).name}: {c.why_incomplete}" for c in found)
        raise CheckpointError(f"{folder} holds no complete checkpoint ({why})")
    return [Path(c.path) for c in reversed(complete)], False


def read_manifest(step_dir: Path) -> dict[str, Any]:
    from .. import manifest as layout

    manifest = layout.read_manifest(step_dir)
    backend = manifest.get("backend")
    if backend not in ("fsdp", "deepspeed"):
        raise CheckpointError(
            f"{step_dir / layout.MANIFEST}: backend is {backend!r}; accepted: 'fsdp' or 'deepspeed'"
        )
    return manifest


def check_files(step_dir: Path, manifest: dict[str, Any], *, verify: bool) -> None:
    """Every file of the manifest exists with its size (always), and its sha256 (`verify`)."""
    from ..manifest import corrupt_error
    from ..manifest import verify as verify_files

    problems = verify_files(step_dir, hashes=verify, manifest=manifest)
    if problems and verify:
        raise corrupt_error(step_dir, problems)
    if problems:
        raise CheckpointError(f"checkpoint {step_dir} is damaged: " + "; ".join(problems))


def foreign_manifest(found: ForeignCheckpoint) -> tuple[dict[str, Any], list[str]]:
    """What the consolidation needs of a manifest, for a checkpoint another tool wrote:
    its backend and the model config beside it (`config.json`); plus notes."""
    notes = [
        f"{found.format} checkpoint written by {found.tool}: it records no sha256, so its "
        "files were checked for presence and size against its own index, not hashed"
    ]
    hf_config: dict[str, Any] | None = None
    if found.hf_config is None:
        notes.append(f"no config.json in {found.path} or beside it: weights only, no config.json")
    else:
        try:
            loaded = json.loads(found.hf_config.read_text(encoding="utf-8"))
            hf_config = loaded if isinstance(loaded, dict) else None
        except (OSError, ValueError) as exc:
            notes.append(f"{found.hf_config} is unreadable ({exc}): weights only")
        if hf_config is None and not notes[1:]:
            notes.append(f"{found.hf_config} is not a JSON object: weights only")
    return {"backend": found.backend, "model": {"hf_config": hf_config}}, notes


# --------------------------------------------------------------------------- the plan


def _clean(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def source_tensors(
    step_dir: Path, manifest: dict[str, Any], foreign: ForeignCheckpoint | None = None
) -> tuple[list[SourceTensor], list[str]]:
    """Every model tensor of the checkpoint, named as in the unwrapped model; plus notes.
    `foreign`: a checkpoint another tool wrote, whose model state lies where its own
    layout puts it (`train/foreign.py`)."""
    notes: list[str] = []
    if foreign is not None and foreign.backend == "full":
        from .full import safetensors_tensors, torch_save_tensors

        if foreign.model.suffix == ".bin":  # accelerate's FSDP FULL_STATE_DICT save
            tensors, shared = torch_save_tensors(foreign.model), {}
        else:
            tensors, shared = safetensors_tensors(foreign.path), {}
    elif manifest["backend"] == "fsdp":
        from .dcp import dcp_model_tensors, dcp_tensors

        if foreign is None:
            tensors, shared = dcp_tensors(step_dir / "dcp"), {}
        else:
            tensors, shared = dcp_model_tensors(foreign.model, notes), {}
    else:
        from .zero import deepspeed_tensors

        where = step_dir / "deepspeed" if foreign is None else foreign.model
        tensors, shared, notes = deepspeed_tensors(where)
    for t in tensors:
        t.name = _clean(t.name)
    by_name = {t.name: t for t in tensors}
    hf_config = (manifest.get("model") or {}).get("hf_config") or {}
    tied = bool(hf_config.get("tie_word_embeddings", False))
    # Tied output embedding (lm_head.weight = the input embedding): like save_pretrained,
    # write it once; from_pretrained re-ties it. Untied aliases get their own copy.
    for alias, source in shared.items():
        alias, source = _clean(alias), _clean(source)
        if alias not in by_name and source in by_name and not (tied and alias == TIED_HEAD):
            src = by_name[source]
            by_name[alias] = SourceTensor(alias, src.shape, src.dtype, src.segments, src.chunks)
    if tied and TIED_HEAD in by_name and len(by_name) > 1:
        del by_name[TIED_HEAD]
    return list(by_name.values()), notes


class KeyCheck(threading.Thread):
    """Checks the written names against the model's state dict. The manifest of a
    checkpoint written by shardctl's loop records those names (`model.state_keys`);
    an older one has only the config, and then the HF model is built from it on the
    meta device in the background while the data is copied, because importing
    transformers alone takes seconds."""

    def __init__(self, hf_config: dict[str, Any], known: dict[str, Any] | None = None) -> None:
        super().__init__(daemon=True, name="shardctl-keycheck")
        self.hf_config = hf_config
        self.keys: list[str] = []
        self.tied: set[str] = set()
        self.error: Exception | None = None
        self.known = _known_keys(known)
        if self.known is not None:
            self.keys, self.tied = self.known[0], set(self.known[1])

    def start(self) -> None:
        if self.known is None:
            super().start()

    def join(self, timeout: float | None = None) -> None:
        if self.known is None:
            super().join(timeout)

    def run(self) -> None:
        try:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.for_model(**self.hf_config)
            with torch.device("meta"):  # thread-local: the copy goes on on the CPU
                model = AutoModelForCausalLM.from_config(config)
            seen: set[int] = set()
            for name, tensor in model.state_dict(keep_vars=True).items():
                self.keys.append(name)
                if id(tensor) in seen:
                    self.tied.add(name)
                seen.add(id(tensor))
        except Exception as exc:  # an unknown architecture must not block consolidation
            self.error = exc

    def verify(self, names: list[str], step_dir: Path, notes: list[str]) -> None:
        self.join()
        if self.error is not None:
            notes.append(f"names not checked: the model could not be built ({self.error})")
            return
        written = set(names)
        missing = [k for k in self.keys if k not in written and k not in self.tied]
        unexpected = [k for k in names if k not in set(self.keys)]
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint {step_dir} does not match its model config: "
                f"missing {missing[:8]}{' …' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}"
            )


def _known_keys(known: Any) -> tuple[list[str], list[str]] | None:
    """The recorded names, or None when absent or not two lists of strings (then the
    model is rebuilt instead of trusting a damaged entry)."""
    if not isinstance(known, dict):
        return None
    names, tied = known.get("names"), known.get("tied", [])
    ok = all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in (names, tied))
    return (list(names), list(tied)) if ok and names else None


# ------------------------------------------------------------------------- the output


def _check_out(out_dir: Path, force: bool) -> None:
    from .outdir import foreign_entries

    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        if not foreign_entries(out_dir):  # e.g. what consolidate_on_finish wrote
            raise UsageError(
                f"output {out_dir} already holds a consolidated model (a run with "
                "checkpoint.consolidate_on_finish writes one at its end); pass --force to "
                "write it again from this checkpoint, or --out to write it elsewhere"
            )
        raise UsageError(
            f"output {out_dir} exists and is not empty; pass --force to replace it "
            "(it is replaced only once the new model is complete)"
        )


def _storage(out_dir: Path, durable: bool) -> PosixStorage:
    """The output is published like a checkpoint (`orchestrator/storage.py`): staged in
    `<out>.tmp/`, which carries a marker so that a leftover that is not ours is
    refused instead of deleted."""
    return PosixStorage(out_dir.parent, durable=durable, staging_marker=_MARKER)


# The models the built-in loop builds from a config (`llama:`): named without importing
# transformers, which a consolidation of recorded names otherwise never needs.
_CAUSAL_LM = {"llama": "LlamaForCausalLM"}


def causal_lm_class(model_type: Any) -> str | None:
    """transformers' causal-LM class name for a config's model_type (None: unknown).
    Other model types are looked up in transformers only when it is imported already
    (the name check imported it): seconds of import for one word are not spent."""
    import sys

    if not isinstance(model_type, str):
        return None
    if model_type in _CAUSAL_LM:
        return _CAUSAL_LM[model_type]
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def _write_config(hf_config: dict[str, Any], dtype: str, out: Path) -> None:
    """config.json as `config.to_dict()` recorded it, with the dtype written; plus the
    generation_config.json that save_pretrained derives from the same config."""
    config = dict(hf_config)
    if not config.get("architectures"):
        # Serving engines (vLLM, TGI) pick the model class from it; save_pretrained
        # writes it, a config built directly (LlamaConfig(...)) has None.
        architecture = causal_lm_class(config.get("model_type"))
        if architecture is not None:
            config["architectures"] = [architecture]
    # transformers ≥ 5 calls it `dtype`, older releases `torch_dtype`: keep the one used.
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = DTYPES[dtype]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    token_ids = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    gen = {k: config[k] for k in token_ids if config.get(k) is not None}
    if gen:
        gen["_from_model_config"] = True
        if "transformers_version" in config:
            gen["transformers_version"] = config["transformers_version"]
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


# ---------------------------------------------------------------------------- the API


def consolidate(
    checkpoint: Path,
    out_dir: Path,
    *,
    dtype: str = "fp32",
    max_shard_bytes: int = 5 * 2**30,
    progress: bool | Callable[[int, int], None] = False,
    force: bool = False,
    verify: bool = True,
    durable: bool | None = None,
) -> ConsolidationResult:
    """Write the model weights of `checkpoint` as safetensors (+ config.json) to `out_dir`.

    `checkpoint` is a step folder, or a checkpoints/run folder (its newest complete
    checkpoint that passes verification: the one resume would pick). `dtype` is "fp32"
    or "bf16" (floating tensors; integer buffers keep theirs). `progress` is True for a
    rich progress bar on stderr, or a callback `(bytes_done, bytes_total)`. `verify`
    (default) checks every file's sha256 against the manifest while the weights are
    copied and publishes nothing when one differs; sizes are always checked. `durable`
    fsyncs the files and folders written before the result counts as done; None
    (default) does so when an existing model is replaced (`force`) — the only case where
    a power loss could lose data that existed before. A new output is then written like
    torch.save/save_pretrained write theirs. Works without torch.distributed being
    initialised. A full or read-only output file system raises `StorageError` naming it.
    """
    if dtype not in DTYPES:
        raise UsageError(f"dtype {dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
    if max_shard_bytes <= 0:
        raise UsageError(f"max shard size must be positive, got {max_shard_bytes}")
    started = time.perf_counter()
    candidates, named = resolve_candidates(Path(checkpoint))
    out_dir = Path(out_dir)
    # One writer per output: a second consolidation of the same folder is refused,
    # naming the first, instead of removing its staging folder (`orchestrator/outclaim`).
    with output_claim(out_dir, "shardctl consolidate"):
        return _consolidate_newest(
            candidates, named, Path(checkpoint), out_dir, dtype, max_shard_bytes, progress,
            force, verify, durable, started,
        )  # fmt: skip


def _consolidate_newest(
    candidates: list[Path],
    named: bool,
    checkpoint: Path,
    out_dir: Path,
    dtype: str,
    max_shard_bytes: int,
    progress: bool | Callable[[int, int], None],
    force: bool,
    verify: bool,
    durable: bool | None,
    started: float,
) -> ConsolidationResult:
    """`consolidate` under the output's claim: the newest candidate that verifies."""
    _check_out(out_dir, force)  # before any reading: refuse early and cheaply
    if durable is None:
        durable = out_dir.exists()
    # Newer checkpoints that resume would skip too (damaged or unfinished) are named, as
    # the ones that fail verification below are: never an older model without a word.
    skipped: list[str] = [] if named else _newer_incomplete(checkpoint, candidates)
    for candidate in candidates if verify else candidates[:1]:
        step_dir = candidate.path if isinstance(candidate, ForeignCheckpoint) else candidate
        try:
            result = _consolidate_one(
                candidate, out_dir, dtype, max_shard_bytes, progress, verify, durable
            )
        except CorruptCheckpointError as exc:
            if named:
                raise
            # Like resume: the newest checkpoint that verifies, the others named.
            log.warning("%s", exc)
            skipped.append(f"{step_dir.name} failed verification: {'; '.join(exc.problems)}")
            continue
        notes = [*skipped, *result.notes]
        if skipped:
            notes.insert(len(skipped), f"used {step_dir.name}, the newest that resume would take")
        return dataclasses.replace(result, notes=notes, seconds=time.perf_counter() - started)
    raise CheckpointError(
        f"every complete checkpoint in {Path(checkpoint)} failed verification against its "
        "manifest (resume would skip them all); nothing was written:\n  " + "\n  ".join(skipped)
    )


def _newer_incomplete(checkpoint: Path, candidates: list[Any]) -> list[str]:
    """'step-N: why' for every checkpoint newer than the newest complete one that is not
    complete (a damaged manifest, a missing file, a save that never finished)."""
    from ..manifest import list_checkpoints, resolve_checkpoint_dir

    if not candidates or isinstance(candidates[0], ForeignCheckpoint):
        return []
    folder, _one = resolve_checkpoint_dir(checkpoint)
    newest = Path(candidates[0]).name
    return [
        f"skipped {Path(c.path).name}: {c.why_incomplete}"
        for c in list_checkpoints(folder)
        if not c.complete and Path(c.path).name > newest
    ]


def _consolidate_one(
    candidate: Path | ForeignCheckpoint,
    out_dir: Path,
    dtype: str,
    max_shard_bytes: int,
    progress: bool | Callable[[int, int], None],
    verify: bool,
    durable: bool,
) -> ConsolidationResult:
    from ..manifest import VerifyAlongside
    from .safetensors_out import out_nbytes, plan_shards, write_shards

    started = time.perf_counter()
    foreign = candidate if isinstance(candidate, ForeignCheckpoint) else None
    hashing = None
    if foreign is None:
        step_dir = Path(candidate)  # type: ignore[arg-type]
        manifest = read_manifest(step_dir)
        check_files(step_dir, manifest, verify=False)  # sizes now, sha256 alongside the copy
        hashing = VerifyAlongside(step_dir, manifest) if verify else None
        intro: list[str] = []
    else:
        # No manifest, so no sha256: what the format can prove was checked when it was
        # recognised (every file and byte range present); the note says so.
        step_dir = foreign.path
        manifest, intro = foreign_manifest(foreign)
    try:
        model_meta = manifest.get("model") or {}
        hf_config = model_meta.get("hf_config")
        check = KeyCheck(hf_config, model_meta.get("state_keys")) if hf_config else None
        if check is not None:
            check.start()
        tensors, notes = source_tensors(step_dir, manifest, foreign)
        notes = intro + notes
        if not hf_config and foreign is None:
            notes.append("no hf_config in the manifest: weights only, no config.json")
        if not tensors:
            raise CheckpointError(f"checkpoint {step_dir} holds no model tensors")
    except CheckpointError:
        # A damaged file explains itself better through its sha256 than its parse error.
        if hashing is not None:
            hashing.check()
        raise
    shards = plan_shards(tensors, DTYPES[dtype], max_shard_bytes)
    total_in = sum(
        sum(s.nbytes for s in t.segments) + sum(c.ref.nbytes for c in t.chunks) for t in tensors
    )
    total_out = sum(out_nbytes(t, DTYPES[dtype]) for t in tensors)

    storage = _storage(out_dir, durable)
    replacing = out_dir.exists()
    bar, on_bytes = _progress(progress, total_in, step_dir)
    try:
        tmp = storage.new_staging(out_dir.name)
        files = write_shards(shards, tmp, DTYPES[dtype], on_bytes, durable=durable)
        if check is not None:
            check.verify([t.name for t in tensors], step_dir, notes)
            _write_config(hf_config, dtype, tmp)
        if hashing is not None:
            hashing.check()  # before anything is published
        # config.json and the index (the shards were synced as written: cheap again)
        storage.sync(tmp, [f.name for f in tmp.iterdir() if f.name != _MARKER])
        storage.publish(out_dir.name, replace=True)  # an old model goes only now
    except BaseException as exc:
        storage.discard(out_dir.name)
        kept = f"; the existing {out_dir} is unchanged" if replacing else ""
        problem = storage_error(
            exc,
            out_dir.parent,
            what=f"the consolidated model {out_dir}",
            needed=total_out,
            aftermath=f"the half-written {storage.staging_path(out_dir.name)} was removed{kept}",
        )
        if problem is not None:
            raise problem from None
        raise
    finally:
        if bar is not None:
            bar.stop()
    return ConsolidationResult(
        checkpoint=step_dir,
        out_dir=out_dir,
        files=[out_dir / f.name for f in files],
        total_bytes=total_out,
        tensors=len(tensors),
        seconds=time.perf_counter() - started,
        dtype=dtype,
        notes=notes,
    )


def _progress(progress: bool | Callable[[int, int], None], total: int, step_dir: Path):
    if callable(progress):
        done = 0

        def on_bytes(n: int) -> None:
            nonlocal done
            done += n
            progress(done, total)

        return None, on_bytes
    if not progress:
        return None, None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(
        TextColumn("[bold]consolidating[/] {task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    task = bar.add_task(step_dir.name, total=total)
    bar.start()
    return bar, lambda n: bar.advance(task, n)
