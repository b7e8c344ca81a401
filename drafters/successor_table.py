"""Token Recycling's successor table, shared by the rows of a batch and by successive generations, and
its part when every row is drafted at once (drafters.chains)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# P(accepted | parent accepted) by (table, rank), measured on development prompts (not the evaluation sets).
PRIORS = {("tok", 0): 0.3, ("tok", 1): 0.1, ("tok", 2): 0.05, ("ctx", 0): 0.45, ("ctx", 1): 0.1, ("ctx", 2): 0.05}
DEFAULT_PRIOR = 0.02  # the ranks PRIORS leaves out


class SuccessorTable:
    """Top-k successors seen after a token (`by_token`, [V, k]) and after a token pair (a hashed table
    of `max_pairs` slots, rounded up to a power of two: a newer pair overwrites an older one in its slot).

    Arrays on the host, -1 where nothing was seen; the token table grows with the largest id written.
    Rows of a batch and successive generations share one table (drafters.chains reads and writes it
    for all rows at once)."""

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
class SuccessorSource:
    """Token Recycling's part when every row is drafted at once (drafters.chains): its table; the
    builder proposes each node's successors by table and rank."""

    top_k: int
    table: SuccessorTable

    def priors(self) -> np.ndarray:
        """[2k]: the prior rate of each stats key, the token table's ranks then the pair table's."""
        return np.array([PRIORS.get((name, r), DEFAULT_PRIOR) for name in ("tok", "ctx") for r in range(self.top_k)])
