"""Checkpoints shardctl did not write: recognise them, name their format and step, and
check what their own format can prove. Torch-free (the pickles are read without their
data, `consolidate/torchzip.py`), so `shardctl checkpoints` stays fast.

A shardctl checkpoint is a `step-NNNNNNNN/` folder committed by its `manifest.json`
(`manifest.py`). The folders users bring have no manifest; each tool has its own layout
and its own commit point:

- `dcp`: `torch.distributed.checkpoint.save` (torchtitan too): `.metadata` and
  `__R_I.distcp`; committed by `.metadata`, written last.
- `deepspeed`: `engine.save_checkpoint(dir)`: `latest` and `<tag>/*_states.pt`;
  committed by `latest`, written last.
- `accelerate+deepspeed`: `accelerator.save_state()` under DeepSpeed: `latest`,
  `pytorch_model/` (the tag), `random_states_*.pkl`; committed by `latest`.
- `accelerate+fsdp`: `accelerator.save_state()` under FSDP (sharded state dict):
  `pytorch_model_fsdp_0/` and `optimizer_0/`, a DCP folder each.
- `accelerate`: `accelerator.save_state()` unsharded: `model.safetensors` and
  `optimizer.bin` (no commit point: sizes only); under FSDP with accelerate's default
  `FULL_STATE_DICT`: `pytorch_model_fsdp.bin` and `optimizer.bin`, torch.save files
  of the full state (each checked for a whole zip).
- `trainer+deepspeed`, `trainer+fsdp`, `trainer`: the HF Trainer's `checkpoint-N/`
  (`trainer_state.json` beside the same files as above: `latest` + `global_stepN/`,
  `pytorch_model_fsdp_0/`, or `model.safetensors`).

None of them records a sha256, so a foreign checkpoint is checked for what its format
can prove: DCP's `.metadata` names every file and byte range (each must be there);
DeepSpeed's model-states file records the data-parallel world size and ZeRO stage
(every rank's file must be there and be a whole zip); a safetensors header gives the
file's exact length. A complete foreign checkpoint is never called "interrupted".
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..orchestrator.errors import CheckpointError

# What `identify` looks for, for the message of a folder that is none of them.
LOOKED_FOR = (
    "a shardctl step-NNNNNNNN folder with manifest.json, a DCP folder (.metadata), a "
    "DeepSpeed folder (latest + its tag folder), an accelerate save_state folder "
    "(pytorch_model/ + latest, pytorch_model_fsdp_0/, pytorch_model_fsdp.bin, or "
    "model.safetensors + optimizer.bin) or a Trainer checkpoint-N folder"
)

TOOLS = {
    "dcp": "torch.distributed.checkpoint",
    "deepspeed": "DeepSpeed",
    "accelerate+deepspeed": "accelerate (DeepSpeed)",
    "accelerate+fsdp": "accelerate (FSDP)",
    "accelerate": "accelerate",
    "trainer+deepspeed": "the HF Trainer (DeepSpeed)",
    "trainer+fsdp": "the HF Trainer (FSDP)",
    "trainer": "the HF Trainer",
}

DCP_METADATA = ".metadata"
DS_LATEST = "latest"
FSDP_MODEL_DIR = "pytorch_model_fsdp_0"
FSDP_OPTIM_DIR = "optimizer_0"
FSDP_FULL_MODEL = "pytorch_model_fsdp.bin"  # accelerate's FSDP FULL_STATE_DICT save
TRAINER_STATE = "trainer_state.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_STEP_IN_NAME = re.compile(r"(?:^|[-_])(?:step|checkpoint|global_step)[-_]?(\d+)$")
_GLOBAL_STEP = re.compile(r"^global_step(\d+)$")
_DS_OPTIM = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
_DS_MODEL_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt$")
_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class ForeignCheckpoint:
    """One checkpoint folder another tool wrote, as far as its own format tells."""

    path: Path  # the folder the user has (checkpoint-N, a save_state folder, ...)
    format: str  # a key of TOOLS
    backend: str  # "fsdp" (a DCP folder), "deepspeed" (a ZeRO tag folder), "full"
    model: Path  # the DCP folder, the DeepSpeed tag folder, or the safetensors file
    step: int | None
    world_size: int | None
    problems: tuple[str, ...] = ()
    hf_config: Path | None = None  # a config.json that belongs to the checkpoint
    optimizer: Path | None = None  # accelerate's optimizer_0/ (FSDP) or optimizer.bin
    # The format's own commit point (`latest`, `.metadata`) is there: problems then mean
    # a damaged checkpoint, not a save that never finished.
    committed: bool = True

    @property
    def complete(self) -> bool:
        return not self.problems

    @property
    def tool(self) -> str:
        return TOOLS[self.format]


# ------------------------------------------------------------------ recognising one


def is_shardctl(folder: Path) -> bool:
    from .manifest import MANIFEST

    return (folder / MANIFEST).is_file()


def identify(folder: Path) -> ForeignCheckpoint | None:
    """The foreign checkpoint `folder` is, or None when it is none (a shardctl step
    folder, a run folder, anything else). Never raises for a damaged checkpoint: its
    problems are in the result."""
    folder = Path(folder)
    if not folder.is_dir() or is_shardctl(folder) or _shardctl_staging(folder):
        return None
    trainer = (folder / TRAINER_STATE).is_file()
    accelerate = any(folder.glob("random_states_*.pkl"))
    if (folder / DS_LATEST).is_file() or _tag_folders(folder):
        fmt = "trainer+deepspeed" if trainer else ("accelerate+deepspeed" if accelerate or (
            folder / "pytorch_model").is_dir() else "deepspeed")  # fmt: skip
        return _deepspeed(folder, fmt, trainer)
    if (folder / FSDP_MODEL_DIR).is_dir():
        fmt = "trainer+fsdp" if trainer else "accelerate+fsdp"
        return _dcp(folder, folder / FSDP_MODEL_DIR, fmt, trainer, folder / FSDP_OPTIM_DIR)
    if (folder / DCP_METADATA).is_file() or any(folder.glob("*.distcp")):
        return _dcp(folder, folder, "dcp", False, None)
    if any(folder.glob("*_model_states.pt")):  # a DeepSpeed tag folder named directly
        return _deepspeed_tag(folder, folder, "deepspeed", _step_from_name(folder.name))
    has_weights = (folder / SAFETENSORS).is_file() or (folder / SAFETENSORS_INDEX).is_file()
    if has_weights and (trainer or accelerate or (folder / "optimizer.bin").is_file()):
        return _full(folder, "trainer" if trainer else "accelerate", trainer)
    if (folder / FSDP_FULL_MODEL).is_file():
        return _fsdp_full(folder, "trainer" if trainer else "accelerate", trainer)
    return None


def _shardctl_staging(folder: Path) -> bool:
    """A shardctl step folder whose save did not finish (no manifest yet): its DCP or
    DeepSpeed files lie one level down, which would otherwise read as a foreign
    checkpoint. A torchtitan `step-N/` holds `.metadata` at its top instead."""
    from .manifest import STEP_RE

    return bool(STEP_RE.match(folder.name)) and not (folder / DCP_METADATA).is_file()


def _tag_folders(folder: Path) -> list[Path]:
    """Sub-folders that hold DeepSpeed state files (a `latest` may be missing)."""
    with contextlib.suppress(OSError):
        return sorted(
            p for p in folder.iterdir() if p.is_dir() and any(p.glob("*_model_states.pt"))
        )
    return []


def _step_from_name(name: str) -> int | None:
    m = _STEP_IN_NAME.search(name)
    return int(m.group(1)) if m else None


def _trainer_step(folder: Path, problems: list[str]) -> int | None:
    try:
        state = json.loads((folder / TRAINER_STATE).read_text(encoding="utf-8"))
        step = state.get("global_step") if isinstance(state, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            return step
        problems.append(f"{folder / TRAINER_STATE}: no integer global_step")
    except (OSError, ValueError) as exc:
        problems.append(f"{folder / TRAINER_STATE}: unreadable ({exc})")
    return _step_from_name(folder.name)


def _config_of(folder: Path) -> Path | None:
    """The model's config.json: in the checkpoint folder (the Trainer writes one), or in
    the folder above it (a Trainer output dir, or where a user keeps one)."""
    for candidate in (folder / "config.json", folder.parent / "config.json"):
        if candidate.is_file():
            return candidate
    return None


def _deepspeed(folder: Path, fmt: str, trainer: bool) -> ForeignCheckpoint:
    problems: list[str] = []
    latest = folder / DS_LATEST
    tag_dir: Path | None = None
    if latest.is_file():
        try:
            tag = latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            tag = ""
            problems.append(f"{latest}: unreadable ({exc})")
        if tag and "/" not in tag and tag not in (".", "..") and (folder / tag).is_dir():
            tag_dir = folder / tag
        elif tag:
            problems.append(f"{latest} names the tag {tag!r}, but {folder / tag} is not a folder")
    else:
        problems.append(
            f"{folder}: no {DS_LATEST} file: DeepSpeed writes it last, so the save did not finish"
        )
    if tag_dir is None:
        tags = _tag_folders(folder)
        tag_dir = tags[-1] if tags else folder
    step = _trainer_step(folder, problems) if trainer else None
    if step is None:
        m = _GLOBAL_STEP.match(tag_dir.name)
        step = int(m.group(1)) if m else None
    found = _deepspeed_tag(folder, tag_dir, fmt, step)
    return _with(found, problems=tuple(problems) + found.problems, committed=latest.is_file())


def _deepspeed_tag(folder: Path, tag_dir: Path, fmt: str, step: int | None) -> ForeignCheckpoint:
    """Check one DeepSpeed tag folder: the model-states file says the data-parallel
    world size and the ZeRO stage; every rank's files must be there and whole."""
    problems: list[str] = []
    world = None
    model_files = sorted(tag_dir.glob("*_model_states.pt"))
    if not model_files:
        problems.append(f"{tag_dir}: no *_model_states.pt file")
    else:
        first = next((f for f in model_files if f.name.startswith("mp_rank_")), model_files[0])
        meta = _ds_model_meta(first, problems)
        world = meta.get("dp_world_size")
        if step is None and isinstance(meta.get("global_steps"), int):
            step = meta["global_steps"]
        stage = meta.get("stage")
        if isinstance(world, int) and world > 0 and isinstance(stage, int) and stage > 0:
            _expect_ranks(tag_dir, _DS_OPTIM, world, "optimizer states", problems)
            if stage == 3:
                _expect_ranks(tag_dir, _DS_MODEL_RANK, world, "model states", problems)
        for f in sorted(tag_dir.glob("*_states.pt")):
            _check_zip(f, problems)
    return ForeignCheckpoint(
        path=folder,
        format=fmt,
        backend="deepspeed",
        model=tag_dir,
        step=step,
        world_size=world if isinstance(world, int) else None,
        problems=tuple(problems),
        hf_config=_config_of(folder),
    )


