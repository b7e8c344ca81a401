"""CopySpec (Dumitru et al., 2025): copy what followed the earliest earlier occurrence of the last
`gamma` tokens of the conversation so far (its prompt holds the chat history), `copy` tokens at once.

The paper's mechanism as its code runs it: an index from every gamma-gram of the sequence to where it
first occurs, grown as tokens are committed (the gram ending at the newest token is indexed one step
later, so the suffix never matches itself); each step looks up the last gamma tokens and drafts the
`copy` tokens after that first occurrence as one chain. No backoff to shorter grams, one chain a row.
Prompt lookup (drafters.PromptLookup) differs in three ways: grams of max_ngram down to min_ngram
tokens, the most recent occurrences first, and several branches; docs/experiments.md compares them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .base import Drafter, check_params
from .contract import Chains, ChainSource, DraftSession
from .chains import ChainSession
from .prompt_lookup import MAX_MATCH, LookupChains


@dataclass(frozen=True)
class CopySpec(Drafter):
    """gamma: tokens matched; copy: tokens copied after the match (the paper's 3 and 10)."""

    gamma: int = 3
    copy: int = 10

    def __post_init__(self):
        check_params("CopySpec", gamma=self.gamma, copy=self.copy)

    def start(self, prompt: Sequence[int], prefill, memory=None, draft=None, seed=0) -> DraftSession:
        return ChainSession(self.rows_source(memory))

    def rows_source(self, memory=None) -> ChainSource:
        return CopyChains(self)


class CopyChains(ChainSource):
    """Every row's copy as one chain (drafters.chains). A copied token's stats key is the match length it
    extends (gamma + its offset, capped), with prompt lookup's priors: the two drafters' keys mean the same."""

    priors = LookupChains.priors

    def __init__(self, config: CopySpec):
        self.config = config
        self.firsts: list[dict[tuple[int, ...], int]] = []  # per row: gram -> where it first starts
        self.indexed: list[int] = []  # per row: grams starting before this position are in `firsts`

    def chains(self, history: np.ndarray, lengths: np.ndarray) -> Chains:
        """history [B, S] (row b's tokens in [0, lengths[b])) -> one chain a row, [B, 1, copy]."""
        gamma, copy = self.config.gamma, self.config.copy
        rows = history.shape[0]
        while len(self.firsts) < rows:
            self.firsts.append({})
            self.indexed.append(0)
        tokens = np.full((rows, 1, copy), -1, dtype=np.int64)
        for b in range(rows):
            length, first = int(lengths[b]), self.indexed[b]
            firsts = self.firsts[b]
            new = history[b, first : length - 1].tolist()  # the tokens of the grams not indexed yet
            for i in range(len(new) - gamma + 1):  # grams ending before the newest token
                firsts.setdefault(tuple(new[i : i + gamma]), first + i)
            self.indexed[b] = max(first, length - gamma)
            start = firsts.get(tuple(history[b, length - gamma : length].tolist())) if length > gamma else None
            if start is not None:
                copied = history[b, start + gamma : min(start + gamma + copy, length)]
                tokens[b, 0, : len(copied)] = copied
        keys = np.broadcast_to(np.minimum(gamma + np.arange(copy), MAX_MATCH), (rows, 1, copy))
        return Chains(tokens, keys, np.ones((rows, 1)))

    def keep(self, rows: Sequence[int]) -> None:
        self.firsts = [self.firsts[i] for i in rows]
        self.indexed = [self.indexed[i] for i in rows]
