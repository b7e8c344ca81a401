"""A linear layer whose result for a row does not depend on the other rows of the call (CPU, oneDNN).

Why. PyTorch's default CPU linear (MKL sgemm) picks its kernel by the number of rows: measured on a
2-core AMD EPYC (torch 2.13, float32, the default model's shapes), every row of a call of 2 or more
rows differs from the same row alone, and calls of 4, 8, 16, ... rows differ from each other too.
oneDNN's linear (`mkldnn._linear_pointwise`, on the weight as it is or packed for oneDNN, the same
bits) gives a row the same bits in every call of 2 to 2048 rows, at 1 and 2 threads, in float32 and
bfloat16; a call of one row runs another kernel (other bits where K = 1536). So a call always has
at least two rows: a lone row is run beside a copy of itself.

Invariant. rows_linear(x)[i] depends only on x[i], the weight and the bias (checked at build time by
backends.runtime.invariance, tested in tests/test_invariance.py).
"""

from __future__ import annotations

import torch


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear runs here: on a CPU with oneDNN, float32, or bfloat16 where oneDNN has it."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N] through oneDNN's linear; weight [N, K] as it is, or packed for oneDNN
    (backends.lowering.onednn.packed_weight)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if rows.shape[0] == 1:  # a lone row runs beside a copy of itself (module docstring)
        rows = rows.expand(2, -1)
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")  # [max(M, 2), N]
    return out[: x.numel() // x.shape[-1]].reshape(*x.shape[:-1], out.shape[-1])
