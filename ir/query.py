"""Queries on an annotated decode-step graph: where its attention, its mask and its cache writes are.

Rewrites (tree attention, KV as inputs/outputs, eviction), the verifier and the exporter find the
graph's anchors here, never by walking the graph themselves. Each query returns what it found;
`shared_mask` and `shared_write_slots` return the one node every layer shares, or None when the
layers do not share one (the caller says why it cannot proceed).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .ops import (pruned_visibility, selected_attention, sink_attention, sliding_window_visibility, softcapped_attention,
                  write_cache)
from .roles import Role, info, nodes_with_role

SDPA = torch.nn.functional.scaled_dot_product_attention
ATTENTION_FUNCTIONS = (SDPA, softcapped_attention, sink_attention, selected_attention)


def attention_ops(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The attention calls (SDPA, soft-capped, with sinks, or over selected slots), in graph order (one per layer in a valid step)."""
    return [
        n for n in nodes_with_role(graph, Role.ATTENTION) if n.op == "call_function" and n.target in ATTENTION_FUNCTIONS
    ]


def is_sharded(graph: torch.fx.Graph) -> bool:
    """Whether the step calls collectives (a TensorParallel shard of the model)."""
    return any(n.op == "call_function" and "_c10d_functional" in str(n.target) for n in graph.nodes)


RESTRICTIONS = (sliding_window_visibility, pruned_visibility)  # a layer's restrictions of the shared mask


def base_mask(mask: torch.fx.Node | None) -> torch.fx.Node | None:
    """The mask under a layer's restrictions (`ir.ops.sliding_window_visibility`, `ir.ops.pruned_visibility`),
    or `mask` itself: the slot-layout mask that rewrites replace."""
    while mask is not None and mask.op == "call_function" and mask.target in RESTRICTIONS:
        mask = mask.args[0]
    return mask


def attention_masks(graph: torch.fx.Graph) -> set[torch.fx.Node | None]:
    """The distinct base masks the attention ops read (None for an op without a mask); a sliding-window
    layer reads its window over one of them."""
    return {base_mask(n.kwargs.get("attn_mask")) for n in attention_ops(graph)}


def shared_mask(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The one base attention mask every layer reads (through its window, if it has one), or None if
    there is not exactly one."""
    masks = attention_masks(graph)
    return next(iter(masks)) if len(masks) == 1 else None


def cache_writes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The in-place cache writes `write_cache(cache, slots, new)` (ir.ops), in graph order (K then V per layer)."""
    return [n for n in nodes_with_role(graph, Role.CACHE_WRITE) if n.op == "call_function" and n.target is write_cache]


def write_slot_indices(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The distinct slot-index nodes the cache writes use."""
    return {n.args[1] for n in cache_writes(graph)}


def shared_write_slots(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The one slot index every cache write uses, or None if there is not exactly one."""
    indices = write_slot_indices(graph)
    return next(iter(indices)) if len(indices) == 1 else None


def cache_buffer(write: torch.fx.Node) -> str:
    """Which cache buffer (`k_cache` or `v_cache`) a cache write writes into."""
    node = write.args[0]
    while node.op != "get_attr":
        node = node.args[0]
    return node.target


def residual_adds(graph: torch.fx.Graph, layer: int) -> list[torch.fx.Node]:
    """A layer's residual adds in graph order: [stream + attention output, stream + MLP output]."""
    return [n for n in nodes_with_role(graph, Role.RESIDUAL) if info(n).layer == layer and n.target is operator.add]
