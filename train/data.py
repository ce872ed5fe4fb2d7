"""Token batches for every rank: deterministic, sliced per rank, resumable.

Sources (exactly one in `train.data`):
- `text`: a file, or a folder of files read recursively in sorted order, as bytes —
  byte-level tokens 0..255, so there is no tokenizer to download (vocab_size 256).
- `builtin: python-stdlib`: the `.py` files of this interpreter's standard library
  (found with `sysconfig`, `site-packages` excluded), sorted — a corpus every machine has.
- `tokens`: a memory-mapped `.npy`, or a raw `.bin` of `token_dtype` (uint16/uint32).
- `factory`: `package.module:function(spec, rank, world_size)` returning an iterable of
  this rank's batches (each `micro_batch_size × (seq_len + 1)` token ids).

The corpus is cut into windows of `seq_len + 1` tokens (inputs and shifted labels).
The global sample order is a fresh pseudo-random permutation of the windows every
epoch: `i ↦ (a·i + b) mod W` with `a` coprime to `W`, drawn from the seed and epoch —
O(1) memory, so it works for token files of any size. Global micro-batch `k` holds
samples `[k·G, (k+1)·G)` of that order (G = world size × micro_batch_size), and rank
`r` reads its own `micro_batch_size` of them. The saved data position is the number of
global samples consumed, so a resumed run — at the same or another world size —
continues exactly where the order left off.
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from shardctl.orchestrator.errors import PermanentError
from shardctl.orchestrator.spec import JobSpec

from .model import load_factory


def stdlib_files() -> list[Path]:
    """The standard library's `.py` files, sorted by path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [
        p
        for p in root.rglob("*.py")
        if not skip.intersection(p.relative_to(root).parts) and p.is_file()
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
        return sorted(files, key=lambda p: p.relative_to(path).as_posix())
    # A FIFO or a device (/dev/null) exists but is no corpus: say what it is.
    state = "is not a regular file or folder" if os.path.lexists(path) else "does not exist"
    raise PermanentError(
        f"train.data.text {str(path)!r} {state}; accepted: a text file or a folder of them"
    )


def _read_bytes(files: list[Path], field: str) -> np.ndarray:
    # Files are joined with a newline so one file's end never runs into the next's start.
    parts: list[bytes] = []
    for f in files:
        parts.append(f.read_bytes())
        parts.append(b"\n")
    data = b"".join(parts)
    if not data:
        raise PermanentError(f"{field}: the corpus is empty; accepted: a corpus of text")
    return np.frombuffer(data, dtype=np.uint8)


def load_tokens(spec: JobSpec) -> np.ndarray:
    """The whole corpus as a 1-D array of token ids (memory-mapped where possible)."""
    d = spec.train.data
    if d.text is not None:
        return _read_bytes(_text_files(Path(d.text)), "train.data.text")
    if d.builtin == "python-stdlib":
        return _read_bytes(stdlib_files(), "train.data.builtin")
    assert d.tokens is not None  # factory sources never come here
    return open_tokens(d.tokens, d.token_dtype)


TOKEN_DTYPES = (np.uint16, np.uint32, np.int32, np.int64)


def open_tokens(tokens: str, token_dtype: str) -> np.ndarray:
    """`train.data.tokens` memory-mapped: a 1-D integer `.npy`, or a raw file of
    `token_dtype` whose size is a whole number of tokens. `shardctl validate` opens it
    the same way before any rank starts (`orchestrator/inputs.py`)."""
    field, path = f"train.data.tokens {tokens!r}", Path(tokens)
    if not path.is_file():
        raise PermanentError(f"{field} is not a file; accepted: a token file (.npy, or raw .bin)")
    try:
        if path.suffix == ".npy":
            arr = np.load(path, mmap_mode="r")
        else:
            dtype = np.dtype(token_dtype)
            size = path.stat().st_size
            if size % dtype.itemsize:
                raise PermanentError(
                    f"{field}: its {size} bytes are not a whole number of {token_dtype} "
                    f"tokens ({dtype.itemsize} bytes each); accepted: a raw file of "
                    "train.data.token_dtype values (is token_dtype right, or was the file cut?)"
                )
            if size == 0:
                raise PermanentError(f"{field}: the file is empty; accepted: a token file")
            arr = np.memmap(path, dtype=dtype, mode="r")
    except (ValueError, OSError, EOFError) as exc:  # a damaged or cut .npy header or body
        raise PermanentError(
            f"{field} cannot be read as tokens ({exc}); accepted: a 1-D integer .npy "
            "(numpy.save) or a raw file of train.data.token_dtype values"
        ) from None
    if arr.ndim != 1 or arr.dtype not in TOKEN_DTYPES:
        raise PermanentError(
            f"{field}: a 1-D integer array is needed, got shape {arr.shape} dtype {arr.dtype}; "
            "accepted dtypes: uint16, uint32, int32, int64"
        )
    return arr


