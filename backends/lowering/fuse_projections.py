"""Sibling projections as one GEMM: the linears of a step that read the same input (a layer's q, k and
v projections; its MLP's gate and up projections) become one linear over their concatenated weights,
whose output is split back into the original outputs.

Why. On a GPU a small model's decode step is bound by kernel count, not bytes: SmolLM2-135M's
inductor step spends half its device time in seven cuBLAS GEMMs a layer of ~3.6 us each
(docs/experiments.md, "GPU step"). Fused, a layer runs four GEMMs (q|k|v, o, gate|up, down) that
read the same bytes. For an 8B model the fused GEMMs are also wider, which keeps cuBLAS off its
split-K kernels.

Rewrite. A copy of the graph in which each group of two or more `call_module` nodes of plain
`nn.Linear`s with the same input node, dtype, device and bias presence is replaced by one call of a
new `nn.Linear` (registered as `fused.<first target>`, weight [sum N_i, K] = cat of the members'
weights, bias likewise) followed by `split(N_i, dim=-1)`; each member's users read its part. Node
annotations are kept: the fused call takes the first member's, with role QKV when the members are
q/k/v projections; each part takes its member's. The source graph module is not modified.

Invariants. Each part equals the member's own linear up to GEMM rounding (one wider GEMM may block
its reduction differently), so logits agree with the unfused step to float rounding. The fused
weights are a copy made at lowering time, once per process for every program of the model
(`fused_linear`): the model's weights must not change after compilation (a program compiled later
sees the change), and the device holds those projections twice (for Llama-3.1-8B in bf16, 9.1 of its
16 GB). On a CPU the oneDNN lowering packs the fused weights instead of the members', so the fused
float32 copy is a third copy of those projections (280 MB for the default model) until the model goes.

Where. Under every lowering that runs linears as GEMMs on their float weights: `onednn` (a CPU step
8-13 % faster at 1-16 tokens, 2-core AVX2 EPYC), `cudagraphs`, `inductor`. Not under `eager` (the
reference) or `gguf` (its blocks belong to the members).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch import nn

from .derived_cache import DerivedCache
from ...ir import copy_step
from ...ir.roles import META_KEY, NodeInfo, Role

QKV_ROLES = {Role.Q, Role.K, Role.V}

_FUSED: DerivedCache[nn.Linear] = DerivedCache()  # the members' weights and biases -> their fused linear


def fuse_projections(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm` whose sibling linears run as one GEMM each (see module docstring); a graph
    without such siblings comes back as an unchanged copy."""
    lowered = copy_step(gm)
    for group in sibling_linears(lowered):
        _fuse(lowered, group)
    lowered.graph.lint()
    lowered.delete_all_unused_submodules()
    lowered.recompile()
    return lowered


def sibling_linears(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """Groups (in graph order) of two or more plain-linear call_module nodes that can share a GEMM."""
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.kwargs or len(node.args) != 1:
            continue
        module = gm.get_submodule(node.target)
        if type(module) is not nn.Linear:  # subclasses (quantized, sharded) may compute otherwise
            continue
        w = module.weight
        key = (node.args[0], w.dtype, w.device, w.shape[1], module.bias is not None)
        groups.setdefault(key, []).append(node)
    return [nodes for nodes in groups.values() if len(nodes) > 1 and _distinct_weights(gm, nodes)]


def _distinct_weights(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> bool:
    """A module called twice on one input (or two modules sharing a weight) is not a projection pair."""
    weights = [id(gm.get_submodule(n.target).weight) for n in nodes]
    return len(set(weights)) == len(weights)


def fused_linear(modules: list[nn.Linear]) -> nn.Linear:
    """One linear over the members' concatenated weights (and biases), shared by every graph lowered
    from them in this process, so that a lowering that copies weights again (oneDNN packs each
    distinct weight once per process) sees the same tensor. Made again when a member's weight or bias
    changed in place since (its version counter moved); the entry goes when a member does."""
    params = [p for m in modules for p in (m.weight, m.bias) if p is not None]
    return _FUSED.get(params, lambda: _concatenated(modules))


def _concatenated(modules: list[nn.Linear]) -> nn.Linear:
    first = modules[0]
    fused = nn.Linear(first.in_features, sum(m.out_features for m in modules), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)  # fmt: skip
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in modules]))  # [sum N, K]
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([m.bias for m in modules]))
    return fused.requires_grad_(False)


def _fuse(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> None:
    modules = [gm.get_submodule(n.target) for n in nodes]
    sizes = [m.out_features for m in modules]
    fused = fused_linear(modules)
    name = f"fused.{nodes[0].target}"
    gm.add_submodule(name, fused)
    graph = gm.graph
    with graph.inserting_before(nodes[0]):
        call = graph.call_module(name, nodes[0].args)
        parts = graph.call_method("split", (call, sizes, -1))
    call.meta.update(nodes[0].meta)
    if META_KEY in call.meta and {n.meta[META_KEY].role for n in nodes} <= QKV_ROLES:
        call.meta[META_KEY] = NodeInfo(Role.QKV, call.meta[META_KEY].layer)
    parts.meta.update(call.meta)
    with graph.inserting_after(parts):
        pieces = [graph.call_function(operator.getitem, (parts, i)) for i in reversed(range(len(nodes)))][::-1]
    for node, piece in zip(nodes, pieces):
        piece.meta.update(node.meta)
        node.replace_all_uses_with(piece)
        graph.erase_node(node)
