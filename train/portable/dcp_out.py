"""Write a `PortableState` as the DCP folder an FSDP run resumes from.

The state dict handed to `dcp.save` has the exact nesting FSDP's own save produces
(`{"model": {fqn: tensor}, "optim": {"state": {fqn: {exp_avg, exp_avg_sq, step}},
"param_groups": [...]}}`), so DCP flattens it to the same keys and a run loads it
with its usual `set_model_state_dict`/`set_optimizer_state_dict` on any world size.
Its tensors are placeholders on the meta device: DCP plans the file from their
shapes, and the planner reads each real tensor from the source only when the
writer asks for it — one tensor in memory at a time.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ..consolidate.io import SourceTensor, _torch_dtype
from .state import MOMENTS, PortableState, materialize


def write_dcp(state: PortableState, out_dir: Path, dtype: str | None = None) -> None:
    """`out_dir` (created) gets `.metadata` and one `.distcp` file. Floating tensors
    are written as `dtype` when given (masters and moments), else as stored."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItemType

    sources: dict[str, SourceTensor] = {}

    def placeholder(key: str, src: SourceTensor) -> Any:
        sources[key] = src
        out = dtype if dtype is not None and src.dtype in _FLOATING else src.dtype
        return torch.empty(src.shape, dtype=_torch_dtype(out), device="meta")

    model = {n: placeholder(f"model.{n}", t) for n, t in state.master.items()}
    model.update({n: placeholder(f"model.{n}", t) for n, t in state.buffers.items()})
    optim_state: dict[str, Any] = {}
    for name in state.names:
        entry = {k: placeholder(f"optim.state.{name}.{k}", state.moments[k][name]) for k in MOMENTS}
        # Adam keeps its step as a float32 scalar tensor per parameter.
        entry["step"] = torch.tensor(state.steps[name], dtype=torch.float32)
        optim_state[name] = entry
    groups = [
        {**hyper, "params": list(names)}
        for hyper, names in zip(state.hyper, state.groups, strict=True)
    ]
    state_dict = {"model": model, "optim": {"state": optim_state, "param_groups": groups}}

    class _ReadOnDemand(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            key = write_item.index.fqn
            if write_item.type == WriteItemType.BYTE_IO or key not in sources:
                return super().resolve_data(write_item)
            wanted = self.lookup_object(write_item.index)
            dst = str(wanted.dtype).removeprefix("torch.")
            return materialize(sources[key], dst)

    out_dir.mkdir(parents=True, exist_ok=True)
    writer = FileSystemWriter(
        str(out_dir), single_file_per_rank=True, sync_files=False, thread_count=1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state_dict, storage_writer=writer, planner=_ReadOnDemand(), no_dist=True)


_FLOATING = {"float64", "float32", "float16", "bfloat16"}
