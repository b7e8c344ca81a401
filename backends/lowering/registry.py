"""Lowering of a rewritten decode step to something callable, behind one contract: a `Step`, built by a
named `Lowering` of the `LOWERINGS` registry, which also states what the lowering can do (the devices it
runs on, batches of rows, CUDA-graph replay). Today: eager FX, oneDNN (CPU), GGUF kernels (CPU, op by op or compiled whole),
TorchInductor (replayed in CUDA graphs on CUDA) and CUDA graphs of the FX step; `auto` picks one per
device and dtype.

A lowering is one function: every call, whatever its size, runs the same kernels, those of the device's
kernel set (backends.kernels) where it has one, so a token's outputs do not depend on what else the
call holds (checked when a program is built, backends.runtime.invariance).

Adding a lowering is one `Lowering` entry here: CompileOptions' list of names, the program's batch
check and `auto`'s choice are all read from the registry."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.fx

from ..kernels.kernel_set import use_kernels
from . import onednn
from .draft_buckets import CudaGraphDraft
from .eager import EagerStep
from .fuse_projections import fuse_projections
from .gguf import gguf_planes, pack_gguf_linears
from ...common.errors import InvalidParameterError
from ...ir.draft import draft_graph, draft_spec, resume_graph
from ...ir.layout import SlotLayout


class Step(Protocol):
    """A lowered verify step: `step(input_ids [B, T], layout)` runs B rows laid out by `layout` in cache
    rows 0 .. B-1 and returns the graph's outputs (logits [B, T, V], hidden [B, T, H], ...);
    `run_graph(inputs)` takes the graph's inputs by name."""

    lowering: str  # the lowering it runs (its name in LOWERINGS)
    input_names: list[str]
    device: torch.device

    def __call__(self, input_ids: torch.Tensor, layout: SlotLayout) -> tuple: ...

    def run_graph(self, inputs: dict) -> tuple: ...


@dataclass(frozen=True)
class BuildContext:
    """What a builder gets beside the rewritten graph: where it runs and the buckets it may replay, and
    the packed weights shared by every graph lowered for one step (oneDNN matrices: None where the
    linears read their weights as they are; GGUF planes)."""

    device: torch.device
    max_nodes: int
    cache_size: int
    packed: dict | None
    planes: dict


@dataclass(frozen=True)
class Lowering:
    """One lowering: its builder and its capabilities."""

    name: str
    build: Callable[[torch.fx.GraphModule, BuildContext], Step]
    devices: tuple[str, ...]  # device types it runs on
    batches: bool  # runs steps of several rows
    replays: bool  # captures CUDA graphs (one per bucket) and replays them
    reads_gguf: bool = False  # runs the linears on the GGUF file's quantized blocks (BuildContext.planes)


def _eager(gm: torch.fx.GraphModule, ctx: BuildContext) -> Step:
    return EagerStep(use_kernels(gm))


def _onednn(gm: torch.fx.GraphModule, ctx: BuildContext) -> Step:
    if not onednn.available(ctx.device, gm.k_cache.dtype):
        raise InvalidParameterError(
            f"lowering 'onednn' needs float32 or bfloat16 on a CPU with oneDNN; the model is {gm.k_cache.dtype} "
            f"on {ctx.device}"
        )
    return EagerStep(use_kernels(fuse_projections(gm), ctx.packed), lowering="onednn")


def _gguf(gm: torch.fx.GraphModule, ctx: BuildContext) -> Step:
    """The linears with GGUF blocks on the int4 kernel at every size, the others on oneDNN's packed weights."""
    return EagerStep(use_kernels(pack_gguf_linears(gm, ctx.planes), ctx.packed), lowering="gguf")


def _gguf_compiled(gm: torch.fx.GraphModule, ctx: BuildContext) -> Step:
    """The gguf step compiled whole, ahead of time (backends.lowering.aot_compiled): the casts, norms,
    rotary, residual adds and cache writes around the int4 GEMMs fused, no Python per op, one package on
    disk for every tree size. Attention and the linears without GGUF blocks are the kernel set's, as
    custom ops inside the package (on the weights as they are: inductor takes no oneDNN-packed ones)."""
    from .aot_compiled import AotCompiledStep

    return AotCompiledStep(use_kernels(pack_gguf_linears(gm, ctx.planes), compiled=True), lowering="gguf-compiled")


def _inductor(gm: torch.fx.GraphModule, ctx: BuildContext) -> Step:
    """q|k|v and gate|up as one GEMM each (fewer kernels, backends.lowering.fuse_projections); replayed in CUDA
    graphs on CUDA."""
    from .inductor import InductorStep

    if ctx.device.type != "cuda":  # the CPU kernel set's attention and linears as custom ops inside
        return InductorStep(use_kernels(fuse_projections(gm), compiled=True))
    from .cudagraphs import CudaGraphStep

    return CudaGraphStep(InductorStep(fuse_projections(gm)), max_nodes=ctx.max_nodes, cache_size=ctx.cache_size)


