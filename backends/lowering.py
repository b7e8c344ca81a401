"""Lowering of a rewritten decode step to something callable: eager FX, oneDNN (CPU) or CUDA graphs."""

from __future__ import annotations

import torch
import torch.fx

from specpass.backends import onednn
from specpass.errors import InvalidParameterError


class EagerStep:
    """Runs a GraphModule directly: the rewritten step itself (`eager`, the reference) or its oneDNN lowering."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str = "eager"):
        self.gm = gm
        self.kind = kind
        self.input_names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]

    @torch.no_grad()
    def __call__(self, **inputs):
        return self.gm(**{name: inputs[name] for name in self.input_names})


def resolve_lowering(lowering: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` -> cudagraphs on CUDA, onednn on a CPU that has it (float32), else eager."""
    if lowering != "auto":
        return lowering
    if device.type == "cuda":
        return "cudagraphs"
    return "onednn" if onednn.available(device, dtype) else "eager"


def lower(gm: torch.fx.GraphModule, lowering: str, device: torch.device, max_nodes: int, cache_size: int):
    lowering = resolve_lowering(lowering, device, gm.k_cache.dtype)
    if lowering == "eager":
        return EagerStep(gm)
    if lowering == "onednn":
        if not onednn.available(device, gm.k_cache.dtype):
            raise InvalidParameterError(
                f"lowering 'onednn' needs float32 on a CPU with oneDNN; the model is {gm.k_cache.dtype} on {device}"
            )
        return EagerStep(onednn.pack_linears(gm), kind="onednn")
    if lowering == "cudagraphs":
        if device.type != "cuda":
            raise InvalidParameterError(f"lowering 'cudagraphs' needs the model on a CUDA device, it is on {device}")
        from specpass.backends.cudagraphs import CudaGraphStep

        return CudaGraphStep(EagerStep(gm), max_nodes=max_nodes, cache_size=cache_size)
    raise InvalidParameterError(f"unknown lowering {lowering!r}")
