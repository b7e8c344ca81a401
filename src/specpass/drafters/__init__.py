"""Training-free drafters feeding the tree verifier."""

from specpass.drafters.base import Combined, Drafter, Drafting, DraftSession, expected_tokens
from specpass.drafters.prompt_lookup import PromptLookup
from specpass.drafters.token_recycling import TokenRecycling
from specpass.drafters.tree import DraftTree, accept_greedy, build_tree


def default_drafter() -> Drafter:
    """Prompt lookup branches and token recycling competing for one tree."""
    return Combined(PromptLookup(), TokenRecycling())


__all__ = [
    "Combined",
    "DraftSession",
    "DraftTree",
    "Drafter",
    "Drafting",
    "PromptLookup",
    "TokenRecycling",
    "accept_greedy",
    "build_tree",
    "default_drafter",
    "expected_tokens",
]
