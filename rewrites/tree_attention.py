"""Tree attention: verify a whole token tree in one forward of the target model.

Papers: Medusa (tree attention), SpecInfer, Token Recycling, DySpec. The captured chain step writes slot
positions[0, t] and attends to every slot <= its position. The rewrite adds the graph inputs that encode
a step's slot layout (ir.layout): `tree_mask` [B, T, T] bool (node j is node i or one of its ancestors)
and `cache_slots` [B, T] int64 (row b's write slots; `cache_slots[b, 0]` is its committed length),
replaces the chain mask by `ir.layout.slot_visibility` and indexes the cache writes with `cache_slots`;
positions (committed length + depth) still drive rotary.

Invariants. Logits of node i equal the chain step's for the path root -> i (a one-node tree is plain
decoding); nothing else changes. The caller compacts the accepted path's K/V afterwards
(backends.runtime.kv.compact). Applying the rewrite twice is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..common.errors import GraphVerificationError, InvalidParameterError
from ..ir import arch_of, is_captured_step, query
from ..ir.layout import slot_visibility
from ..ir.roles import Role, annotate, info, placeholder
from ..passes.base import Pass, PassResult
from ..passes.export import ExportHook

TREE_ATTENTION = "tree_attention"


@dataclass(frozen=True)
class TreeAttention(Pass):
    """Rewrite the chain decode step into a tree-verification step (see module docstring).

    max_nodes: the largest tree the step will be asked to verify (sizes CUDA-graph buckets and caps
    the drafter's budget).
    """

    max_nodes: int = 64

    ensures = frozenset({TREE_ATTENTION})

    def __post_init__(self):
        if not isinstance(self.max_nodes, int) or isinstance(self.max_nodes, bool) or not 1 <= self.max_nodes <= 512:
            raise InvalidParameterError(f"TreeAttention.max_nodes must be an int in [1, 512], got {self.max_nodes!r}")

    def largest_tree(self) -> int:
        return self.max_nodes

    def export_hook(self, gm: torch.fx.GraphModule, arch, dtype: torch.dtype) -> ExportHook:
        """Nothing beside the step: the tree mask is an input of every exported step."""
        return ExportHook()

    def check(self, gm: torch.fx.GraphModule) -> str | None:
        graph = gm.graph
        if placeholder(graph, "tree_mask") is not None:
            return "the graph already verifies trees (it has a tree_mask input)"
        if placeholder(graph, "kv_len") is None:
            return "the graph has no kv_len input"
        mask = query.shared_mask(graph)
        if mask is None:
            return f"expected one attention mask shared by all attention ops, found {len(query.attention_masks(graph))}"
        if info(mask).role is not Role.MASK or mask.op == "placeholder":
            return f"attention mask {mask.name} is not the captured chain mask"
        index = query.shared_write_slots(graph)
        if index is None:
            return f"expected one slot index shared by all cache writes, found {len(query.write_slot_indices(graph))}"
        if info(index).role is not Role.CACHE_INDEX:
            return f"cache writes index with {index.name}, not the captured cache slots"
        window = arch_of(gm).smallest_window if is_captured_step(gm) else None
        if window is not None and self.max_nodes >= window:
            return (f"trees of up to {self.max_nodes} nodes can reach as deep as the model's sliding window "
                    f"({window}), where the window mask stops being exact; use max_nodes < {window}")  # fmt: skip
        return None

    def rewrite(self, gm: torch.fx.GraphModule) -> PassResult:
        graph = gm.graph
        mask, index = query.shared_mask(graph), query.shared_write_slots(graph)
        kv_len = placeholder(graph, "kv_len")
        last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last_input):
            tree_mask = annotate(graph.placeholder("tree_mask"), Role.INPUT)
        with graph.inserting_after(tree_mask):
            cache_slots = annotate(graph.placeholder("cache_slots"), Role.INPUT)
        with graph.inserting_before(mask):
            new_mask = graph.call_function(slot_visibility, (tree_mask, cache_slots, kv_len))
            annotate(new_mask, Role.MASK)
        mask.replace_all_uses_with(new_mask)
        index.replace_all_uses_with(cache_slots)
        before = len(graph.nodes)
        graph.eliminate_dead_code()
        removed = before - len(graph.nodes)
        window = arch_of(gm).smallest_window if is_captured_step(gm) else None
        below = f", below the narrowest sliding window ({window})" if window is not None else ""
        return PassResult(gm, True, f"trees of up to {self.max_nodes} nodes{below}; added inputs tree_mask, cache_slots; "
                                    f"replaced the chain mask; removed {removed} dead nodes")  # fmt: skip

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """Every layer attends through the slot-layout mask of the tree inputs, and every cache write
        goes to `cache_slots`."""
        graph = gm.graph
        mask, index = query.shared_mask(graph), query.shared_write_slots(graph)
        tree_mask, cache_slots = placeholder(graph, "tree_mask"), placeholder(graph, "cache_slots")
        if tree_mask is None or cache_slots is None:
            raise GraphVerificationError("TreeAttention: the step lost its tree_mask / cache_slots inputs")
        if mask is None or mask.target is not slot_visibility or mask.args[:2] != (tree_mask, cache_slots):
            raise GraphVerificationError("TreeAttention: attention does not read the tree's slot-visibility mask")
        if index is not cache_slots:
            raise GraphVerificationError("TreeAttention: the cache writes do not index with cache_slots")
