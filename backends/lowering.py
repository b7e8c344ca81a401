"""Lowering of a rewritten decode step to something callable: eager FX, oneDNN (CPU) or CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from specpass.backends import onednn
from specpass.errors import InvalidParameterError
from specpass.ir.roles import DRAFT_MODULE


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


def lower(
    gm: torch.fx.GraphModule, lowering: str, device: torch.device, max_nodes: int, cache_size: int
) -> tuple[Callable, EagerStep | None]:
    """(the lowered verify step, the lowered draft graph or None). The draft graph runs eagerly, on
    oneDNN-packed weights on a CPU (sharing the verify step's packed LM head)."""
    lowering = resolve_lowering(lowering, device, gm.k_cache.dtype)
    draft = getattr(gm, DRAFT_MODULE, None)
    if lowering == "eager":
        return EagerStep(gm), EagerStep(draft) if draft is not None else None
    if lowering == "onednn":
        if not onednn.available(device, gm.k_cache.dtype):
            raise InvalidParameterError(
                f"lowering 'onednn' needs float32 on a CPU with oneDNN; the model is {gm.k_cache.dtype} on {device}"
            )
        packed: dict = {}
        step = EagerStep(onednn.pack_linears(gm, packed), kind="onednn")
        return step, EagerStep(onednn.pack_linears(draft, packed), kind="onednn") if draft is not None else None
    if lowering == "cudagraphs":
        if device.type != "cuda":
            raise InvalidParameterError(f"lowering 'cudagraphs' needs the model on a CUDA device, it is on {device}")
        from specpass.backends.cudagraphs import CudaGraphStep

        step = CudaGraphStep(EagerStep(gm), max_nodes=max_nodes, cache_size=cache_size)
        return step, EagerStep(draft) if draft is not None else None
    raise InvalidParameterError(f"unknown lowering {lowering!r}")
