"""Tree attention: verify a whole token tree in one forward of the target model.

Papers: Medusa (tree attention), SpecInfer, Token Recycling, DySpec (see ../shared/seeds).

Rewrite. The captured step is a chain step: token t writes cache slot positions[0, t] and attends to
every slot <= its position. The rewrite adds two graph inputs

    tree_mask    [B, T, T] bool   tree_mask[b, i, j]: node j is node i or one of its ancestors
    cache_slots  [T] int64        slot each node's K/V is written to; cache_slots[0] is the slot of
                                  the tree's root, every slot below it is committed prefix

and replaces the chain mask by the tree mask: node i sees slot s iff s < cache_slots[0] (the prefix)
or s == cache_slots[j] for an ancestor-or-self j of i. The cache writes index with `cache_slots`
instead of the positions; positions (= prefix length + depth, set by the caller) still drive rotary.

Invariants. Logits of node i equal the chain step's logits for the path root -> i (a chain is the
tree whose mask is lower-triangular; a one-node tree is plain decoding). Nothing else in the graph
changes. After verification the caller moves the accepted path's K/V into consecutive slots with
`backends.kv.compact` (no recompute). Applying the rewrite twice is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from specpass.errors import InvalidParameterError
from specpass.ir.roles import Role, annotate, info, nodes_with_role, placeholder
from specpass.passes.base import Pass, PassResult

TREE_ATTENTION = "tree_attention"


def tree_attention_mask(tree_mask: torch.Tensor, cache_slots: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, T, T] ancestor mask + [T] slots -> [B, 1, T, S] boolean attention mask over S = kv_len slots."""
    key_slots = torch.arange(kv_len, device=cache_slots.device)  # [S]
    prefix = key_slots < cache_slots[0]  # [S]
    visible = prefix[None, None, :].expand(tree_mask.shape[0], tree_mask.shape[1], kv_len)  # [B, T, S]
    visible = visible.index_copy(2, cache_slots, tree_mask)  # tree columns come from the ancestor mask
    return visible.unsqueeze(1)  # [B, 1, T, S]


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

    def check(self, gm: torch.fx.GraphModule) -> str | None:
        graph = gm.graph
        if placeholder(graph, "tree_mask") is not None:
            return "the graph already verifies trees (it has a tree_mask input)"
        if placeholder(graph, "kv_len") is None:
            return "the graph has no kv_len input"
        masks = _attention_masks(graph)
        if len(masks) != 1:
            return f"expected one attention mask shared by all attention ops, found {len(masks)}"
        (mask,) = masks
        if info(mask).role is not Role.MASK or mask.op == "placeholder":
            return f"attention mask {mask.name} is not the captured chain mask"
        indices = {n.args[2] for n in _cache_writes(graph)}
        if len(indices) != 1:
            return f"expected one slot index shared by all cache writes, found {len(indices)}"
        (index,) = indices
        if info(index).role is not Role.CACHE_INDEX:
            return f"cache writes index with {index.name}, not the captured cache slots"
        return None

    def rewrite(self, gm: torch.fx.GraphModule) -> PassResult:
        graph = gm.graph
        (mask,) = _attention_masks(graph)
        (index,) = {n.args[2] for n in _cache_writes(graph)}
        kv_len = placeholder(graph, "kv_len")
        last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last_input):
            tree_mask = annotate(graph.placeholder("tree_mask"), Role.INPUT)
        with graph.inserting_after(tree_mask):
            cache_slots = annotate(graph.placeholder("cache_slots"), Role.INPUT)
        with graph.inserting_before(mask):
            new_mask = graph.call_function(tree_attention_mask, (tree_mask, cache_slots, kv_len))
            annotate(new_mask, Role.MASK)
        mask.replace_all_uses_with(new_mask)
        index.replace_all_uses_with(cache_slots)
        before = len(graph.nodes)
        graph.eliminate_dead_code()
        removed = before - len(graph.nodes)
        return PassResult(
            gm, True, f"added inputs tree_mask, cache_slots; replaced the chain mask; removed {removed} dead nodes"
        )


def _attention_masks(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    return {
        n.kwargs.get("attn_mask")
        for n in nodes_with_role(graph, Role.ATTENTION)
        if n.op == "call_function" and n.target is torch.nn.functional.scaled_dot_product_attention
    }


def _cache_writes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in nodes_with_role(graph, Role.CACHE_WRITE) if n.op == "call_method"]
