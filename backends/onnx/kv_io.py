"""KV as inputs and outputs: the functional form of a rewritten decode step, for export.

The captured step owns a static KV cache and writes it in place (`write_cache` at the cache slots),
which an ONNX graph cannot express without aliasing. This lowering rewrites a copy of the step so that

    inputs   input_ids   [B, T]  int64     tokens to verify (a tree, a chain, or a prompt)
             positions   [B, T]  int64     rotary positions (prefix length + depth for a tree)
             past_keys   [L, B, KV, S, D]  cached keys of S slots (the runtime's cache buffer)
             past_values [L, B, KV, S, D]  cached values
             past_mask   [B, T, S] bool    past_mask[b, t, s]: token t attends to cached slot s
             tree_mask   [B, T, T] bool    tree_mask[b, t, j]: token t attends to token j (ancestor or self)
    outputs  logits      [B, T, V]
             hidden      [B, T, H]         final normed hidden states
             new_keys    [L, B, KV, T, D]  the T tokens' keys (after rotary), for the runtime to commit
             new_values  [L, B, KV, T, D]
             queries     [L, B, H, T, D]   a KV-eviction step only: the T tokens' queries (after rotary),
                                           for the eviction graphs to score the accepted ones
             ...                           any further outputs of the step (draft outputs), unchanged

Rewrite. In every layer the cache write and the read of slots [0, kv_len) become
`cat(past[layer], new, dim=2)`; the step's attention mask becomes the slot layout's functional
encoding, `ir.layout.past_and_tree_visibility(past_mask, tree_mask)`. In a KV-eviction step each layer's
`record_queries` op (a write into the step's query store) becomes the queries' output; the policy's
state and graphs leave the step (`backends.onnx.eviction` exports them beside it).
Everything else in the graph is untouched, so the logits of token t equal the cached step's logits
when the cached step sees the same slots (tested). The runtime commits an accepted path by copying
`new_keys[..., path, :]` into its cache: compaction without recompute, as in the PyTorch lowering.
"""

from __future__ import annotations

import torch
import torch.fx

from ...common.errors import PassMismatchError
from ...ir import copy_step, info, query
from ...ir.layout import past_and_tree_visibility
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
