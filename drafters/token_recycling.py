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

from .base import Drafter, DraftSession, TargetForward, check_params
from .stats import AcceptanceStats
from .tree import DraftTree

# P(accepted | parent accepted) by (table, rank), measured on development prompts (not the evaluation sets).
PRIORS = {("tok", 0): 0.3, ("tok", 1): 0.1, ("tok", 2): 0.05, ("ctx", 0): 0.45, ("ctx", 1): 0.1, ("ctx", 2): 0.05}
DEFAULT_PRIOR = 0.02  # the ranks PRIORS leaves out


class SuccessorTable:
    """Top-k successors seen after a token (`by_token`, [V, k]) and after a token pair (a hashed table
    of `max_pairs` slots, rounded up to a power of two: a newer pair overwrites an older one in its slot).

    Arrays on the host, -1 where nothing was seen; the token table grows with the largest id written.
    Rows of a batch and successive generations share one table (drafters.recycled_lookup reads and
    writes it for all rows at once)."""

    def __init__(self, max_pairs: int, k: int):
        self.k = k
        self.by_token = np.full((1024, k), -1, dtype=np.int64)  # [V, k]
        slots = 1 << max(int(max_pairs) - 1, 1).bit_length()
        self.pair_keys = np.full(slots, -1, dtype=np.int64)  # [P]: the pair each slot holds
        self.by_pair = np.full((slots, k), -1, dtype=np.int64)  # [P, k]

    def write(self, previous: np.ndarray, tokens: np.ndarray, successors: np.ndarray) -> None:
        """previous, tokens [n] int64, successors [n, <= k]: rows written in order (a later one wins)."""
        from . import kernels  # compiled on first use

        if tokens.size == 0:
            return
        self.reserve(int(tokens.max()))
        kernels.write_successors(self.by_token, self.pair_keys, self.by_pair, np.ascontiguousarray(previous, dtype=np.int64),
                                 np.ascontiguousarray(tokens, dtype=np.int64), np.ascontiguousarray(successors, dtype=np.int64))  # fmt: skip

    def reserve(self, token: int) -> None:
        """Grow the token table to hold a row for `token`."""
        if token >= self.by_token.shape[0]:
            grow = max(token + 1, 2 * self.by_token.shape[0]) - self.by_token.shape[0]
            self.by_token = np.concatenate([self.by_token, np.full((grow, self.k), -1, dtype=np.int64)])

    def after_token(self, tokens: np.ndarray) -> np.ndarray:
        """[..., k]: the successors seen after each token (-1 rows for unseen ones)."""
        inside = tokens < self.by_token.shape[0]
        return np.where(inside[..., None], self.by_token[np.where(inside, tokens, 0)], -1)

    def after_pair(self, previous: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """[..., k]: the successors seen after each (previous, token) pair (-1 rows for unseen ones)."""
        from . import kernels  # compiled on first use

        previous, tokens = np.broadcast_arrays(np.asarray(previous, dtype=np.int64), np.asarray(tokens, dtype=np.int64))
        rows = kernels.pair_rows(self.pair_keys, self.by_pair, previous.ravel().copy(), tokens.ravel().copy())
        return rows.reshape(*tokens.shape, self.k)

    def write_prompt(self, prompt: Sequence[int], topk: torch.Tensor) -> None:
        """A prompt's tokens with the target's top next tokens after each, topk [P, >= k] (host)."""
        tokens = np.asarray(prompt, dtype=np.int64)
        previous = np.concatenate([[-1], tokens[:-1]])
        self.write(previous, tokens, topk[:, : self.k].numpy())

    def __len__(self) -> int:
        """Tokens with successors."""
        return int((self.by_token[:, 0] >= 0).sum())


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

    def start(self, prompt: Sequence[int], prefill: TargetForward, memory=None, draft=None, seed=0) -> DraftSession:
        table = memory if memory is not None else self.new_memory()
        return TokenRecyclingSession(self, prompt, prefill.topk, table)


class TokenRecyclingSession(DraftSession):
    """One row's view of the table for the best-first builder (when combined with a drafter that has
    no array form; drafters.recycled_lookup drafts every row at once otherwise)."""

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
        parents = np.asarray(tree.parents)
        node_tokens = np.asarray(tree.tokens)
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
