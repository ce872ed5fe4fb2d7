"""A checkpoint's training state, per parameter and independent of the backend.

Both backends keep, for every trainable parameter, the same four things: the master
weights, Adam's two moments and Adam's step count. They differ only in how those
are cut up on disk — FSDP (DCP) stores each full tensor as dim-0 row chunks keyed
by the parameter's name; DeepSpeed ZeRO stores flat per-rank partitions of each
optimizer param group. `PortableState` names every piece by parameter; nothing is
read until a writer asks for a tensor (`materialize`), so converting holds one
tensor in memory at a time, never the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...orchestrator.errors import CheckpointError
from ..consolidate.io import (
    ITEMSIZE,
    Segment,
    SourceTensor,
    _read_exact,
    _torch_dtype,
    assemble_chunks,
    segments_of_ref,
)

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class PortableState:
    """Everything a resumed run needs from the backend's part of a checkpoint."""

    backend: str  # the backend that wrote it
    world_size: int
    zero_stage: int | None
    groups: list[list[str]]  # parameter names of each optimizer param group, in order
    hyper: list[dict[str, Any]]  # each group's hyperparameters (lr, betas, weight_decay ...)
    steps: dict[str, float]  # Adam's step count per parameter
    master: dict[str, SourceTensor]  # master weights by parameter name
    moments: dict[str, dict[str, SourceTensor]]  # "exp_avg" / "exp_avg_sq" → by name
    buffers: dict[str, SourceTensor] = field(default_factory=dict)
    # Tied parameters: a second name of a parameter → the name its state is kept under
    # (lm_head.weight → model.embed_tokens.weight); the model's state dict holds both.
    shared: dict[str, str] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [name for group in self.groups for name in group]

    @property
    def master_dtype(self) -> str:
        dtypes = {t.dtype for t in self.master.values()}
        return dtypes.pop() if len(dtypes) == 1 else "mixed"

    @property
    def nbytes(self) -> int:
        tensors = [*self.master.values(), *self.buffers.values()]
        tensors += [t for kind in self.moments.values() for t in kind.values()]
        return sum(t.numel * ITEMSIZE[t.dtype] for t in tensors)


def materialize(src: SourceTensor, dtype: str | None = None) -> Any:
    """The full tensor `src` describes, read from disk into one new CPU tensor."""
    import torch

    full = torch.empty(src.numel, dtype=_torch_dtype(src.dtype))
    if src.segments:
        raw = full.view(torch.uint8).numpy()
        at = 0
        for seg in src.segments:
            _read_exact(seg.path, seg.offset, raw[at : at + seg.nbytes])
            at += seg.nbytes
        if at != len(raw):
            raise CheckpointError(f"{src.name}: the stored pieces hold {at} of {len(raw)} bytes")
    elif src.chunks:
        full = assemble_chunks(src)
    elif src.numel:
        raise CheckpointError(f"{src.name}: no stored data")
    out = full.view(src.shape)
    return out if dtype is None or dtype == src.dtype else out.to(_torch_dtype(dtype))


def row_major_segments(src: SourceTensor) -> list[Segment]:
    """The tensor's bytes in row-major order: its segments, or its dim-0 chunks in order
    (each a run of whole rows; the readers refuse other splits)."""
    if src.segments:
        return list(src.segments)
    chunks = sorted(src.chunks, key=lambda c: c.offsets)
    return [segments_of_ref(c.ref, 0, c.ref.numel) for c in chunks]


# ------------------------------------------------------------------------- readers


def read_state(step_dir: Path, manifest: dict[str, Any]) -> PortableState:
    """The portable view of a complete shardctl step folder of either backend."""
    if manifest.get("backend") == "fsdp":
        return _from_dcp(step_dir / "dcp", manifest)
    if manifest.get("backend") == "deepspeed":
        return _from_deepspeed(step_dir / "deepspeed", manifest)
    raise CheckpointError(
        f"{step_dir}: backend {manifest.get('backend')!r}; accepted: 'fsdp' or 'deepspeed'"
    )


def _from_deepspeed(ds_dir: Path, manifest: dict[str, Any]) -> PortableState:
    from ..consolidate.zero import deepspeed_optimizer_state

    _refuse_model_parallel(ds_dir)
    z = deepspeed_optimizer_state(ds_dir)
    return PortableState(
        backend="deepspeed",
        world_size=z.world_size,
        zero_stage=z.stage,
        groups=z.groups,
        hyper=z.hyper,
        steps=z.steps,
        master=z.master,
        moments={"exp_avg": z.exp_avg, "exp_avg_sq": z.exp_avg_sq},
        buffers={t.name: t for t in z.buffers},
        shared=z.shared,
    )


def _refuse_model_parallel(ds_dir: Path) -> None:
    names = sorted(p.name for p in ds_dir.glob("*mp_rank_*"))
    others = [n for n in names if "mp_rank_00" not in n]
    if others:
        raise CheckpointError(
            f"{ds_dir} holds tensor/model-parallel shards ({others[0]} ...): only data-parallel "
            "(ZeRO) checkpoints convert; merge the model-parallel shards first"
        )


