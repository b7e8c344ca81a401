"""Cutting a decode step at a layer boundary: the graphs self-speculation runs.

For an exit layer k (1 <= k < L) of a captured (and possibly rewritten) step:

* `exit_graph(gm, k)` runs the embedding and layers [0, k), then the step's own final norm and LM
  head on the hidden state after layer k (a plain early exit). It takes the step's inputs and returns
  (logits [B, T, V], exit_hidden [B, T, H]): the exit's next-token logits and the raw residual stream
  after layer k. Its cache writes are the step's own for layers [0, k), into the same buffers.
* `resume_graph(gm, k)` runs layers [k, L), the final norm and the LM head from `exit_hidden`
  [B, T, H] given as an input (in place of `input_ids`), with the step's other inputs; it returns the
  step's outputs. Its cache writes are the step's own for layers [k, L).

* `skip_graph(gm, skip, L)` runs the step with the layers in `skip` left out (each one's readers read
  the residual stream after the last layer kept before it), then the final norm and LM head. It
  returns (logits, exit_hidden) with exit_hidden the stream after layer min(skip) - 1: the layers
  below the first skipped one are the step's own, so `resume_graph(gm, min(skip))` verifies from
  there. Its cache writes for the layers below min(skip) are the step's own; those of the kept layers
  above it are the draft's approximations, which the resumed verify step overwrites.

Invariant (tested): for any tokens and slot layout, running `exit_graph` then `resume_graph` on its
`exit_hidden` writes the same cache entries and returns the same outputs as the step itself, because
both are the step's own nodes (same ops, same order), cut apart and never recomputed. The cut is made
on the graph's annotations (ir.roles: every layer node carries its layer index), so it applies to any
family and after any rewrite that keeps those annotations.
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
