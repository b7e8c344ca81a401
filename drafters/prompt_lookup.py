"""Prompt lookup: draft the continuation of earlier occurrences of the last n tokens (PLD, CopySpec).

Unlike HF's prompt lookup (one chain), every distinct continuation found becomes a branch of the tree.

Acceptance is estimated per *match length*: a continuation token copied after an n-token match, at
offset k into the copy, extends a match of n + k tokens once its predecessors are accepted, and
longer matches are likelier to go on (docs/experiments.md, "Prompt lookup keyed by match length").
Keying the running rates by that length keeps a copy that is going well deep in the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .base import Drafter, check_params
from .contract import ChainSource, Chains, DraftSession
from .chains import ChainSession


# P(copied token accepted | its parent was), by the match length it would extend (capped at MAX_MATCH).
PRIORS = {1: 0.2, 2: 0.45, 3: 0.65, 4: 0.75, 5: 0.78, 6: 0.8, 7: 0.85}
DEFAULT_PRIOR = 0.88  # past the longest match PRIORS names
MAX_MATCH = 10


@dataclass(frozen=True)
class PromptLookup(Drafter):
    """max_ngram..min_ngram: suffix lengths matched (longest first); max_branches distinct continuations
    of up to max_depth tokens each."""

    max_ngram: int = 3
    min_ngram: int = 1
    max_depth: int = 16
    max_branches: int = 4

    def __post_init__(self):
        check_params("PromptLookup", max_ngram=self.max_ngram, min_ngram=self.min_ngram)
        check_params("PromptLookup", max_depth=self.max_depth, max_branches=self.max_branches)
        if self.min_ngram > self.max_ngram:
            from ..common.errors import InvalidParameterError

            raise InvalidParameterError(f"PromptLookup.min_ngram {self.min_ngram} > max_ngram {self.max_ngram}")

    def start(self, prompt: Sequence[int], prefill, memory=None, draft=None, seed=0) -> DraftSession:
        return PromptLookupSession(self)

    def rows_source(self, memory=None) -> ChainSource:
        return LookupChains(self)


class LookupChains(ChainSource):
    """Every row's branches as chains (drafters.chains): stats key = the match length a token extends
    (capped at MAX_MATCH); a later branch's first token is divided by 1 + its index, as a session's."""

    priors = np.array([PRIORS.get(n, DEFAULT_PRIOR) for n in range(MAX_MATCH + 1)])

    def __init__(self, config: PromptLookup):
        self.config = config

    def chains(self, history: np.ndarray, lengths: np.ndarray) -> Chains:
        branches, matched = lookup_branches(history, lengths, self.config)  # [B, M, D], [B, M]
        batch, count, depth = branches.shape
        keys = np.minimum(matched[:, :, None] + np.arange(depth), MAX_MATCH)  # [B, M, D]
        divisors = np.broadcast_to(1.0 + np.arange(count), (batch, count))  # [B, M]
        return Chains(branches, keys, divisors)


def lookup_branches(history: np.ndarray, lengths: np.ndarray, config: PromptLookup) -> tuple[np.ndarray, np.ndarray]:
    """Every row's continuations of earlier occurrences of its last n tokens, n = max_ngram .. min_ngram,
    longest match and most recent occurrence first, at most max_branches distinct ones (one that
    repeats, or is a prefix of, one found before is skipped).

    history [B, S] int64 (row b's tokens in [0, lengths[b])) -> branches [B, M, D] int64 (-1 past a
    continuation's end; D = max_depth, M = max_branches) and matched [B, M] int64 (the match length
    n; 0: no branch)."""
    from . import kernels  # compiled on first use

    return kernels.lookup_branches(history, lengths, config.max_ngram, config.min_ngram, config.max_depth,
                                   config.max_branches)  # fmt: skip


class PromptLookupSession(ChainSession):
    """One row's branches for the best-first builder (when combined with a drafter that has no rows
    source; drafters.chains drafts every row at once otherwise)."""

    def __init__(self, config: PromptLookup):
        super().__init__(LookupChains(config))
        self.config = config

    def branches(self, tokens: Sequence[int]) -> list[tuple[int, list[int]]]:
        """(matched n, continuation) pairs, longest match and most recent occurrence first."""
        history = np.asarray(tokens, dtype=np.int64)[None, :]
        branches, matched = lookup_branches(history, np.array([history.shape[1]]), self.config)
        return [(int(n), [t for t in branch if t >= 0]) for n, branch in zip(matched[0].tolist(), branches[0].tolist()) if n > 0]
