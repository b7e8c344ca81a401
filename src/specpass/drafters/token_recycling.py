"""Token Recycling: reuse the target's own top-k candidates from earlier verify steps as drafts.

After every verify step the target's top-k next tokens at each tree node are kept as that token's
successors (the paper's adjacency matrix, warm-started from the prompt's prefill logits); the tree
grows best-first through those successors, ranked by the measured acceptance rate of each rank.

specpass keeps the successors twice: keyed by the node's token (the paper's matrix) and keyed by the
node's last two tokens. The two-token entry, when one was seen, is the sharper guess (code repeats
local patterns); both compete in the tree on their own measured acceptance rates.

The table is the drafter's memory across generations (`new_memory`): as in the paper, each query
inherits the table the previous queries left ("hot start"). The token-keyed rows are bounded by the
vocabulary; the pair-keyed rows by `max_pairs`, least recently written evicted first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpass.drafters.base import Drafter, DraftSession, TargetForward, check_params
from specpass.drafters.stats import AcceptanceStats
from specpass.drafters.tree import DraftTree

# P(accepted | parent accepted) by (table, rank), measured on development prompts (not the evaluation sets).
_PRIORS = {("tok", 0): 0.3, ("tok", 1): 0.1, ("tok", 2): 0.05, ("ctx", 0): 0.45, ("ctx", 1): 0.1, ("ctx", 2): 0.05}


class SuccessorTable:
    """Top-k successors seen after a token (`by_token`) and after a token pair (`by_pair`)."""

    def __init__(self, max_pairs: int):
        self.max_pairs = max_pairs
        self.by_token: dict[int, list[int]] = {}
        self.by_pair: dict[tuple[int, int], list[int]] = {}

    def write(self, previous: int, token: int, successors: list[int]) -> None:
        self.by_token[token] = successors
        self.by_pair.pop((previous, token), None)  # re-inserted last: dict order is write recency
        self.by_pair[previous, token] = successors
        if len(self.by_pair) > self.max_pairs:
            del self.by_pair[next(iter(self.by_pair))]

    def __len__(self) -> int:
        return len(self.by_token)


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
        return SuccessorTable(self.max_pairs)

    def start(self, prompt: Sequence[int], prefill: TargetForward, memory=None, draft=None, seed=0) -> DraftSession:
        table = memory if memory is not None else self.new_memory()
        return TokenRecyclingSession(self, prompt, prefill.topk, table)


class TokenRecyclingSession(DraftSession):
    def __init__(self, config: TokenRecycling, prompt: Sequence[int], prompt_topk: torch.Tensor, table: SuccessorTable):
        self.k = min(config.top_k, prompt_topk.shape[-1])
        self.stats = AcceptanceStats(_PRIORS, default=0.02)
        self.table = table
        self.token_keys = [("tok", r) for r in range(self.k)]  # the acceptance stats' key per rank
        self.pair_keys = [("ctx", r) for r in range(self.k)]
        previous = -1
        for token, top in zip(prompt, prompt_topk[:, : self.k].tolist()):
            table.write(previous, token, top)
            previous = token

    def successors(self, previous: int, token: int, rates: tuple[list[float], list[float]]) -> list[tuple]:
        """Candidates (bare Candidate tuples: this runs for every node of every tree) after `token`
        preceded by `previous`, keyed by (table, rank), with `rates` = (the token table's rate per rank,
        the pair table's); a candidate's state is `token`, the previous token of its own successors."""
        by_token, by_pair = rates
        out = [(t, by_token[r], self.token_keys[r], token) for r, t in enumerate(self.table.by_token.get(token, ()))]
        pair = self.table.by_pair.get((previous, token), ())
        out += [(t, by_pair[r], self.pair_keys[r], token) for r, t in enumerate(pair)]
        return out

    def candidates(self, tokens: Sequence[int]):
        rates = [self.stats.rate(key) for key in self.token_keys], [self.stats.rate(key) for key in self.pair_keys]
        return _Successors(self, tokens[-2] if len(tokens) > 1 else -1, tokens[-1], rates)

    def observe(self, tree: DraftTree, verified: TargetForward, path: Sequence[int], tokens: Sequence[int]) -> None:
        root_previous = tokens[-2] if len(tokens) > 1 else -1  # tokens ends with the tree's root
        for i, top in enumerate(verified.topk[:, : self.k].tolist()):
            parent = tree.parents[i]
            self.table.write(tree.tokens[parent] if parent >= 0 else root_previous, tree.tokens[i], top)


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
