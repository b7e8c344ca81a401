"""A linear layer whose result for a row does not depend on the other rows of the call (CPU, oneDNN).

PyTorch's default CPU linear (MKL sgemm) picks its kernel by the number of rows, so a row's bits depend on
the call's size. oneDNN's float32 linear (`mkldnn._linear_pointwise`, on the weight as it is or packed:
the same bits) kept a row's bits in every call size measured, except that a one-row call runs another
kernel for some shapes (docs/experiments.md, "Lossless by construction"). Since that is a measurement,
`row_bounds` measures each weight shape, packing and thread count once per process (sizes 1..16, then a
ladder to 512, against the same 64 rows computed in pairs) and `rows_linear` runs every call as pieces
of measured sizes only. A bfloat16 linear computes in float32 on float32 weights and rounds once
(oneDNN's bfloat16 kernels were not one function). Invariant: rows_linear(x)[i] depends only on x[i],
the weight and the bias (checked at build time by backends.runtime.invariance).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

SMALL_SIZES = tuple(range(1, 17))  # every size a remainder may take
LADDER = (24, 31, 32, 33, 48, 63, 64, 96, 128, 192, 256, 384, 512)
COMPARED_ROWS = 64


class RowBounds(NamedTuple):
    """min_rows: 2 where a one-row call has other bits (a lone row then runs beside a copy of itself);
    max_rows: the largest call size up to which every measured size gives a row the same bits."""

    min_rows: int
    max_rows: int


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs here: on a CPU with oneDNN, float32 or bfloat16 (computed in float32)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype in (torch.float32, torch.bfloat16)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int, max_rows: int
                ) -> torch.Tensor:  # fmt: skip
    """x [..., K] -> [..., N] in x's dtype through oneDNN's float32 linear, in calls of measured sizes
    only (`row_bounds`); weight [N, K] as it is, or packed for oneDNN (backends.lowering.onednn.packed_weight)."""
    rows = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    if not weight.is_mkldnn and weight.dtype != torch.float32:
        weight = weight.float()
    bias = bias.float() if bias is not None else None
    pieces, start = [], 0
    while start < rows.shape[0]:
        size = _piece_size(rows.shape[0] - start, max_rows)
        pieces.append(_call(rows[start : start + size], weight, bias, min_rows))
        start += size
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # [M, N]
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def _piece_size(left: int, max_rows: int) -> int:
    """The largest measured size of at most min(left, max_rows) rows."""
    limit = min(left, max_rows)
    if limit <= SMALL_SIZES[-1]:
        return limit
    return max(size for size in SMALL_SIZES + LADDER if size <= limit)


def _call(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int) -> torch.Tensor:
    if rows.shape[0] >= min_rows:
        return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    pair = rows.expand(2, -1)  # [2, K]
    return torch.ops.mkldnn._linear_pointwise(pair, weight, bias, "none", [], "")[:1]


def row_bounds(weight: torch.Tensor) -> RowBounds:
    """The call sizes oneDNN's float32 linear keeps a row's bits in, for a weight of this shape and
    packing (measured once per process and thread count: module docstring)."""
    return _row_bounds(tuple(weight.shape), weight.is_mkldnn, torch.get_num_threads())


@functools.cache
def _row_bounds(shape: tuple[int, int], packed: bool, threads: int) -> RowBounds:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen)
    if packed:
        weight = torch.ops.mkldnn._reorder_linear_weight(weight)
    x = torch.randn(LADDER[-1], shape[1], generator=gen)  # [512, K]
    paired = torch.cat([_call(x[i : i + 1], weight, None, 2) for i in range(COMPARED_ROWS)])  # [64, N]
    lone_equal = torch.equal(_call(x[:1], weight, None, 1), paired[:1])
    min_rows = 1 if lone_equal else 2
    max_rows = 1
    for size in SMALL_SIZES[1:] + LADDER:
        compared = min(size, COMPARED_ROWS)
        if not torch.equal(_call(x[:size], weight, None, 1)[:compared], paired[:compared]):
            break
        max_rows = size
    return RowBounds(min_rows, max_rows)
