"""The torch-free DCP writer behind `shardctl convert --to fsdp`: what it writes is what
torch writes — records `torch.load` reads, a `.metadata` equal to DCP's own, the same
tensors after a DCP load — and its sha256 is the file's."""

from __future__ import annotations

import hashlib
import io
import pickle
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from shardctl.train.consolidate.io import Segment, SourceTensor
from shardctl.train.portable import dcp_out, torchsave_out
from shardctl.train.portable.dcp_out import write_dcp, write_dcp_with_torch
from shardctl.train.portable.state import PortableState
from shardctl.train.portable.torchsave_out import (
    HashedFile,
    object_record,
    read_blocks,
    tensor_record,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool]


def _record_bytes(tmp_path: Path, write) -> bytes:
    out = HashedFile(tmp_path / "rec")
    offset, length = write(out)
    digest = out.close()
    data = (tmp_path / "rec").read_bytes()
    assert digest == hashlib.sha256(data).hexdigest()
    return data[offset : offset + length]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (7,), (), (0, 4)])
def test_tensor_records_load_with_torch(tmp_path: Path, dtype, shape) -> None:
    tensor = (torch.randn(shape) * 100).to(dtype)
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    name = str(dtype).removeprefix("torch.")
    data = _record_bytes(tmp_path, lambda out: tensor_record(out, name, shape, [raw]))
    assert zipfile.ZipFile(io.BytesIO(data)).testzip() is None  # every CRC right
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert loaded.dtype == dtype and loaded.shape == tensor.shape
    assert torch.equal(loaded, tensor)


def test_object_records_load_with_torch(tmp_path: Path) -> None:
    value = {
        "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "foreach": None,
        "params": ["model.embed_tokens.weight", "lm_head.weight"], "big": 2**70, "neg": -5,
        "text": "tab\there ü",
    }  # fmt: skip
    for obj in (value, 0.001, [1, 2, 70000], ()):
        data = _record_bytes(tmp_path, lambda out, obj=obj: object_record(out, obj))
        assert torch.load(io.BytesIO(data), weights_only=True) == obj
        (tmp_path / "rec").unlink()


def _portable(tmp_path: Path) -> tuple[PortableState, dict[str, torch.Tensor]]:
    """A state whose tensors lie in one raw file, as DeepSpeed's flat partitions do."""
    torch.manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(11, 6),
        "model.norm.weight": torch.randn(6),
        "lm_head.weight": torch.randn(11, 6),
    }
    moments = {
        k: {n: torch.rand_like(t) for n, t in tensors.items()} for k in ("exp_avg", "exp_avg_sq")
    }
    blob = tmp_path / "flat.bin"
    at = 0
    with blob.open("wb") as f:

        def place(name: str, t: torch.Tensor) -> SourceTensor:
            nonlocal at
            raw = t.view(torch.uint8).numpy().tobytes()
            f.write(raw)
            # two segments per tensor, as a tensor split across two ranks' partitions
            half = t.numel() // 2
            segs = [
                Segment(blob, at, half, "float32"),
                Segment(blob, at + half * 4, t.numel() - half, "float32"),
            ]
            at += len(raw)
            return SourceTensor(name, tuple(t.shape), "float32", segments=segs)

        master = {n: place(n, t) for n, t in tensors.items()}
        moms = {k: {n: place(n, t) for n, t in m.items()} for k, m in moments.items()}
        buffers = {"model.rotary.inv_freq": place("model.rotary.inv_freq", torch.rand(3))}
    state = PortableState(
        backend="deepspeed",
        world_size=2,
        zero_stage=3,
        groups=[["model.embed_tokens.weight", "lm_head.weight"], ["model.norm.weight"]],
        hyper=[
            {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1, "foreach": None},
            {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0, "foreach": None},
        ],
        steps={n: 5.0 for n in tensors},
        master=master,
        moments=moms,
        buffers=buffers,
    )
    expected = {f"model.{n}": t for n, t in tensors.items()}
    for kind, m in moments.items():
        expected.update({f"optim.state.{n}.{kind}": t for n, t in m.items()})
    return state, expected


def _load_flat(dcp_dir: Path) -> dict[str, object]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(dcp_dir), str(dcp_dir.parent / f"{dcp_dir.name}.pt"))
    loaded = torch.load(dcp_dir.parent / f"{dcp_dir.name}.pt", weights_only=False)
    flat: dict[str, object] = {}

    def walk(prefix: str, obj: object) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, list) and obj and isinstance(obj[0], dict):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
        else:
            flat[prefix] = obj

    walk("", loaded)
    return flat


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_direct_writer_equals_dcps_own(tmp_path: Path, dtype: str) -> None:
    from torch.distributed.checkpoint.metadata import Metadata  # noqa: F401 (unpickling)

    state, expected = _portable(tmp_path)
    hashes = write_dcp(state, tmp_path / "direct", dtype)
    write_dcp_with_torch(state, tmp_path / "torch", dtype)
    for name, digest in hashes.items():
        assert digest == hashlib.sha256((tmp_path / "direct" / name).read_bytes()).hexdigest()
    ours = pickle.loads((tmp_path / "direct" / ".metadata").read_bytes())
    theirs = pickle.loads((tmp_path / "torch" / ".metadata").read_bytes())
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    assert set(ours.storage_data) == set(theirs.storage_data)
    assert ours.version == theirs.version == dcp_out.DCP_VERSION
    a, b = _load_flat(tmp_path / "direct"), _load_flat(tmp_path / "torch")
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key
    for key, tensor in expected.items():  # and both hold the source, rounded as asked
        assert torch.equal(a[key], tensor.to(getattr(torch, dtype))), key
    assert a["optim.state.lm_head.weight.step"].item() == 5.0
    assert a["optim.param_groups.1.weight_decay"] == 0.0


def test_records_above_the_zip32_limit_are_left_to_dcp(tmp_path: Path, monkeypatch) -> None:
    state, expected = _portable(tmp_path)
    monkeypatch.setattr(torchsave_out, "ZIP32_LIMIT", 2**20 + 100)  # every tensor: "too large"
    assert write_dcp(state, tmp_path / "out", "float32") == {}  # hashed later, as DCP wrote it
    flat = _load_flat(tmp_path / "out")
    for key, tensor in expected.items():
        assert torch.equal(flat[key], tensor), key


def test_a_truncated_source_is_named(tmp_path: Path) -> None:
    from shardctl.orchestrator.errors import CheckpointError

    blob = tmp_path / "short.bin"
    blob.write_bytes(b"\0" * 10)
    with pytest.raises(CheckpointError, match=r"short\.bin is truncated"):
        list(read_blocks([Segment(blob, 0, 4, "float32")]))
