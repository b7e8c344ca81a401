"""Token Recycling: reuse the target's own top-k candidates from earlier verify steps as drafts.

Each token keeps the top-k tokens the target predicted after its latest occurrence (an adjacency
matrix [V, k], warm-started from the prompt's prefill logits); the tree grows breadth-first through
that matrix, ranked by the measured acceptance rate of each candidate rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpass.drafters.base import Drafter, DraftSession, check_params
from specpass.drafters.stats import AcceptanceStats
from specpass.drafters.tree import DraftTree

_RANK_PRIORS = {0: 0.45, 1: 0.15, 2: 0.08, 3: 0.05, 4: 0.04, 5: 0.03, 6: 0.02, 7: 0.02}


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
        self.stats = AcceptanceStats(_RANK_PRIORS, default=0.01)
        self.successors: dict[int, list[int]] = {}
        for token, top in zip(prompt, prompt_topk[:, : self.k].tolist()):
            self.successors[token] = top

    def _candidates_after(self, token: int):
        return [(t, self.stats.rate(r), r, None) for r, t in enumerate(self.successors.get(token, ()))]

    def candidates(self, tokens: Sequence[int]):
        return _Adjacency(self, tokens[-1])

    def observe(self, tree: DraftTree, topk: torch.Tensor, path: Sequence[int], tokens: Sequence[int]) -> None:
        for token, top in zip(tree.tokens, topk[:, : self.k].tolist()):
            self.successors[token] = top


class _Adjacency:
    def __init__(self, session: TokenRecyclingSession, root: int):
        self.session = session
        self.root = root

    def root_candidates(self):
        return self.session._candidates_after(self.root)

    def child_candidates(self, token: int, state):
        return self.session._candidates_after(token)
