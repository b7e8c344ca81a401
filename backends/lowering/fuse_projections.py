"""Sibling projections as one GEMM: linears reading the same input (a layer's q, k, v; its MLP's gate and
up) become one linear over their concatenated weights, its output split back into the members' outputs.

A layer then runs four GEMMs instead of seven over the same bytes, which matters where a step is bound by
kernel count (a GPU) and pays on a CPU too (docs/experiments.md, "GPU step, 2026-11-26" and "Sibling
projections fused under oneDNN"). A group: plain `nn.Linear` call_modules with the same input node,
dtype, device and bias presence; the fused call takes the first member's annotation (role QKV for
q/k/v), each part its member's; the source graph is not modified. Each part equals its member up to
GEMM rounding. The fused weights are a copy, made once per process for the model's programs
(`fused_linear`): the model's weights must not change after compilation. Used under `onednn`,
`cudagraphs` and `inductor`; not under `eager` (the reference) or `gguf` (the members' blocks).
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
