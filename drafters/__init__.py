"""Drafters feeding the tree verifier: training-free (prompt lookup, CopySpec, ADED, token recycling,
suffix drafting), draft heads, a feature draft (EAGLE, Clover, Chimera), Hidden Transfer's pseudo tokens and the
model's own first layers (self-drafting)."""

from .aded import Aded
from .base import Combined, Drafter, PerRowDrafting, draft_row, observe_row
from .chains import ChainDrafting
from .copy_spec import CopySpec
from .contract import (
    Chains, ChainSource, DraftModel, DraftSession, RootsOnly, RowsDrafting, TargetForward,
)  # fmt: skip
from .feature import Feature
from .heads import Heads
from .prompt_lookup import PromptLookup
from .pseudo_tokens import PseudoTokens
from .self_draft import SelfDraft
from .suffix import Suffix
from .token_recycling import TokenRecycling
from .best_first import Candidate, DrawnCandidate, build_tree
from .tree import DraftTree, accept_greedy, first_branches


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
    "PseudoTokens",
    "RootsOnly",
    "RowsDrafting",
    "Heads",
    "PromptLookup",
    "SelfDraft",
    "Suffix",
    "TokenRecycling",
    "TargetForward",
    "accept_greedy",
    "build_tree",
    "default_drafter",
    "first_branches",
    "draft_row",
    "observe_row",
]


def __getattr__(name: str):
    if name == "TreeRows":  # the 0.1 name of a batch's trees, until 0.2 (docs/design.md, "Renamed names")
        import warnings

        warnings.warn("specpass.drafters.TreeRows is now DraftTree (one type for one row's tree and a batch's)",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return DraftTree
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
