"""TorchInductor lowering: the rewritten step compiled by inductor, so each layer's pointwise work
(RMSNorm, rotary, SiLU-gate, residual adds, the cache writes) runs as a few fused kernels instead of
one kernel per FX node.

Why. On a GPU a small model's step is bound by kernel launches, not arithmetic: SmolLM2-135M's FX
step launches about 40 kernels per layer. In a CUDA graph the launches are cheap but each kernel
still costs a few microseconds, so fewer, fused kernels set the step's floor
(docs/experiments.md, "GPU step").

Rewrite before compiling (`inplace_cache_writes`). The FX step writes a layer's new K/V as
`write_cache(k_cache[layer], slots, new)` (a scatter into the written rows): a mutation through a
view of the step's cache buffer.
Inductor functionalizes that into a copy of the layer's whole cache slice per write and a copy of
the whole buffer back at the end (four cache-sized copies a step, growing with the cache: on an
H100 two 78 us copies of an 8B model's 1024-slot caches). Written as one `index_put_` on the buffer
itself, `k_cache.index_put_([layer, rows, heads, slots], new)`, the mutation is of a graph input's
base and inductor scatters the T new slots of each row in place.

Invariants. The compiled step computes the same function of the same graph on the same KV-cache
buffers (in-place writes into the step's own `k_cache` / `v_cache`); its outputs differ from the FX
step's only by float rounding (reductions fused in another order). One compile serves every tree
size and attended length (`dynamic=True`: T and kv_len are symbolic; T = 1 gets its own
specialisation, which the CUDA-graph lowering never asks for: its smallest bucket is two tokens),
so a bucketed CUDA-graph replay (backends.lowering.cudagraphs) captures it per bucket without recompiling.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._prims_common import make_contiguous_strides_for

from .eager import EagerStep
from ...common.errors import InvalidParameterError
from ...ir import copy_step
from ...ir.query import cache_writes


class InductorStep(EagerStep):
    """`EagerStep`'s interface over the inductor-compiled graph (compiled lazily, at the first call)."""

    # one-token calls get their own specialisation (a second compile of a minute or more), and a
    # two-row step costs a GPU what a one-row step does: replayed buckets start at two tokens
    min_tokens = 2
    min_rows = 2  # the same for rows: a batch down to its last live row still replays two (capped at the cache's rows)

    def __init__(self, gm: torch.fx.GraphModule, kind: str = "inductor"):
        super().__init__(inplace_cache_writes(gm), kind=kind)
        if self.device.type == "cpu":
            require_cpp_compiler(kind)
        self.compiled = torch.compile(self.gm, fullgraph=True, dynamic=True)

    @torch.no_grad()
    def run_graph(self, inputs: dict):
        return self.compiled(**{name: dense_row_major(inputs[name]) for name in self.input_names})


def require_cpp_compiler(lowering: str) -> None:
    """Refuse, with the reason, where inductor cannot generate CPU code: it compiles C++ with the
    compiler `torch._inductor.config.cpp.cxx` names (g++ by default)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as error:  # torch raises its own error types for a missing or unusable compiler
        raise InvalidParameterError(
            f"lowering {lowering!r} compiles the step to C++ on the CPU and needs a C++ compiler (g++ on PATH, or "
            f"the one torch._inductor.config.cpp.cxx names): {error}; use lowering='auto' or 'gguf', which need none"
        ) from None


def dense_row_major(value):
    """A tensor input as a dense tensor of its own with row-major strides (not a view, not expanded, no
    odd stride on a size-1 dimension): dynamo guards on all three, so a [1, T] slice of a longer row in
    one call and a fresh tensor in the next would compile the step again (a minute on a CPU), and
    AOT-compiled code reads its inputs so without checking. Other values pass as they are."""
    if isinstance(value, torch.Tensor) and (
        value._base is not None or value.stride() != make_contiguous_strides_for(value.shape)
    ):
        return value.clone(memory_format=torch.contiguous_format)
    return value


def write_cache_in_place(cache: torch.Tensor, layer: int, slots: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`ir.ops.write_cache(cache[layer], slots, new)` as one `index_put_` on the whole buffer
    cache [L, B_max, KV, S, D]: slots [B, T], new [B, KV, T, D]; returns cache[layer, :B]."""
    b, kv = new.shape[0], new.shape[1]
    rows = torch.arange(b, device=slots.device)[:, None, None]  # [B, 1, 1]
    heads = torch.arange(kv, device=slots.device)[None, :, None]  # [1, KV, 1]
    layers = torch.full_like(rows, layer)  # [B, 1, 1]
    cache.index_put_((layers, rows, heads, slots[:, None, :]), new)  # indices broadcast to [B, KV, T]
    return cache[layer, :b]  # [B, KV, S, D]


def inplace_cache_writes(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm` whose cache writes `write_cache(cache[layer], slots, new)` are
    `write_cache_in_place(cache, layer, slots, new)` on the cache buffer itself (module docstring); the
    writes' users read the same rows as before. Writes of another form are left as they are."""
    lowered = copy_step(gm)
    graph = lowered.graph
    for write in cache_writes(graph):
        view, slots, new = write.args
        if not (view.op == "call_function" and view.target is operator.getitem and isinstance(view.args[1], int)
                and view.args[0].op == "get_attr"):  # fmt: skip
            continue
        cache, layer = view.args
        with graph.inserting_before(write):
            put = graph.call_function(write_cache_in_place, (cache, layer, slots, new))
        put.meta.update(write.meta)
        write.replace_all_uses_with(put)
        graph.erase_node(write)
    graph.lint()
    lowered.recompile()
    return lowered
