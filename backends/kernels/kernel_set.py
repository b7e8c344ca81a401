"""Which invariant kernels a device and dtype have, and the pass that puts them into a lowered step.

Each lowering runs the kernel set of its device on every call, whatever the step's size: a lowering
is one function, and no choice between kernels that give other bits is ever made per call (the
lossless contract, docs/design.md). Today's set is the CPU's: attention in logical key order
(backends.kernels.attention, numba, every dtype), a linear in calls of measured sizes only, on
ATen's mm for small weights and oneDNN's for the others (backends.kernels.linear, float32 and
bfloat16), and transcendental pointwise ops on ATen's vector loop only (backends.kernels.pointwise); a sparse
attention's selection and attention in the same arithmetic (backends.kernels.sparse_attention).
Other devices have none yet: their steps keep the captured ops, and the build-time check
(backends.runtime.invariance) says what that costs. A CUDA
set joins by adding its entry to `kernel_set` and, where it differs, its own replacement functions.

Compiled lowerings (inductor, AOTInductor) see the kernels as custom ops (`specpass::ordered_attention`,
`specpass::rows_linear`, `specpass::rows_pointwise`, `specpass::rows_softmax`, `specpass::select_slots`,
`specpass::selected_attention`), opaque to the compiler,
so generated code cannot reorder their reductions.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from . import attention, linear, pointwise, sparse_attention as sparse
from ...ir import copy_step, ops, query, replace_node


@dataclass(frozen=True)
class KernelSet:
    """The invariant kernels of one device and dtype."""

    name: str  # in program reports
    attention: bool  # attention by backends.kernels.attention
    linear: bool  # float linears by backends.kernels.linear


def kernel_set(device: torch.device, dtype: torch.dtype) -> KernelSet | None:
    """The kernel set for a step on `device` in `dtype`, or None where there is none (not a CPU)."""
    if device.type != "cpu":
        return None
    has_linear = linear.available(device, dtype)
    name = "cpu: ordered attention, rows pointwise" + (", rows linear" if has_linear else "")
    return KernelSet(name, True, has_linear)


def use_kernels(gm: torch.fx.GraphModule, packed: dict[int, torch.Tensor] | None = None,
                compiled: bool = False) -> torch.fx.GraphModule:  # fmt: skip
    """A copy of `gm` whose attention ops, transcendental pointwise ops and float `nn.Linear`s run the
    kernel set of gm's device and dtype (gm itself where there is none). packed: id(weight) -> oneDNN-packed weight, shared by the
    graphs lowered together (backends.lowering.onednn.packed_weight; None: linears read their weights as
    they are). compiled: call the kernels as custom ops (for inductor and AOTInductor)."""
    tensor = getattr(gm, "k_cache", None)
    if tensor is None:  # a draft graph without a cache of its own: its weights tell
        tensor = next((t for t in (*gm.parameters(), *gm.buffers()) if t.is_floating_point()), None)
    kernels = kernel_set(tensor.device, tensor.dtype) if tensor is not None else None
    if kernels is None:
        return gm
    lowered = copy_step(gm)
    graph = lowered.graph
    attend, rows_linear, rows_pointwise, rows_softmax = (
        compiled_ops() if compiled else (attention.ordered_attention, linear.rows_linear, pointwise.rows_pointwise, None)
    )
    select, attend_selected = compiled_sparse_ops() if compiled else (sparse.select_slots, sparse.selected_attention)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is ops.select_slots:
            q, keys, mask, scale, count, own, vote = node.args
            with graph.inserting_before(node):
                new = graph.call_function(select, (q, _cache_rows(keys), mask, float(scale), count, own, vote))
            replace_node(node, new, (new,))
    for node in query.attention_ops(graph):
        q, keys, values = node.args[:3]
        mask = node.kwargs["attn_mask"]
        if node.target is ops.selected_attention:
            with graph.inserting_before(node):
                new = graph.call_function(attend_selected, (q, _cache_rows(keys), _cache_rows(values), mask,
                                                            float(node.kwargs["scale"]), node.kwargs["selected"]))  # fmt: skip
            replace_node(node, new, (new,))
            continue
        softcap = node.kwargs.get("softcap")
        with graph.inserting_before(node):
            new = graph.call_function(attend, (q, _cache_rows(keys), _cache_rows(values), mask,
                                               float(node.kwargs["scale"]), float(softcap or 0.0),
                                               node.kwargs.get("sinks")))  # fmt: skip
        replace_node(node, new, (new,))
        new.meta.pop("is_wrapped", None)  # the captured op was an autowrapped function (ir.ops); the kernel is not
    for node in list(graph.nodes):
        op = _pointwise_op(node)
        if op is not None:
            with graph.inserting_before(node):
                new = graph.call_function(rows_pointwise, (node.args[0], op))
            replace_node(node, new, (new,))
        elif compiled and _last_dim_softmax(node):  # generated code may vectorise across rows, with a scalar tail
            with graph.inserting_before(node):
                new = graph.call_function(rows_softmax, (node.args[0],))
            replace_node(node, new, (new,))
    if kernels.linear:
        _swap_linears(lowered, rows_linear, packed)
    graph.eliminate_dead_code()
    graph.lint()
    lowered.recompile()
    return lowered


_POINTWISE_FUNCTIONS = {
    torch.nn.functional.silu: "silu", torch.sigmoid: "sigmoid", torch.nn.functional.sigmoid: "sigmoid",
    torch.tanh: "tanh", torch.nn.functional.tanh: "tanh", torch.cos: "cos", torch.sin: "sin",
}  # fmt: skip
_POINTWISE_METHODS = {"sigmoid", "tanh", "cos", "sin"}


def _pointwise_op(node: torch.fx.Node) -> str | None:
    """The name in pointwise.OPS of a transcendental pointwise call (None: not one, or one with
    arguments the kernel does not take, such as an in-place silu)."""
    if node.op == "call_method" and node.target in _POINTWISE_METHODS and len(node.args) == 1 and not node.kwargs:
        return node.target
    if node.op != "call_function" or len(node.args) != 1:
        return None
    if node.target is torch.nn.functional.gelu and set(node.kwargs) <= {"approximate"}:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(node.kwargs.get("approximate", "none"))
    if node.target in _POINTWISE_FUNCTIONS and set(node.kwargs) <= {"inplace"} and not node.kwargs.get("inplace"):
        return _POINTWISE_FUNCTIONS[node.target]
    return None


def _last_dim_softmax(node: torch.fx.Node) -> bool:
    """A `x.softmax(dim=-1)` call (a mixture's router): ATen computes each row alone, in the same order."""
    return (node.op == "call_method" and node.target == "softmax" and len(node.args) == 1
            and node.kwargs == {"dim": -1})  # fmt: skip


def _cache_rows(kv: torch.fx.Node) -> torch.fx.Node:
    """The written cache rows [B, KV, S_max, D] under a step's `rows[:, :, :kv_len]` (the kernel reads the
    slots its mask covers, without a copy of the slice); other inputs as they are."""
    if kv.op == "call_function" and kv.target is operator.getitem:
        index = kv.args[1]
        if (isinstance(index, tuple) and len(index) == 3 and all(isinstance(i, slice) for i in index)
                and index[0] == slice(None) and index[1] == slice(None) and index[2].start is None
                and index[2].step is None):  # fmt: skip
            return kv.args[0]
    return kv


def _swap_linears(gm: torch.fx.GraphModule, rows_linear, packed: dict[int, torch.Tensor] | None) -> None:
    """Each `call_module` of an `nn.Linear` whose weight the kernel takes becomes rows_linear(x, weight,
    bias, *row_plan) (`linear.row_plan`); weights that run on oneDNN are packed where `packed` is given,
    as buffers of `gm` (one per weight)."""
    from ..lowering.onednn import packed_weight

    graph = gm.graph
    names: dict[int, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if not isinstance(module, nn.Linear) or not linear.available(module.weight.device, module.weight.dtype):
            continue
        with graph.inserting_before(node):
            if packed is None or not linear.runs_on_onednn(module.weight):
                weight_tensor = module.weight
                weight = graph.get_attr(f"{node.target}.weight")
            else:
                key = id(module.weight)
                if key not in packed:
                    packed[key] = packed_weight(module.weight)
                if key not in names:
                    names[key] = f"packed_{len(names)}"
                    gm.register_buffer(names[key], packed[key], persistent=False)
                weight_tensor = packed[key]
                weight = graph.get_attr(names[key])
            bias = graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
            plan = linear.row_plan(weight_tensor)
            new = graph.call_function(rows_linear, (node.args[0], weight, bias, plan.onednn, list(plan.sizes)))
        replace_node(node, new, (weight, bias, new))


@functools.cache
def compiled_ops() -> tuple:
    """(attention, linear, pointwise, softmax) as custom ops `specpass::ordered_attention`,
    `specpass::rows_linear`, `specpass::rows_pointwise` and `specpass::rows_softmax` (ATen's softmax over
    the last dimension, kept out of generated code), registered at the first call (never at import)."""

    @torch.library.custom_op("specpass::ordered_attention", mutates_args=())
    def ordered_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                          scale: float, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        return attention.ordered_attention(q, keys, values, mask, scale, softcap, sinks)

    @ordered_attention.register_fake
    def _(q, keys, values, mask, scale, softcap, sinks):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.custom_op("specpass::rows_linear", mutates_args=())
    def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool,
                    sizes: list[int]) -> torch.Tensor:  # fmt: skip
        return linear.rows_linear(x, weight, bias, onednn, sizes)

    @rows_linear.register_fake
    def _(x, weight, bias, onednn, sizes):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.custom_op("specpass::rows_pointwise", mutates_args=())
    def rows_pointwise(x: torch.Tensor, op: str) -> torch.Tensor:
        return pointwise.rows_pointwise(x, op)

    @rows_pointwise.register_fake
    def _(x, op):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.custom_op("specpass::rows_softmax", mutates_args=())
    def rows_softmax(x: torch.Tensor) -> torch.Tensor:
        return x.softmax(dim=-1)

    @rows_softmax.register_fake
    def _(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    registered = torch.ops.specpass
    return registered.ordered_attention.default, registered.rows_linear.default, registered.rows_pointwise.default, registered.rows_softmax.default


@functools.cache
def compiled_sparse_ops() -> tuple:
    """(select_slots, selected_attention) of backends.kernels.sparse_attention as custom ops
    `specpass::select_slots` and `specpass::selected_attention`, registered at the first call."""

    @torch.library.custom_op("specpass::select_slots", mutates_args=())
    def select_slots(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float, count: int,
                     own: torch.Tensor, vote: bool) -> torch.Tensor:  # fmt: skip
        return sparse.select_slots(q, keys, mask, scale, count, own, vote)

    @select_slots.register_fake
    def _(q, keys, mask, scale, count, own, vote):
        return q.new_empty((*q.shape[:3], count), dtype=torch.int64)

    @torch.library.custom_op("specpass::selected_attention", mutates_args=())
    def selected_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                           scale: float, selected: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return sparse.selected_attention(q, keys, values, mask, scale, selected)

    @selected_attention.register_fake
    def _(q, keys, values, mask, scale, selected):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    registered = torch.ops.specpass
    return registered.select_slots.default, registered.selected_attention.default
