"""TorchInductor lowering: the rewritten step compiled by inductor, so each layer's pointwise work (norms,
rotary, SiLU-gate, residual adds, cache writes) runs as a few fused kernels, not one per FX node.

On a GPU a small model's step is bound by kernel count (docs/experiments.md, "GPU step"). Before
compiling, `inplace_cache_writes` turns `write_cache(k_cache[layer], slots, new)`, a mutation through a
view that inductor would functionalize into whole-cache copies every step, into
`k_cache.index_put_([layer, rows, heads, slots], new)`, which scatters each row's T new slots in place.
The compiled step computes the FX step's function on the same cache buffers, up to float rounding
(reductions fused in another order). One compile serves every tree size and attended length
(`dynamic=True`; T = 1 gets its own specialisation, which the CUDA-graph buckets never ask for: they
start at two tokens), so a bucketed replay (backends.lowering.cudagraphs) captures it without recompiling.
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

    # one-token calls get their own specialisation (a second, slow compile), and a
    # two-row step costs a GPU what a one-row step does: replayed buckets start at two tokens
    min_tokens = 2
    min_rows = 2  # the same for rows: a batch down to its last live row still replays two (capped at the cache's rows)

    def __init__(self, gm: torch.fx.GraphModule, lowering: str = "inductor"):
        super().__init__(inplace_cache_writes(gm), lowering=lowering)
        if self.device.type == "cpu":
            require_cpp_compiler(lowering)
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
    one call and a fresh tensor in the next would compile the step again (docs/experiments.md, "A
    compiled gguf step"), and AOT-compiled code reads its inputs so without checking. Other values
    pass as they are."""
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
