"""TorchInductor lowering: the rewritten step compiled by inductor, so each layer's pointwise work
(RMSNorm, rotary, SiLU-gate, residual adds, the cache writes) runs as a few fused kernels instead of
one kernel per FX node.

Why. On a GPU a small model's step is bound by kernel launches, not arithmetic: SmolLM2-135M's FX
step launches about 40 kernels per layer. In a CUDA graph the launches are cheap but each kernel
still costs a few microseconds, so fewer, fused kernels set the step's floor
(docs/experiments.md, "GPU step").

Invariants. The compiled step computes the same function of the same graph on the same KV-cache
buffers (in-place writes into the step's own `k_cache` / `v_cache`); its outputs differ from the FX
step's only by float rounding (reductions fused in another order). One compile serves every tree
size and attended length (`dynamic=True`: T and kv_len are symbolic; T = 1 gets its own
specialisation), so a bucketed CUDA-graph replay (backends.cudagraphs) captures it per bucket
without recompiling.
"""

from __future__ import annotations

import torch
import torch.fx

from specpass.backends.eager import EagerStep


class InductorStep(EagerStep):
    """`EagerStep`'s interface over the inductor-compiled graph (compiled lazily, at the first call)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, kind="inductor")
        self.compiled = torch.compile(gm, fullgraph=True, dynamic=True)

    @torch.no_grad()
    def run_graph(self, inputs: dict):
        return self.compiled(**{name: _plain(inputs[name]) for name in self.input_names})


def _plain(value):
    """A tensor input as a dense tensor of its own (not a view, not expanded): dynamo guards on both,
    so a view in one call and a base tensor in the next would compile the step twice."""
    if isinstance(value, torch.Tensor) and (value._base is not None or not value.is_contiguous()):
        return value.clone(memory_format=torch.contiguous_format)
    return value
