"""Token Recycling: reuse the target's own top-k candidates from earlier verify steps as drafts.

After every verify step the target's top-k next tokens at each tree node are kept as that token's
successors (the paper's adjacency matrix, warm-started from the prompt's prefill); the tree grows through
them, ranked by the measured acceptance rate of each rank. specpass also keys them by the node's last two
tokens, the sharper guess where one was seen (code repeats local patterns); both compete on their own
rates. The table is the drafter's memory across generations (`new_memory`: the paper's "hot start"); token
rows are bounded by the vocabulary, pair rows by `max_pairs` hashed slots, a newer pair overwriting an older.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .base import Drafter, check_params
from .contract import DraftSession, TargetForward
from .stats import AcceptanceStats
from .successor_table import DEFAULT_PRIOR, PRIORS, SuccessorSource, SuccessorTable
from .tree import DraftTree


@dataclass(frozen=True)
class TokenRecycling(Drafter):
    """top_k: the target's top next tokens kept as each token's successors; max_pairs: bound on the
    pair-keyed rows."""

    top_k: int = 8
    max_pairs: int = 1 << 16

    def __post_init__(self):
        check_params("TokenRecycling", top_k=self.top_k, max_pairs=self.max_pairs)

    @property
    def target_topk(self) -> int:
        """How many of the target's top next tokens per position this drafter reads: its top_k."""
        return self.top_k

    def new_memory(self) -> SuccessorTable:
        return SuccessorTable(self.max_pairs, self.top_k)

    def rows_source(self, memory: SuccessorTable | None = None) -> SuccessorSource:
        return SuccessorSource(self.top_k, memory if memory is not None else self.new_memory())

    def start(self, prompt: Sequence[int], prefill: TargetForward, memory=None, draft=None, seed=0) -> DraftSession:
        table = memory if memory is not None else self.new_memory()
        return TokenRecyclingSession(self, prompt, prefill.topk, table)


class TokenRecyclingSession(DraftSession):
    """One row's view of the table for the best-first builder (when combined with a drafter that has
    no rows source; drafters.chains drafts every row at once otherwise)."""

    def __init__(self, config: TokenRecycling, prompt: Sequence[int], prompt_topk: torch.Tensor, table: SuccessorTable):
        self.k = min(config.top_k, prompt_topk.shape[-1])
        self.stats = AcceptanceStats(PRIORS, default=DEFAULT_PRIOR)
        self.table = table
        self.token_keys = [("tok", r) for r in range(self.k)]  # the acceptance stats' key per rank
        self.pair_keys = [("ctx", r) for r in range(self.k)]
        table.write_prompt(prompt, prompt_topk)

    def successors(self, previous: int, token: int, rates: tuple[list[float], list[float]]) -> list[tuple]:
        """Candidates (bare Candidate tuples: this runs for every node of every tree) after `token`
        preceded by `previous`, keyed by (table, rank), with `rates` = (the token table's rate per rank,
        the pair table's); a candidate's state is `token`, the previous token of its own successors."""
        by_token, by_pair = rates
        table = self.table
        after = table.after_token(np.array(token)).tolist()[: self.k]
        pair = table.after_pair(np.array(previous), np.array(token)).tolist()[: self.k]
        out = [(t, by_token[r], self.token_keys[r], token) for r, t in enumerate(after) if t >= 0]
        return out + [(t, by_pair[r], self.pair_keys[r], token) for r, t in enumerate(pair) if t >= 0]

    def candidates(self, tokens: Sequence[int]):
        rates = [self.stats.rate(key) for key in self.token_keys], [self.stats.rate(key) for key in self.pair_keys]
        return _Successors(self, tokens[-2] if len(tokens) > 1 else -1, tokens[-1], rates)

    def observe(self, tree: DraftTree, verified: TargetForward, path: Sequence[int], tokens: Sequence[int]) -> None:
        root_previous = tokens[-2] if len(tokens) > 1 else -1  # tokens ends with the tree's root
        parents, node_tokens = tree.parents, tree.tokens
        previous = np.where(parents >= 0, node_tokens[np.maximum(parents, 0)], root_previous)
        self.table.write(previous, node_tokens, verified.topk[:, : self.k].numpy())


class _Successors:
    """One tree's view of the table; the acceptance rates are read once per tree (they change only
    when a verify step is observed)."""

    def __init__(self, session: TokenRecyclingSession, previous: int, root: int,
                 rates: tuple[list[float], list[float]]):
        self.session = session
        self.previous = previous
        self.root = root
        self.rates = rates

    def root_candidates(self) -> list[tuple]:
        return self.session.successors(self.previous, self.root, self.rates)

    def child_candidates(self, token: int, state) -> list[tuple]:
        return self.session.successors(state, token, self.rates)