def check_token_ids(rows: np.ndarray, vocab_size: int, where: str) -> None:
    """Every id in `rows` is an index into the model's embedding (0..vocab_size-1): an
    id past it fails inside the model with an index error (or a device assert on GPU)."""
    high, low = int(rows.max()), int(rows.min())
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise PermanentError(
            f"{where} holds token id {bad} but the model's vocab_size is {vocab_size}; "
            f"accepted: ids 0..{vocab_size - 1} (a larger vocab_size, or the tokenizer "
            "that matches the model)"
        )


class _Order:
    """Epoch-wise pseudo-random permutation of `n` windows, O(1) memory."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self._epoch = -1
        self._a = self._b = 0

    def _draw(self, epoch: int) -> None:
        rng = np.random.default_rng([self.seed, epoch])
        a = int(rng.integers(1, max(self.n, 2)))
        while math.gcd(a, self.n) != 1:
            a = a % self.n + 1
        self._a, self._b, self._epoch = a, int(rng.integers(0, self.n)), epoch

    def window(self, sample: int) -> int:
        epoch, i = divmod(sample, self.n)
        if epoch != self._epoch:
            self._draw(epoch)
        return (self._a * i + self._b) % self.n


class TokenBatches:
    """This rank's micro-batches; `Stateful` (state: global samples consumed)."""

    def __init__(
        self,
        tokens: np.ndarray,
        spec: JobSpec,
        rank: int,
        world_size: int,
        vocab_size: int | None = None,
    ) -> None:
        t = spec.train
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.source = _source_field(spec)
        self.seq_len = t.seq_len
        self.mbs = t.micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.windows = (len(tokens) - 1) // self.seq_len
        if self.windows < 1:
            raise PermanentError(
                f"{self.source}: the corpus has {len(tokens)} tokens, fewer than one "
                f"sequence of train.seq_len + 1 = {self.seq_len + 1}; accepted: a corpus of "
                "at least that many tokens, or a smaller train.seq_len"
            )
        self.order = _Order(self.windows, t.seed)
        self.sample_index = 0  # global samples consumed by all ranks together

    def next_batch(self) -> Any:
        """(micro_batch_size, seq_len + 1) int64 token ids for this rank."""
        import torch

        first = self.sample_index + self.rank * self.mbs
        rows = np.empty((self.mbs, self.seq_len + 1), dtype=np.int64)
        for j in range(self.mbs):
            start = self.order.window(first + j) * self.seq_len
            rows[j] = self.tokens[start : start + self.seq_len + 1]
        if self.vocab_size is not None:
            check_token_ids(rows, self.vocab_size, f"{self.source} (sample {first})")
        self.sample_index += self.world_size * self.mbs
        return torch.from_numpy(rows)

    def state_dict(self) -> dict[str, Any]:
        return {"sample_index": self.sample_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sample_index = int(state["sample_index"])


class FactoryBatches:
    """Batches from a user factory; the position is the number of batches drawn.

    On resume the factory is called again and the batches already trained on are
    skipped (unless the iterable has its own `state_dict`/`load_state_dict`), so a
    deterministic factory resumes exactly.
    """

    def __init__(self, spec: JobSpec, rank: int, world_size: int) -> None:
        assert spec.train.data.factory is not None
        self.ref = spec.train.data.factory
        self.source = load_factory(self.ref, "train.data.factory")(spec, rank, world_size)
        self.iterator: Iterator[Any] = iter(self.source)
        self.drawn = 0

    def next_batch(self) -> Any:
        import torch

        try:
            batch = next(self.iterator)
        except StopIteration:
            raise PermanentError(
                f"train.data.factory {self.ref!r} ran out of batches after {self.drawn}; "
                "it must yield at least train.steps × train.grad_accum batches per rank"
            ) from None
        self.drawn += 1
        return torch.as_tensor(np.asarray(batch), dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        own = getattr(self.source, "state_dict", None)
        return {"drawn": self.drawn, "source": own() if callable(own) else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = getattr(self.source, "load_state_dict", None)
        if callable(own) and state.get("source") is not None:
            own(state["source"])
        else:
            for _ in range(int(state["drawn"])):
                next(self.iterator)
        self.drawn = int(state["drawn"])


def _source_field(spec: JobSpec) -> str:
    d = spec.train.data
    if d.tokens is not None:
        return f"train.data.tokens {d.tokens!r}"
    return f"train.data.text {d.text!r}" if d.text is not None else "train.data.builtin"


def build_data(
    spec: JobSpec, rank: int, world_size: int, vocab_size: int | None = None
) -> TokenBatches | FactoryBatches:
    """This rank's batches; with `vocab_size`, every token id read is checked against it."""
    if spec.train.data.factory is not None:
        return FactoryBatches(spec, rank, world_size)
    return TokenBatches(load_tokens(spec), spec, rank, world_size, vocab_size)
