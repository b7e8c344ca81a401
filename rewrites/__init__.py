"""Graph rewrites, one module each. Each defines a Pass subclass, known by its class name to
Pipeline.from_json through passes.registry."""

from specpass.rewrites.draft_heads import DRAFT_HEADS, HEADS_KIND, DraftHeads
from specpass.rewrites.tree_attention import TREE_ATTENTION, TreeAttention

__all__ = ["DRAFT_HEADS", "HEADS_KIND", "TREE_ATTENTION", "DraftHeads", "TreeAttention"]