def _ds_model_meta(model_file: Path, problems: list[str]) -> dict[str, Any]:
    from .consolidate.torchzip import load_refs

    try:
        state = load_refs(model_file, trusted=True)
    except CheckpointError as exc:
        problems.append(str(exc))
        return {}
    if not isinstance(state, dict):
        problems.append(f"{model_file}: not a DeepSpeed model-states file")
        return {}
    config = state.get("ds_config") if isinstance(state.get("ds_config"), dict) else {}
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    return {
        "dp_world_size": state.get("dp_world_size"),
        "global_steps": state.get("global_steps"),
        "stage": int(stage) if isinstance(stage, int) else None,
    }


def _expect_ranks(
    tag_dir: Path, pattern: re.Pattern[str], world: int, what: str, problems: list[str]
) -> None:
    ranks = {int(m.group(1)) for p in tag_dir.iterdir() if (m := pattern.search(p.name))}
    missing = sorted(set(range(world)) - ranks)
    if missing:
        problems.append(
            f"{tag_dir}: the {what} of rank(s) {missing[:8]} are missing (the checkpoint "
            f"records a data-parallel world size of {world})"
        )


def _check_zip(path: Path, problems: list[str]) -> None:
    """A torch.save file is a zip whose directory is written last: a truncated file has
    none, and a record that runs past the end is caught by the directory's offsets."""
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as zf:
            end = max((i.header_offset + i.compress_size for i in zf.infolist()), default=0)
        if end > size:
            problems.append(f"{path}: truncated ({size} bytes, its records need {end})")
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        problems.append(f"{path}: not a whole torch.save file ({exc})")


