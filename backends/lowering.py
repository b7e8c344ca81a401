"""Lowering of a rewritten decode step to something callable: eager FX, oneDNN (CPU), both chosen per tree
size (CPU), TorchInductor, or CUDA graphs (of the FX step, or of the inductor-compiled step)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from specpass.backends import onednn
from specpass.backends.eager import EagerStep
from specpass.backends.fuse_projections import fuse_projections
from specpass.backends.gguf_lowering import gguf_planes, pack_gguf_linears
from specpass.backends.per_size import FastestPerSize
from specpass.errors import InvalidParameterError
from specpass.ir.draft import draft_graph, resume_graph


def resolve_lowering(lowering: str, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The lowerings to build, the last one the default. `auto` -> inductor on CUDA (the inductor-compiled
    step replayed in CUDA graphs); on a CPU that has oneDNN (float32) both eager and onednn, each call
    running the one measured faster at its tree size (backends.per_size); else eager. `gguf` -> the GGUF
    kernels (backends.gguf_lowering) beside the float32 kernel, each tree size on the faster one.

    Why inductor on CUDA. A small model's GPU step is bound by kernel launches; inductor fuses each
    layer's pointwise work, so its replays beat the FX step's at every tree size measured (SmolLM2-135M
    bf16 on an H100: 1.18 against 2.64 ms a one-token replay), and end to end the combined tree runs at
    1079 tok/s against 307 (bf16, H200, docs/experiments.md "GPU step"); both are lossless on the real
    model on a GPU (tests/test_gpu.py). Its price is the compile at the first call, 35-90 s per program
    (inductor's cache on disk shortens a later process's): `cudagraphs` (the FX step in CUDA graphs)
    starts in seconds."""
    if lowering == "gguf":  # the quantized kernels, and float32 where a tree size runs faster on them
        return ("onednn" if onednn.available(device, dtype) else "eager", "gguf")
    if lowering != "auto":
        return (lowering,)
    if device.type == "cuda":
        return ("inductor",)
    return ("eager", "onednn") if onednn.available(device, dtype) else ("eager",)


def lower(
    gm: torch.fx.GraphModule, lowering: str, device: torch.device, max_nodes: int, cache_size: int
) -> tuple[Callable, EagerStep | None, EagerStep | None]:
    """(the lowered verify step, the lowered draft graph or None, the lowered resume graph or None).
    The side graphs (ir.draft) run eagerly, on oneDNN-packed weights on a CPU (sharing the verify
    step's packed weights: its LM head, and for a resume graph its layers), and on the GGUF planes
    where the lowering is `gguf`."""
    kinds = resolve_lowering(lowering, device, gm.k_cache.dtype)
    packed: dict = {}  # oneDNN-packed weights, shared by the graphs lowered here
    planes = gguf_planes(gm) if "gguf" in kinds else {}  # GGUF int4 planes, shared likewise
    steps = {kind: _lower_one(gm, kind, device, max_nodes, cache_size, packed, planes) for kind in kinds}
    draft, resume = (_lower_side(g, packed, planes) for g in (draft_graph(gm), resume_graph(gm)))
    if len(steps) == 1:
        return steps[kinds[0]], draft, resume
    return FastestPerSize(steps, default=kinds[-1]), draft, resume


def _lower_side(graph: torch.fx.GraphModule | None, packed: dict, planes: dict) -> EagerStep | None:
    if graph is None:
        return None
    if planes:
        graph = pack_gguf_linears(graph, planes)
    if packed:
        graph = onednn.pack_linears(graph, packed)
    return EagerStep(graph, kind="gguf" if planes else "onednn" if packed else "eager")


def _lower_one(gm: torch.fx.GraphModule, lowering: str, device: torch.device, max_nodes: int, cache_size: int,
               packed: dict, planes: dict) -> Callable:  # fmt: skip
    if lowering == "eager":
        return EagerStep(gm)
    if lowering == "gguf":  # the linears without GGUF blocks run on oneDNN where it is available
        graph = pack_gguf_linears(gm, planes)
        if onednn.available(device, gm.k_cache.dtype):
            graph = onednn.pack_linears(graph, packed)
        return EagerStep(graph, kind="gguf")
    if lowering == "onednn":
        if not onednn.available(device, gm.k_cache.dtype):
            raise InvalidParameterError(
                f"lowering 'onednn' needs float32 on a CPU with oneDNN; the model is {gm.k_cache.dtype} on {device}"
            )
        return EagerStep(onednn.pack_linears(fuse_projections(gm), packed), kind="onednn")
    if lowering == "inductor":  # q|k|v and gate|up as one GEMM each: fewer kernels (backends.fuse_projections)
        from specpass.backends.inductor import InductorStep

        if device.type != "cuda":
            return InductorStep(fuse_projections(gm))
        from specpass.backends.cudagraphs import CudaGraphStep

        return CudaGraphStep(InductorStep(fuse_projections(gm)), max_nodes=max_nodes, cache_size=cache_size)
    if lowering == "cudagraphs":
        if device.type != "cuda":
            raise InvalidParameterError(f"lowering 'cudagraphs' needs the model on a CUDA device, it is on {device}")
        from specpass.backends.cudagraphs import CudaGraphStep

        return CudaGraphStep(EagerStep(fuse_projections(gm)), max_nodes=max_nodes, cache_size=cache_size)
    raise InvalidParameterError(f"unknown lowering {lowering!r}")
