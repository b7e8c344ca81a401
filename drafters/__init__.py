"""Drafters feeding the tree verifier: training-free (prompt lookup, CopySpec, ADED, token recycling,
suffix drafting), draft heads, a feature draft (EAGLE) and the model's own first layers (self-drafting)."""

from .aded import Aded
from .base import Combined, Drafter, PerRowDrafting, draft_row, expected_tokens, observe_row
from .chains import ChainDrafting
from .copy_spec import CopySpec
from .contract import (
    Chains, ChainSource, DraftModel, DraftSession, RootsOnly, RowsDrafting, TargetForward,
)  # fmt: skip
from .feature import Feature
from .heads import Heads
from .prompt_lookup import PromptLookup
from .self_draft import SelfDraft
from .suffix import Suffix
from .token_recycling import TokenRecycling
from .tree_rows import TreeRows
from .tree import Candidate, DraftTree, DrawnCandidate, accept_greedy, build_tree


def default_drafter() -> Drafter:
    """Prompt lookup branches and token recycling competing for one tree."""
    return Combined(PromptLookup(), TokenRecycling())


__all__ = [
    "Aded",
    "Candidate",
    "ChainDrafting",
    "ChainSource",
    "Chains",
    "Combined",
    "CopySpec",
    "DraftModel",
    "DraftSession",
    "DraftTree",
    "DrawnCandidate",
    "Drafter",
    "Feature",
    "PerRowDrafting",
    "RootsOnly",
    "RowsDrafting",
    "TreeRows",
    "Heads",
    "PromptLookup",
    "SelfDraft",
    "Suffix",
    "TokenRecycling",
    "TargetForward",
    "accept_greedy",
    "build_tree",
    "default_drafter",
    "draft_row",
    "expected_tokens",
    "observe_row",
]
