"""Token Recycling: reuse the target's own top-k candidates from earlier verify steps as drafts.

After every verify step the target's top-k next tokens at each tree node are kept as that token's
successors (the paper's adjacency matrix, warm-started from the prompt's prefill logits); the tree
grows best-first through those successors, ranked by the measured acceptance rate of each rank.

specpass keeps the successors twice: keyed by the node's token (the paper's matrix) and keyed by the
node's last two tokens. The two-token entry, when one was seen, is the sharper guess (code repeats
local patterns); both compete in the tree on their own measured acceptance rates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpass.drafters.base import Drafter, DraftSession, check_params
from specpass.drafters.stats import AcceptanceStats
from specpass.drafters.tree import DraftTree

_PRIORS = {("tok", 0): 0.35, ("tok", 1): 0.12, ("tok", 2): 0.06, ("ctx", 0): 0.5, ("ctx", 1): 0.12, ("ctx", 2): 0.06}


@dataclass(frozen=True)
class TokenRecycling(Drafter):
    top_k: int = 8

    def __post_init__(self):
        check_params("TokenRecycling", top_k=self.top_k)

    def start(self, prompt: Sequence[int], prompt_topk: torch.Tensor) -> DraftSession:
        return TokenRecyclingSession(self, prompt, prompt_topk)


class TokenRecyclingSession(DraftSession):
    def __init__(self, config: TokenRecycling, prompt: Sequence[int], prompt_topk: torch.Tensor):
        self.k = min(config.top_k, prompt_topk.shape[-1])
        self.stats = AcceptanceStats(_PRIORS, default=0.02)
        self.by_token: dict[int, list[int]] = {}
        self.by_pair: dict[tuple[int, int], list[int]] = {}
        previous = -1
        for token, top in zip(prompt, prompt_topk[:, : self.k].tolist()):
            self.by_token[token] = top
            self.by_pair[previous, token] = top
            previous = token

    def successors(self, previous: int, token: int):
        """(token, probability, stats key, state) candidates after `token` preceded by `previous`."""
        out = [(t, self.stats.rate(("tok", r)), ("tok", r), token) for r, t in enumerate(self.by_token.get(token, ()))]
        pair = self.by_pair.get((previous, token), ())
        out += [(t, self.stats.rate(("ctx", r)), ("ctx", r), token) for r, t in enumerate(pair)]
        return out

    def candidates(self, tokens: Sequence[int]):
        return _Successors(self, tokens[-2] if len(tokens) > 1 else -1, tokens[-1])

    def observe(self, tree: DraftTree, topk: torch.Tensor, path: Sequence[int], tokens: Sequence[int]) -> None:
        root_previous = tokens[-2] if len(tokens) > 1 else -1  # tokens ends with the tree's root
        for i, top in enumerate(topk[:, : self.k].tolist()):
            token, parent = tree.tokens[i], tree.parents[i]
            self.by_token[token] = top
            self.by_pair[tree.tokens[parent] if parent >= 0 else root_previous, token] = top


class _Successors:
    def __init__(self, session: TokenRecyclingSession, previous: int, root: int):
        self.session = session
        self.previous = previous
        self.root = root

    def root_candidates(self):
        return self.session.successors(self.previous, self.root)

    def child_candidates(self, token: int, state):
        return self.session.successors(state, token)