def _dcp(
    folder: Path, dcp_dir: Path, fmt: str, trainer: bool, optim_dir: Path | None
) -> ForeignCheckpoint:
    problems: list[str] = []
    committed = (dcp_dir / DCP_METADATA).is_file()
    world = _check_dcp(dcp_dir, problems)
    if optim_dir is not None and optim_dir.is_dir():
        _check_dcp(optim_dir, problems)
    elif optim_dir is not None:
        problems.append(f"{optim_dir}: missing (the optimizer state of an FSDP save)")
    return _found_in(
        folder, fmt, trainer, problems, backend="fsdp", model=dcp_dir, world_size=world,
        optimizer=optim_dir if optim_dir is not None and optim_dir.is_dir() else None,
        committed=committed,
    )  # fmt: skip


def _found_in(
    folder: Path, fmt: str, trainer: bool, problems: list[str], **found: Any
) -> ForeignCheckpoint:
    """The checkpoint in `folder` with what `found` says of its files: its step (the
    Trainer's record, else the folder's name), its config.json, and `problems` (with
    any the Trainer's record adds)."""
    step = _trainer_step(folder, problems) if trainer else _step_from_name(folder.name)
    return ForeignCheckpoint(
        path=folder,
        format=fmt,
        step=step,
        problems=tuple(problems),
        hf_config=_config_of(folder),
        **found,
    )


