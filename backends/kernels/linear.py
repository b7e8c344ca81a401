"""A linear layer whose result for a row does not depend on the other rows of the call (CPU, oneDNN).

Why. PyTorch's default CPU linear (MKL sgemm) picks its kernel by the number of rows: measured on a
2-core AMD EPYC (torch 2.13, float32, the default model's shapes), every row of a call of 2 or more
rows differs from the same row alone, and calls of 4, 8, 16, ... rows differ from each other too.
oneDNN's linear (`mkldnn._linear_pointwise`, on the weight as it is or packed for oneDNN: the same
bits) gives a row the same bits in every call of 2 to 2048 rows, at 1 and 2 threads, in float32 and
bfloat16. A call of one row runs another kernel for some shapes (there: every weight as it is, and
the packed down projection's 1536 inputs; not the packed 576): where `lone_row_differs` measures
that, a lone row is run beside a copy of itself. The measurement is per weight shape and packing,
once per process (a probe of 3 rows), in float32, whose outputs keep every bit of the sum; a
bfloat16 output rounds most differences away (there one row in 16 differed), so a lone bfloat16 row
is always run in company.

Invariant. rows_linear(x)[i] depends only on x[i], the weight and the bias (checked at build time by
backends.runtime.invariance, tested in tests/test_invariance.py).
"""

from __future__ import annotations

import functools

import torch


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs here: on a CPU with oneDNN, float32, or bfloat16 where oneDNN has it."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lone_row_apart: bool = True
                ) -> torch.Tensor:  # fmt: skip
    """x [..., K] -> [..., N] through oneDNN's linear; weight [N, K] as it is, or packed for oneDNN
    (backends.lowering.onednn.packed_weight). lone_row_apart: a call of one row runs it beside a copy of
    itself (`lone_row_differs(weight)`)."""
    if not lone_row_apart or x.numel() != x.shape[-1]:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    pair = x.reshape(1, -1).expand(2, -1)  # [2, K]
    return torch.ops.mkldnn._linear_pointwise(pair, weight, bias, "none", [], "")[:1].reshape(*x.shape[:-1], -1)


def lone_row_differs(weight: torch.Tensor) -> bool:
    """Whether oneDNN gives a row computed alone other bits than the same row among others, for a
    weight of this shape and packing (float32: measured once per process and thread count; other
    dtypes: assumed, module docstring)."""
    if weight.dtype != torch.float32:
        return True
    return _lone_row_differs(tuple(weight.shape), weight.is_mkldnn, torch.get_num_threads())


@functools.cache
def _lone_row_differs(shape: tuple[int, int], packed: bool, threads: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen)
    if packed:
        weight = torch.ops.mkldnn._reorder_linear_weight(weight)
    rows = torch.randn(3, shape[1], generator=gen)
    alone = torch.ops.mkldnn._linear_pointwise(rows[:1], weight, None, "none", [], "")
    among = torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")[:1]
    return not torch.equal(alone, among)
