"""Drafters by name, for the command line and the benchmark."""

from __future__ import annotations

from . import default_drafter
from .aded import Aded
from .base import Combined, Drafter
from .copy_spec import CopySpec
from .feature import Feature
from .heads import Heads
from .prompt_lookup import PromptLookup
from .pseudo_tokens import PseudoTokens
from .self_draft import SelfDraft
from .suffix import Suffix
from .token_recycling import TokenRecycling
from ..common.errors import InvalidParameterError

DRAFTERS = {
    "combined": default_drafter,  # prompt lookup + token recycling (training-free)
    "prompt-lookup": PromptLookup,
    "copy-spec": CopySpec,  # CopySpec: the copy after the first occurrence of the last 3 tokens
    "token-recycling": TokenRecycling,
    "aded": Aded,  # ADED: a tri-gram table adapted to the model's text, searched by MCTS
    "suffix": Suffix,  # suffix drafting over this prompt and earlier generations of the program
    "suffix-combined": lambda: Combined(PromptLookup(), TokenRecycling(), Suffix()),
    "heads": Heads,  # draft heads, dynamic tree (needs DraftHeads in the pipeline)
    "heads-static": lambda: Heads(tree="static"),
    "heads-drawn": lambda: Heads(tree="static", temperature=1.0),  # drawn at T = 1: the multi-candidate rule
    "heads-combined": lambda: Combined(Heads(), PromptLookup(), TokenRecycling()),
    "feature": Feature,  # a feature draft, EAGLE-2's dynamic tree (needs FeatureDraft in the pipeline)
    "feature-combined": lambda: Combined(Feature(), PromptLookup(), TokenRecycling()),
    "pseudo-tokens": PseudoTokens,  # Hidden Transfer's pseudo tokens (needs HiddenTransfer in the pipeline)
    "pseudo-tokens-combined": lambda: Combined(PseudoTokens(), PromptLookup(), TokenRecycling()),
    "self-draft": SelfDraft,  # the model's first layers (needs EarlyExit or LayerSkip in the pipeline)
    "self-draft-adaptive": lambda: SelfDraft(adaptive=True),  # its chain depth chosen each step, 0: off
    "self-draft-combined": lambda: Combined(SelfDraft(adaptive=True), PromptLookup(), TokenRecycling()),
}
DRAFTER_NAMES = tuple(DRAFTERS)


def drafter_by_name(name: str) -> Drafter:
    if name not in DRAFTERS:
        raise InvalidParameterError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTER_NAMES)}")
    return DRAFTERS[name]()
