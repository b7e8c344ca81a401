"""Transcendental pointwise ops (activations, rotary cos/sin, soft-caps) whose result for an element does
not depend on the rest of the call (CPU).

ATen runs a contiguous pointwise op as a vector loop over groups of 2 x the vector width, then a scalar
loop over the tail; the two compute exp, sigmoid, silu or gelu by different code (SLEEF against libm),
a unit in the last place apart. Which elements fall in the tail depends on the call's size (a tree's
T, the rows), and above 32768 elements ATen also splits the call between threads at offsets of its
choosing. So `rows_pointwise` lays the input out as rows padded to a multiple of `ALIGN` elements and
runs it in pieces of at most `SERIAL_ELEMENTS` (one thread), each a multiple of `ALIGN`: every element
goes through the vector loop. Invariant: rows_pointwise(x, op)[i] depends only on x[i].
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ALIGN = 64  # elements: a multiple of every CPU vector loop's group (2 x 32 bfloat16 on AVX-512)
SERIAL_ELEMENTS = 1 << 14  # a piece ATen runs on one thread (its parallel grain is 2^15), a multiple of ALIGN

OPS = {
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "cos": torch.cos,
    "sin": torch.sin,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def rows_pointwise(x: torch.Tensor, op: str) -> torch.Tensor:
    """OPS[op](x) for x [..., D], each element computed by ATen's vector loop whatever the call's size."""
    fn = OPS[op]
    d = x.shape[-1]
    width = -(-d // ALIGN) * ALIGN
    rows = x.reshape(-1, d)  # [N, D]
    if width != d or not rows.is_contiguous():
        rows = F.pad(rows, (0, width - d))  # [N, W], contiguous
    flat = rows.view(-1)  # [N * W]: a multiple of ALIGN
    if flat.numel() <= SERIAL_ELEMENTS:
        out = fn(flat)
    else:
        out = torch.cat([fn(flat[i : i + SERIAL_ELEMENTS]) for i in range(0, flat.numel(), SERIAL_ELEMENTS)])
    return out.view(-1, width)[:, :d].contiguous().view(x.shape)  # contiguous, as the op's own output
