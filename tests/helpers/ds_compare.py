"""Compare two DeepSpeed checkpoint folders file by file and key by key (torch.load):
the same files, the same keys in the same order, the same types and values, and
tensors of the same dtype, shape, `requires_grad` and bits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Files whose bytes differ by design between two writers: none of the state files.
BESIDE = ("latest", "zero_to_fp32.py", "zero_to_torch.py")


def _load(path: Path, mmap: bool = False) -> Any:
    from shardctl.train.backends.deepspeed import import_deepspeed

    import_deepspeed()  # the files pickle DeepSpeed's classes
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if (a.dtype, a.shape, a.requires_grad) != (b.dtype, b.shape, b.requires_grad):
            return [
                f"{where}: {a.dtype} {tuple(a.shape)} grad={a.requires_grad} vs "
                f"{b.dtype} {tuple(b.shape)} grad={b.requires_grad}"
            ]
        bits_a = a.contiguous().view(-1).view(torch.uint8) if a.numel() else a
        bits_b = b.contiguous().view(-1).view(torch.uint8) if b.numel() else b
        return [] if torch.equal(bits_a, bits_b) else [f"{where}: values differ"]
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} {a!r:.80} vs {type(b).__name__} {b!r:.80}"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} vs {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, list | tuple):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{where}[{i}]")
        ]
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return differences(vars(a), vars(b), f"{where}.__dict__")
    return [] if a == b else [f"{where}: {a!r:.80} vs {b!r:.80}"]


def folder_differences(a: Path, b: Path, mmap: bool = False) -> list[str]:
    """Every difference between the DeepSpeed files of checkpoints `a` and `b` (`mmap`:
    tensors mapped from the files, for checkpoints larger than memory)."""
    names_a = sorted(p.name for p in (a / "deepspeed").iterdir())
    names_b = sorted(p.name for p in (b / "deepspeed").iterdir())
    if names_a != names_b:
        return [f"files {names_a} vs {names_b}"]
    out = []
    for name in names_a:
        files = (_load(a / "deepspeed" / name, mmap), _load(b / "deepspeed" / name, mmap))
        out += differences(*files, name)
        del files
    for name in BESIDE:
        if (a / name).is_file() != (b / name).is_file() or (
            (a / name).is_file() and (a / name).read_bytes() != (b / name).read_bytes()
        ):
            out.append(f"{name} differs")
    return out
