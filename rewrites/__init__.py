"""Graph rewrites, one module each. PASS_TYPES maps pass names to classes for Pipeline.from_json."""

from specpass.rewrites.draft_heads import DRAFT_HEADS, DraftHeads
from specpass.rewrites.tree_attention import TREE_ATTENTION, TreeAttention, tree_attention_mask

PASS_TYPES = {"TreeAttention": TreeAttention, "DraftHeads": DraftHeads}

__all__ = ["DRAFT_HEADS", "PASS_TYPES", "TREE_ATTENTION", "DraftHeads", "TreeAttention", "tree_attention_mask"]
