"""Lowering of a rewritten decode step to something callable: eager FX, or CUDA graphs per bucket."""

from __future__ import annotations

import torch
import torch.fx

from specpass.errors import InvalidParameterError


class EagerStep:
    """Runs the rewritten GraphModule directly (the reference lowering, used on the CPU)."""

    kind = "eager"

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.input_names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]

    @torch.no_grad()
    def __call__(self, **inputs):
        return self.gm(**{name: inputs[name] for name in self.input_names})


def lower(gm: torch.fx.GraphModule, lowering: str, device: torch.device, max_nodes: int, cache_size: int):
    if lowering == "auto":
        lowering = "cudagraphs" if device.type == "cuda" else "eager"
    if lowering == "eager":
        return EagerStep(gm)
    if lowering == "cudagraphs":
        if device.type != "cuda":
            raise InvalidParameterError(f"lowering 'cudagraphs' needs the model on a CUDA device, it is on {device}")
        from specpass.backends.cudagraphs import CudaGraphStep

        return CudaGraphStep(EagerStep(gm), max_nodes=max_nodes, cache_size=cache_size)
    raise InvalidParameterError(f"unknown lowering {lowering!r}")
