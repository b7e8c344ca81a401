"""KV as inputs and outputs: the functional form of a rewritten decode step, which the ONNX export
(backends.onnx.export) hands to `torch.onnx.export(..., dynamo=True)`.

The captured step writes its static cache in place, which an ONNX graph cannot express without aliasing.
`kv_as_io` rewrites a copy: in every layer the cache write and the read of slots [0, kv_len) become
`cat(past[layer], new, dim=2)`, the mask becomes `ir.layout.past_and_tree_visibility(past_mask,
tree_mask)` (a sparse-attention step's own slots `past_and_tree_slots`), and in a KV-eviction step each layer's `record_queries` becomes the `queries` output (the
policy's graphs are exported beside the step by its export hook, rewrites.kv_eviction.export). Inputs
INPUTS: input_ids, positions [B, T]; past_keys, past_values [L, B, KV, S, D]; past_mask [B, T, S]; tree_mask
[B, T, T]. Outputs: logits, hidden, new_keys, new_values [L, B, KV, T, D], then queries [L, B, H, T, D] and
the step's further outputs. A token's logits equal the cached step's when it sees the same slots (tested);
the runtime commits an accepted path by copying its new K/V (compaction without recompute).
"""

from __future__ import annotations

import torch
import torch.fx

from ...common.errors import PassMismatchError
from ...ir import copy_step, info, query
from ...ir.layout import past_and_tree_slots, past_and_tree_visibility
from ...ir.ops import select_slots
from ...ir.draft import EVICT_MODULE, OBSERVE_MODULE
from ...ir.roles import Role, annotate, placeholder
from ...rewrites.kv_eviction import ops as eviction_ops

INPUTS = ("input_ids", "positions", "past_keys", "past_values", "past_mask", "tree_mask")
KV_OUTPUTS = ("new_keys", "new_values")
QUERIES_OUTPUT = "queries"  # a KV-eviction step's further output


def _recorded_queries(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Each layer's recorded queries [B, H, T, D], in layer order, with the recording ops removed."""
    queries = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is eviction_ops.record_queries:
            _, layer, q = node.args
            if layer != len(queries):
                raise PassMismatchError(f"queries recorded for layer {layer} after {len(queries)} layers")
            node.replace_all_uses_with(q)
            graph.erase_node(node)
            queries.append(q)
    return queries


def _cache_reads(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(cache write, the slice of the written cache that attention reads), in graph order."""
    pairs = []
    for write in query.cache_writes(graph):
        users = list(write.users)
        if len(users) != 1:
            raise PassMismatchError(f"cache write {write.name} has {len(users)} readers, expected one slice")
        pairs.append((write, users[0]))
    return pairs


def kv_as_io(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the rewritten step with the KV cache as inputs and outputs (see module docstring)."""
    lowered = copy_step(gm)
    graph = lowered.graph
    num_layers = lowered.meta["specpass_arch"].num_layers
    reads = _cache_reads(graph)
    if len(reads) != 2 * num_layers:
        raise PassMismatchError(f"expected a key and a value cache write per layer, found {len(reads)} writes")
    mask = query.shared_mask(graph)
    if mask is None:
        found = len(query.attention_masks(graph))
        raise PassMismatchError(f"expected one attention mask shared by every layer, found {found}")

    old_inputs = [n for n in graph.nodes if n.op == "placeholder"]
    new_inputs = {}
    with graph.inserting_after(old_inputs[-1]):
        for name in INPUTS[2:]:  # input_ids, positions (and a tree step's tree_mask) are kept as they are
            new_inputs[name] = placeholder(graph, name) or annotate(graph.placeholder(name), Role.INPUT)
    with graph.inserting_before(mask):
        masks = (new_inputs["past_mask"], new_inputs["tree_mask"])
        attention_mask = graph.call_function(past_and_tree_visibility, masks)
    annotate(attention_mask, Role.MASK)
    mask.replace_all_uses_with(attention_mask)
    selections = [n for n in graph.nodes if n.op == "call_function" and n.target is select_slots]
    if selections:  # a sparse-attention step: each token's own slot, in the functional layout
        with graph.inserting_before(selections[0]):
            own = annotate(graph.call_function(past_and_tree_slots, masks), Role.CACHE_INDEX)
        for node in selections:
            node.args = (*node.args[:5], own, *node.args[6:])

    new_kv: dict[str, list[torch.fx.Node]] = {"past_keys": [], "past_values": []}
    for write, read in reads:
        layer = info(write).layer
        source = {"k_cache": "past_keys", "v_cache": "past_values"}[query.cache_buffer(write)]
        new = write.args[2]  # [B, KV, T, D]
        with graph.inserting_before(read):
            past = annotate(graph.call_function(_layer, (new_inputs[source], layer)), Role.CACHE, layer)
            both = annotate(graph.call_function(torch.cat, ((past, new),), {"dim": 2}), Role.ATTENTION, layer)
        read.replace_all_uses_with(both)
        graph.erase_node(read)
        graph.erase_node(write)
        new_kv[source].append(new)

    queries = _recorded_queries(graph)
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        stacked = [
            annotate(graph.call_function(torch.stack, (tuple(new_kv[source]),)), Role.CACHE_WRITE)
            for source in ("past_keys", "past_values")
        ]
        if queries:
            stacked.append(annotate(graph.call_function(torch.stack, (tuple(queries),)), Role.EVICTION))
    logits, hidden, *extra = output.args[0]
    output.args = ((logits, hidden, *stacked, *extra),)
    graph.eliminate_dead_code()
    for node in old_inputs:
        if node.target not in INPUTS:
            graph.erase_node(node)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for name in INPUTS:  # the signature, in the documented order
        first.prepend(placeholder(graph, name))
    for name in ("k_cache", "v_cache", eviction_ops.QUERIES, OBSERVE_MODULE, EVICT_MODULE):
        if hasattr(lowered, name):  # the functional step owns no cache, no eviction state
            delattr(lowered, name)
    graph.lint()
    lowered.recompile()
    order = [n.target for n in graph.nodes if n.op == "placeholder"]
    if order != list(INPUTS):
        raise PassMismatchError(f"the step's inputs came out as {order}, expected {list(INPUTS)}")
    return lowered


def _layer(stacked: torch.Tensor, layer: int) -> torch.Tensor:
    return stacked[layer]  # [B, KV, S, D]
