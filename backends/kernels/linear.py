"""A linear layer whose result for a row does not depend on the other rows of the call (CPU).

A GEMM library picks its kernel by the call's shape, so a row's bits depend on how many rows the call
has: ATen's float32 mm (MKL) gives other bits at 1, 2, 3, 5, 6, 7, 9, 10 and 11 rows than at 4, 8 and
12 or more on a 2-core EPYC, and oneDNN's float32 linear (`mkldnn._linear_pointwise`, on the weight as
it is or packed: the same bits) keeps a row's bits at every size except, for some shapes, one row
(docs/experiments.md, "Lossless by construction"). Within one call size, a row's bits depend only on
the row. So each weight gets a `RowPlan`: its kernel, fixed by its size (ATen's mm where the weight
is small, under `ATEN_MAX_WEIGHT` elements: oneDNN costs about 25-40 us a call whatever the call,
ATen about 5; oneDNN above), and the call sizes measured, once per process, shape, packing and thread
count, to give every row the bits it has in a call of `REFERENCE_ROWS` (`row_plan`; a size is compared on
at least `MIN_COMPARED` rows, since a kernel can give one row the reference's bits by chance). `rows_linear`
then runs any number of rows as calls of those sizes only, padding a short remainder with copies of its
last row. A bfloat16 linear computes in float32 on float32 weights and rounds once. Invariant:
rows_linear(x)[i] depends only on x[i], the weight and the bias (checked at build time by
backends.runtime.invariance).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

SMALL_SIZES = tuple(range(1, 17))  # every size a remainder may take
LADDER = (24, 31, 32, 33, 48, 63, 64, 96, 128, 192, 256, 384, 512)
COMPARED_ROWS = 64  # rows compared for a call size of 64 or more
MIN_COMPARED = 16  # a smaller call size is compared in calls of that size over at least this many rows
REFERENCE_ROWS = 8  # a row's bits are those it has in a call of this many rows, the others copies of it
ATEN_MAX_WEIGHT = 1 << 16  # weights of at most this many elements run on ATen's mm, larger on oneDNN


class RowPlan(NamedTuple):
    """onednn: the kernel (oneDNN's linear, else ATen's mm); sizes: the call sizes, ascending, in which
    every measured row had the bits of the reference call (empty: each row runs in a reference call)."""

    onednn: bool
    sizes: tuple[int, ...]


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel runs here: on a CPU with oneDNN, float32 or bfloat16 (computed in float32)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype in (torch.float32, torch.bfloat16)


def runs_on_onednn(weight: torch.Tensor) -> bool:
    """The kernel a weight [N, K] runs on, by its size alone (never by a call's size)."""
    return weight.is_mkldnn or weight.numel() > ATEN_MAX_WEIGHT


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool,
                sizes: tuple[int, ...] | list[int]) -> torch.Tensor:  # fmt: skip
    """x [..., K] -> [..., N] in x's dtype, in calls of the plan's sizes only (`row_plan`); weight [N, K]
    as it is, or packed for oneDNN (backends.lowering.onednn.packed_weight) when `onednn`."""
    dtype = x.dtype
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, K]
    if dtype != torch.float32:
        rows = rows.float()
        bias = bias.float() if bias is not None else None
    if not weight.is_mkldnn and weight.dtype != torch.float32:
        weight = weight.float()
    m, sizes = rows.shape[0], tuple(sizes)
    pieces, start = [], 0
    while start < m:
        take, call = _piece(m - start, sizes)
        pieces.append(_call(rows if take == m else rows[start : start + take], weight, onednn, call))
        start += take
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # [M, N]
    if bias is not None:
        out = out + bias
    if x.dim() != 2:
        out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if dtype == torch.float32 else out.to(dtype)


def _piece(left: int, sizes: tuple[int, ...]) -> tuple[int, int]:
    """(rows taken, rows in the call) for the next piece of `left` rows: all of them, padded up to the
    smallest planned size that holds them where that is a small size (one call, not two); else the
    largest planned size that fits; one row in a reference call where the plan has no size."""
    above = [size for size in sizes if size >= left]
    if above and above[0] <= SMALL_SIZES[-1]:
        return left, above[0]
    fits = [size for size in sizes if size <= left]
    if fits:
        return fits[-1], fits[-1]
    if sizes:
        return left, sizes[0]
    return 1, REFERENCE_ROWS


def _call(rows: torch.Tensor, weight: torch.Tensor, onednn: bool, size: int) -> torch.Tensor:
    """rows [m, K] -> [m, N] in one call of `size` >= m rows (the last row repeated as padding)."""
    m = rows.shape[0]
    if size > m:
        rows = rows.index_select(0, _padding_index(m, size))  # [size, K]
    if onednn:
        out = torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")
    else:
        out = torch.nn.functional.linear(rows, weight)
    return out[:m] if size > m else out


@functools.cache
def _padding_index(rows: int, size: int) -> torch.Tensor:
    """[size]: 0 .. rows - 1, then rows - 1 repeated."""
    return torch.arange(size).clamp_(max=rows - 1)


def row_plan(weight: torch.Tensor) -> RowPlan:
    """The kernel and call sizes for a weight of this shape and packing (measured once per process and
    thread count: module docstring)."""
    return _row_plan(tuple(weight.shape), weight.is_mkldnn, runs_on_onednn(weight), torch.get_num_threads())


@functools.cache
def _row_plan(shape: tuple[int, int], packed: bool, onednn: bool, threads: int) -> RowPlan:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen)
    if packed:
        weight = torch.ops.mkldnn._reorder_linear_weight(weight)
    x = torch.randn(LADDER[-1], shape[1], generator=gen)  # [512, K]
    reference = torch.cat([_call(x[i : i + 1], weight, onednn, REFERENCE_ROWS) for i in range(COMPARED_ROWS)])
    sizes = []
    for size in SMALL_SIZES + LADDER:
        compared = min(size, COMPARED_ROWS)
        starts = range(0, max(compared, MIN_COMPARED), size)  # a kernel may give one row the reference's bits by chance
        if all(torch.equal(_call(x[i : i + size], weight, onednn, size)[:compared], reference[i : i + compared])
               for i in starts):  # fmt: skip
            sizes.append(size)
    return RowPlan(onednn, tuple(sizes))
