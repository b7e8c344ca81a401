"""oneDNN lowering for CPUs: every float linear of the step reads weights packed once for oneDNN.

The invariant CPU linear (backends.kernels.linear) runs large weights on oneDNN; on the weight as it is it packs per call,
and the skinny GEMMs of decoding run faster on weights packed once into oneDNN's blocked layout
(docs/experiments.md, "oneDNN"). The packed and unpacked calls give the same bits. Rewrite:
`backends.kernels.kernel_set.use_kernels` with a `packed` table, each linear becoming
`rows_linear(x, packed_weight, bias, *row_plan)` on buffers of the lowered module (weights large enough
to run on oneDNN, `backends.kernels.linear.runs_on_onednn`), one per distinct
weight (a tied LM head is packed once). The packed weights are a copy, made once per weight per process
and shared by every program (`packed_weight`), and packed again when the weight changes in place.
"""

from __future__ import annotations

import torch

from ..kernels.linear import available  # noqa: F401 (where the lowering applies)
from .derived_cache import DerivedCache

_PACKED: DerivedCache[torch.Tensor] = DerivedCache()  # weight -> its packed form


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] as float32 (backends.kernels.linear computes in float32) in oneDNN's blocked
    layout, shared by every graph lowered from it in this process.
    Packed again when the weight changed in place since (its version counter moved); the entry goes
    when the weight does."""
    return _PACKED.get((weight,), lambda: torch.ops.mkldnn._reorder_linear_weight(weight.detach().float()))
