"""Drafters feeding the tree verifier: training-free (prompt lookup, token recycling, suffix drafting),
draft heads, a feature draft (EAGLE) and the model's own first layers (self-drafting)."""

from specpass.drafters.base import (
    Combined, Drafter, Drafting, DraftModel, DraftSession, PerRowDrafting, RootsOnly, RowsDrafting, TargetForward,
    VerifiedRows, expected_tokens,
)
from specpass.drafters.feature import Feature
from specpass.drafters.heads import Heads
from specpass.drafters.prompt_lookup import PromptLookup
from specpass.drafters.recycled_lookup import RecycledLookup, rows_drafting
from specpass.drafters.self_draft import SelfDraft
from specpass.drafters.suffix import Suffix
from specpass.drafters.token_recycling import TokenRecycling
from specpass.drafters.tree_rows import TreeRows
from specpass.drafters.tree import Candidate, DraftTree, DrawnCandidate, accept_greedy, build_tree


def default_drafter() -> Drafter:
    """Prompt lookup branches and token recycling competing for one tree."""
    return Combined(PromptLookup(), TokenRecycling())


__all__ = [
    "Candidate",
    "Combined",
    "DraftModel",
    "DraftSession",
    "DraftTree",
    "DrawnCandidate",
    "Drafter",
    "Feature",
    "Drafting",
    "PerRowDrafting",
    "RootsOnly",
    "RowsDrafting",
    "TreeRows",
    "VerifiedRows",
    "Heads",
    "PromptLookup",
    "RecycledLookup",
    "SelfDraft",
    "Suffix",
    "TokenRecycling",
    "TargetForward",
    "accept_greedy",
    "build_tree",
    "default_drafter",
    "expected_tokens",
    "rows_drafting",
]
