"""Cutting a decode step at a layer boundary: the graphs self-speculation runs (rewrites.EarlyExit,
rewrites.LayerSkip).

`exit_graph(gm, k)`: the embedding and layers [0, k), then the step's final norm and LM head; returns
(logits, exit_hidden), exit_hidden the residual stream after those layers. `resume_graph(gm, k)`: layers
[k, L), final norm and LM head from an `exit_hidden` input; returns the step's outputs. `skip_graph(gm,
skip, L)`: the step without the layers in `skip` (a skipped layer's readers read the stream after the
last kept layer before it); returns (logits, exit_hidden before layer min(skip)). Each writes the step's
own cache entries for its layers (skip_graph's above min(skip) are approximations, which the resumed
verify overwrites). Invariant (tested): exit then resume writes the same cache entries and returns the
same outputs as the step: both are the step's own nodes, cut apart, never recomputed. The cut reads the
layer annotations (ir.roles), so it holds for every family and every rewrite that keeps them.
"""

from __future__ import annotations

import copy

import torch
import torch.fx

from . import query
from .roles import META_KEY, NodeInfo, Role, info

EXIT_HIDDEN = "exit_hidden"  # the resume graph's input: the residual stream after the exit layer


def layer_output(graph: torch.fx.Graph, layer: int) -> torch.fx.Node:
    """The node holding the residual stream after `layer`: the layer's last residual add."""
    adds = query.residual_adds(graph, layer)
    if not adds:
        raise ValueError(f"the graph has no residual add annotated with layer {layer}")
    return adds[-1]


def final_norm_input(graph: torch.fx.Graph, num_layers: int) -> torch.fx.Node:
    """The residual stream after the last layer (what the final norm reads)."""
    return layer_output(graph, num_layers - 1)


def exit_graph(gm: torch.fx.GraphModule, layer: int, num_layers: int) -> torch.fx.GraphModule:
    """Layers [0, layer) + the step's final norm and LM head (see the module docstring)."""
    module = _module(gm, "ExitGraph")
    graph = module.graph
    exit_hidden, last = layer_output(graph, layer - 1), final_norm_input(graph, num_layers)
    _users_after(graph, last, exit_hidden)  # the final norm reads the exit layer's output
    outputs = next(n for n in graph.nodes if n.op == "output")
    outputs.args = ((outputs.args[0][0], exit_hidden),)  # (logits, exit_hidden)
    _erase(graph, lambda n: info(n).layer is not None and info(n).layer >= layer)
    return _finish(module)


def skip_graph(gm: torch.fx.GraphModule, skip: frozenset[int], num_layers: int) -> torch.fx.GraphModule:
    """The step without the layers in `skip` (1 <= each < num_layers; see the module docstring)."""
    module = _module(gm, "SkipGraph")
    graph = module.graph
    first = min(skip)
    exit_hidden = layer_output(graph, first - 1)
    for layer in sorted(skip):  # ascending: a run of skipped layers all read the last layer kept before it
        kept = max(k for k in range(layer) if k not in skip)
        _users_after(graph, layer_output(graph, layer), layer_output(graph, kept))
    outputs = next(n for n in graph.nodes if n.op == "output")
    outputs.args = ((outputs.args[0][0], exit_hidden),)  # (logits, exit_hidden)
    _erase(graph, lambda n: info(n).layer in skip)
    return _finish(module)


def resume_graph(gm: torch.fx.GraphModule, layer: int) -> torch.fx.GraphModule:
    """Layers [layer, L) + final norm + LM head from an `exit_hidden` input (see the module docstring)."""
    module = _module(gm, "ResumeGraph")
    graph = module.graph
    ids = next(n for n in graph.nodes if n.op == "placeholder" and n.target == "input_ids")
    with graph.inserting_before(ids):
        hidden = graph.placeholder(EXIT_HIDDEN)
    hidden.meta[META_KEY] = NodeInfo(Role.INPUT)
    embedded = [n for n in graph.nodes if info(n).role is Role.EMBED][-1]  # the stream layer 0 reads
    layer_output(graph, layer - 1).replace_all_uses_with(hidden)
    embedded.replace_all_uses_with(hidden)  # what else read it (its dtype, for the rotary tables)
    _erase(graph, lambda n: info(n).layer is not None and info(n).layer < layer)
    _erase(graph, lambda n: info(n).role is Role.EMBED or n is ids)
    return _finish(module)


def _users_after(graph: torch.fx.Graph, old: torch.fx.Node, new: torch.fx.Node) -> None:
    """Every user of `old` outside its own layer reads `new` instead."""
    layer = info(old).layer
    for user in list(old.users):
        if info(user).layer != layer:
            user.replace_input_with(old, new)


def _erase(graph: torch.fx.Graph, doomed) -> None:
    """Erase the nodes `doomed` selects (users first), then the nodes nothing reads any more."""
    for node in reversed(list(graph.nodes)):
        if node.op != "output" and doomed(node):
            if node.users:
                raise ValueError(f"cannot cut {node.name}: {[u.name for u in node.users]} still read it")
            graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()


def _module(gm: torch.fx.GraphModule, name: str) -> torch.fx.GraphModule:
    """A GraphModule over a copy of gm's graph, sharing gm's modules, parameters and KV-cache buffers."""
    module = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=name)
    module.meta.update(gm.meta)
    return module


def _finish(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    module.delete_all_unused_submodules()
    module.recompile()
    return module