def _cudagraphs(gm: torch.fx.GraphModule, ctx: BuildContext) -> Step:
    if ctx.device.type != "cuda":
        raise InvalidParameterError(f"lowering 'cudagraphs' needs the model on a CUDA device, it is on {ctx.device}")
    from .cudagraphs import CudaGraphStep

    return CudaGraphStep(EagerStep(fuse_projections(gm)), max_nodes=ctx.max_nodes, cache_size=ctx.cache_size)


LOWERINGS: dict[str, Lowering] = {
    lowering.name: lowering
    for lowering in (
        Lowering("eager", _eager, devices=("cpu", "cuda"), batches=True, replays=False),
        Lowering("onednn", _onednn, devices=("cpu",), batches=True, replays=False),
        Lowering("gguf", _gguf, devices=("cpu",), batches=False, replays=False, reads_gguf=True),
        Lowering("gguf-compiled", _gguf_compiled, devices=("cpu",), batches=False, replays=False, reads_gguf=True),
        Lowering("inductor", _inductor, devices=("cpu", "cuda"), batches=True, replays=True),
        Lowering("cudagraphs", _cudagraphs, devices=("cuda",), batches=True, replays=True),
    )
}
AUTO = "auto"


def resolve_lowering(lowering: str, device: torch.device, dtype: torch.dtype) -> str:
    """The lowering to build. `auto` -> inductor on CUDA (the inductor-compiled step replayed in CUDA
    graphs); on a CPU oneDNN where it runs the dtype (float32, bfloat16 where oneDNN has it), else eager.

    Why inductor on CUDA. A small model's GPU step is bound by kernel launches; inductor fuses each
    layer's pointwise work, so its replays beat the FX step's at every tree size measured, and end to
    end the combined tree runs faster (docs/experiments.md, "GPU step, 2026-11-26" and "GPU, 2026-11-26
    (H200)"); both are lossless on the real model on a GPU (tests/test_gpu.py). Its price is the compile
    at the first call (inductor's cache on disk shortens a later process's): `cudagraphs` (the FX step
    in CUDA graphs) starts in seconds."""
    if lowering != AUTO:
        return lowering
    if device.type == "cuda":
        return "inductor"
    return "onednn" if onednn.available(device, dtype) else "eager"


class Lowered(NamedTuple):
    """A rewritten step lowered: the verify step, its side graphs (ir.draft), and how to lower another
    graph over the step's tensors the same way (a runtime hook's own graph: rewrites.lazy_llm's prefill)."""

    step: Step
    draft: EagerStep | CudaGraphDraft | None
    resume: EagerStep | None
    lower_side: Callable[[torch.fx.GraphModule], EagerStep]


def lower(gm: torch.fx.GraphModule, lowering: str, device: torch.device, max_nodes: int, cache_size: int) -> Lowered:
    """The verify step, the lowered draft graph or None, the lowered resume graph or None, and the side
    lowering. Side graphs run eagerly on the same lowering's kernels: on oneDNN-packed weights where the
    step's are (sharing them: its LM head, and for a resume graph its layers), and on the GGUF planes
    where the lowering reads them. On a GPU, where the verify step replays CUDA graphs, a draft graph
    called by rows replays too, bucketed by its named sizes (backends.lowering.draft_buckets)."""
    name = resolve_lowering(lowering, device, gm.k_cache.dtype)
    if name not in LOWERINGS:
        raise InvalidParameterError(f"unknown lowering {name!r}; known: {AUTO}, {', '.join(LOWERINGS)}")
    reads_gguf = LOWERINGS[name].reads_gguf
    packs = name in ("onednn", "gguf", "gguf-compiled") and onednn.available(device, gm.k_cache.dtype)
    ctx = BuildContext(device, max_nodes, cache_size, packed={} if packs else None,
                       planes=gguf_planes(gm) if reads_gguf else {})  # fmt: skip
    step = LOWERINGS[name].build(gm, ctx)
    lower_side = functools.partial(_lower_side, ctx=ctx, lowering=name)
    draft, resume = (_lower_side(g, ctx, name) for g in (draft_graph(gm), resume_graph(gm)))
    spec = draft_spec(gm)
    if draft is not None and device.type == "cuda" and not spec.shares_cache and LOWERINGS[name].replays:
        draft = CudaGraphDraft(draft, spec)  # a draft by rows replays too (a cache-sharing one runs as a step)
    return Lowered(step, draft, resume, lower_side)


def _lower_side(graph: torch.fx.GraphModule | None, ctx: BuildContext, lowering: str) -> EagerStep | None:
    if graph is None:
        return None
    if ctx.planes:
        graph = pack_gguf_linears(graph, ctx.planes)
    return EagerStep(use_kernels(graph, ctx.packed), lowering=lowering)
