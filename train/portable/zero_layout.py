"""Where every element of every parameter lies in DeepSpeed's ZeRO partitions.

Pure arithmetic (no torch, no DeepSpeed), read from DeepSpeed's own code and checked
file by file against what its engine saves (`tests/test_ds_direct.py`):

- ZeRO 1/2 (`DeepSpeedZeroOptimizer`): a param group's parameters, in order, form one
  flat vector, zero-padded at the end to a multiple of `2 × world` elements; rank r owns
  the r-th of `world` equal slices. What lies in rank r's slice past the last parameter
  is its `group_paddings` entry. A parameter that reaches into a slice has a
  `fragment_address(numel, start)` there: how many of its elements, and where in the
  slice they begin (`param_slice_mappings`).
- ZeRO 3 (`DeepSpeedZeroOptimizer_Stage3`): every parameter is cut into `ceil(n / world)`
  elements per rank, the last rank's piece zero-padded; a param group is cut into
  sub-groups once the per-rank elements reach `sub_group_size`, and rank r's flat fp32
  vector of a sub-group is its pieces of the sub-group's parameters, in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DP_ALIGNMENT = 2  # DeepSpeed's `nccl_start_alignment_factor`: groups align to 2 × world
SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default `zero_optimization.sub_group_size`


@dataclass(frozen=True)
class Piece:
    """`numel` elements from element `start` of parameter `name`; zeros when `name` is None."""

    name: str | None
    start: int
    numel: int


@dataclass(frozen=True)
class Fragment:
    """`numel` elements of parameter `name` at element `start` of a rank's flat slice."""

    name: str
    start: int
    numel: int


@dataclass(frozen=True)
class Zero12Slice:
    """Rank r's slice of one param group's flat vector under ZeRO 1/2."""

    pieces: list[Piece]  # the slice's elements in order, trailing zeros included
    numel: int  # the slice's length (every rank's is the same)
    padding: int  # zeros at its end (DeepSpeed's `group_paddings` entry)
    fragments: list[Fragment]  # the parameters that reach into it, in group order


def zero12_slice(params: list[tuple[str, int]], world: int, rank: int) -> Zero12Slice:
    """Rank `rank`'s slice of the flat vector of `params` (name, element count, in order)."""
    total = sum(n for _, n in params)
    align = DP_ALIGNMENT * world
    size = math.ceil(total / align) * align // world
    lo, hi = rank * size, (rank + 1) * size
    pieces: list[Piece] = []
    fragments: list[Fragment] = []
    offset = 0
    for name, numel in params:
        a, b = max(offset, lo), min(offset + numel, hi)
        if a < b:
            pieces.append(Piece(name, a - offset, b - a))
            fragments.append(Fragment(name, a - lo, b - a))
        offset += numel
    padding = size - sum(p.numel for p in pieces)
    if padding:
        pieces.append(Piece(None, 0, padding))
    return Zero12Slice(pieces, size, padding, fragments)


def zero3_per_rank(numel: int, world: int) -> int:
    """Elements of one parameter on every rank under ZeRO 3."""
    return math.ceil(numel / world)


def zero3_sub_groups(
    params: list[tuple[str, int]], world: int, sub_group_size: int = SUB_GROUP_SIZE
) -> list[list[tuple[str, int]]]:
    """One param group's parameters cut into DeepSpeed's sub-groups: a sub-group closes
    once its per-rank elements reach `sub_group_size` (or at the group's last parameter)."""
    if sub_group_size >= sum(zero3_per_rank(n, world) for _, n in params):
        return [list(params)]
    groups: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    held = 0
    for i, (name, numel) in enumerate(params):
        current.append((name, numel))
        held += zero3_per_rank(numel, world)
        if held >= sub_group_size or i == len(params) - 1:
            groups.append(current)
            current, held = [], 0
    return groups


def zero3_pieces(params: list[tuple[str, int]], world: int, rank: int) -> list[Piece]:
    """Rank `rank`'s flat vector of one sub-group: its piece of each parameter, padded."""
    pieces: list[Piece] = []
    for name, numel in params:
        per = zero3_per_rank(numel, world)
        a, b = min(rank * per, numel), min((rank + 1) * per, numel)
        if a < b:
            pieces.append(Piece(name, a, b - a))
        if per - (b - a):
            pieces.append(Piece(None, 0, per - (b - a)))
    return pieces