def _from_dcp(dcp_dir: Path, manifest: dict[str, Any]) -> PortableState:
    return from_dcp(dcp_dir, int(manifest["world_size"]))


def from_dcp(
    dcp_dir: Path, world_size: int, optim_dir: Path | None = None, optim_key: str = "optim"
) -> PortableState:
    """The portable view of a DCP save of an FSDP run: the model under "model" in
    `dcp_dir`, the optimizer (`get_optimizer_state_dict`'s layout) under `optim_key` in
    `optim_dir` (default: the same folder; accelerate keeps it in `optimizer_0/` under
    "optimizer")."""
    from ..consolidate.dcp import dcp_tensors

    optim_dir = dcp_dir if optim_dir is None else optim_dir
    model = {t.name: t for t in dcp_tensors(dcp_dir, "model")}
    optim = {t.name: t for t in dcp_tensors(optim_dir, optim_key)}
    for t in (*model.values(), *optim.values()):
        if t.chunks and not _is_dim0(t):
            raise CheckpointError(
                f"{dcp_dir}: {t.name} is split along a dimension other than 0 (tensor "
                "parallel or a custom placement); only FSDP (dim-0) shards convert"
            )
    groups, hyper = _dcp_param_groups(optim_dir, optim_key)
    names = [n for g in groups for n in g]
    missing = [n for n in names if n not in model]
    if missing:
        raise CheckpointError(f"{dcp_dir}: optimizer params {missing[:3]} have no model weights")
    moments: dict[str, dict[str, SourceTensor]] = {kind: {} for kind in MOMENTS}
    steps: dict[str, float] = {}
    for name in names:
        for kind in MOMENTS:
            found = optim.get(f"state.{name}.{kind}")
            if found is None:
                held = sorted(k.rsplit(".", 1)[-1] for k in optim if k.startswith(f"state.{name}."))
                raise CheckpointError(
                    f"{optim_dir}: {name} has no {kind!r} optimizer state (it holds "
                    f"{held or 'none'}); only Adam/AdamW state (exp_avg, exp_avg_sq, step) "
                    "converts — a run saved before its first optimizer step has none"
                )
            moments[kind][name] = found
        step = optim.get(f"state.{name}.step")
        steps[name] = float(materialize(step).item()) if step is not None else 0.0
    others = {n: t for n, t in model.items() if n not in set(names)}
    shared = _tied(others, {n: model[n] for n in names})
    buffers = {n: t for n, t in others.items() if n not in shared}
    return PortableState(
        backend="fsdp",
        world_size=world_size,
        zero_stage=None,
        groups=groups,
        hyper=hyper,
        steps=steps,
        master={n: model[n] for n in names},
        moments=moments,
        buffers=buffers,
        shared=shared,
    )


def _tied(others: dict[str, SourceTensor], params: dict[str, SourceTensor]) -> dict[str, str]:
    """The model entries that are a parameter under a second name: DCP saves a tied
    weight under each of its names, the optimizer holds it once. An entry is tied to a
    parameter when shape, dtype and every byte are the same (read in blocks, entries
    whose shape matches no parameter are not read)."""
    shared: dict[str, str] = {}
    for name, entry in others.items():
        for owner, param in params.items():
            if (entry.shape, entry.dtype) == (param.shape, param.dtype) and _same_bytes(
                entry, param
            ):
                shared[name] = owner
                break
    return shared


def _same_bytes(a: SourceTensor, b: SourceTensor) -> bool:
    from .torchsave_out import read_blocks

    left, right = read_blocks(row_major_segments(a)), read_blocks(row_major_segments(b))
    x, y = b"", b""
    while True:
        if not x:
            x = next(left, b"")
        if not y:
            y = next(right, b"")
        if not x or not y:
            return not x and not y
        n = min(len(x), len(y))
        if x[:n] != y[:n]:
            return False
        x, y = x[n:], y[n:]


def _is_dim0(t: SourceTensor) -> bool:
    return all(all(o == 0 for o in c.offsets[1:]) for c in t.chunks)


def _dcp_param_groups(
    dcp_dir: Path, optim_key: str = "optim"
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """The optimizer's param groups (names in order + hyperparameters), stored by DCP as
    small pickled entries — read through DCP itself, without a process group."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    md = FileSystemReader(str(dcp_dir)).read_metadata()
    keys = {
        k
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, BytesStorageMetadata) and k.startswith(f"{optim_key}.param_groups.")
    }
    if not keys:
        raise CheckpointError(
            f"{dcp_dir}: no optimizer param groups under {optim_key!r} (an FSDP save of the "
            "model alone, or not an FSDP save)"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        loaded = _load_state_dict_from_keys(keys, checkpoint_id=str(dcp_dir))
    groups_raw = loaded[optim_key]["param_groups"]
    groups = [list(g["params"]) for g in groups_raw]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups_raw]
    return groups, hyper