def _check_dcp(dcp_dir: Path, problems: list[str]) -> int | None:
    """Every file and byte range DCP's `.metadata` names is there; returns the number of
    ranks that wrote (one `__R_*.distcp` file set per rank)."""
    from .consolidate.dcp import read_metadata

    if not (dcp_dir / DCP_METADATA).is_file():
        problems.append(
            f"{dcp_dir}: no {DCP_METADATA}: DCP writes it last, so the save did not finish"
        )
        return None
    try:
        md = read_metadata(dcp_dir)
    except CheckpointError as exc:
        problems.append(str(exc))
        return None
    need: dict[str, int] = {}
    for info in md.storage.values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for rel, end in sorted(need.items()):
        try:
            size = (dcp_dir / rel).stat().st_size
        except OSError:
            problems.append(f"{dcp_dir / rel}: missing ({DCP_METADATA} names it)")
            continue
        if size < end:
            problems.append(f"{dcp_dir / rel}: {size} bytes, {DCP_METADATA} needs {end}")
    ranks = {int(m.group(1)) for rel in need if (m := _DISTCP.match(Path(rel).name))}
    return len(ranks) or None


def _full(folder: Path, fmt: str, trainer: bool) -> ForeignCheckpoint:
    problems: list[str] = []
    files = safetensors_files(folder, problems)
    for path in files:
        _check_safetensors(path, problems)
    optimizer = next(
        (folder / n for n in ("optimizer.pt", "optimizer.bin") if (folder / n).is_file()), None
    )
    return _found_in(
        folder, fmt, trainer, problems, backend="full",
        model=files[0] if len(files) == 1 else folder, world_size=None, optimizer=optimizer,
    )  # fmt: skip


def _fsdp_full(folder: Path, fmt: str, trainer: bool) -> ForeignCheckpoint:
    """accelerate's FSDP save with `FULL_STATE_DICT` (its default): rank 0's torch.save
    of the whole model, and of the whole optimizer state beside it."""
    problems: list[str] = []
    model = folder / FSDP_FULL_MODEL
    _check_zip(model, problems)
    optimizer = folder / "optimizer.bin"
    if optimizer.is_file():
        _check_zip(optimizer, problems)
    return _found_in(
        folder, fmt, trainer, problems, backend="full", model=model, world_size=None,
        optimizer=optimizer if optimizer.is_file() else None,
    )  # fmt: skip


def safetensors_files(folder: Path, problems: list[str]) -> list[Path]:
    """The weights files of a full (unsharded) save: one file, or those its index names."""
    index = folder / SAFETENSORS_INDEX
    if not index.is_file():
        return [folder / SAFETENSORS]
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        names = sorted(set(data["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        problems.append(f"{index}: unreadable ({exc})")
        return []
    return [folder / str(n) for n in names]


def _check_safetensors(path: Path, problems: list[str]) -> None:
    try:
        header, data_start = read_safetensors_header(path)
        size = path.stat().st_size
    except (OSError, CheckpointError) as exc:
        problems.append(str(exc))
        return
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
              default=0)  # fmt: skip
    if data_start + end != size:
        problems.append(f"{path}: {size} bytes, its header describes {data_start + end}")


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (name → dtype, shape, data_offsets) and where its data
    starts."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", raw)
            if length > 100 << 20:
                raise CheckpointError(f"{path}: not a safetensors file (header of {length} B)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a mapping)")
    return header, 8 + length


def _with(found: ForeignCheckpoint, **changes: Any) -> ForeignCheckpoint:
    from dataclasses import replace

    return replace(found, **changes)


# ------------------------------------------------------------------------ listing


def list_foreign(folder: Path) -> list[ForeignCheckpoint]:
    """The foreign checkpoints `folder` is or holds (one level down, and the
    `checkpoints/` of an accelerate project), oldest step first."""
    folder = Path(folder)
    one = identify(folder)
    if one is not None:
        return [one]
    found: list[ForeignCheckpoint] = []
    for parent in (folder, folder / "checkpoints"):
        with contextlib.suppress(OSError):
            for child in sorted(parent.iterdir()):
                if child.is_dir() and (hit := identify(child)) is not None:
                    found.append(hit)
    found.sort(key=lambda c: (-1 if c.step is None else c.step, str(c.path)))
    return found
