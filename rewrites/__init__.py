"""Graph rewrites, one module each. PASS_TYPES maps pass names to classes for Pipeline.from_json."""

from specpass.rewrites.tree_attention import TREE_ATTENTION, TreeAttention, tree_attention_mask

PASS_TYPES = {"TreeAttention": TreeAttention}

__all__ = ["PASS_TYPES", "TREE_ATTENTION", "TreeAttention", "tree_attention_mask"]
