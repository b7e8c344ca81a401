"""Self-drafting: a greedy chain from the model's own layers (the EarlyExit or LayerSkip draft graph).

Each step, the session runs the draft graph once per chain node, one token at a time, in the node's
own tree slot: the root (the last committed token) at slot `committed`, its drafted child at
`committed + 1`, ... Every call writes that token's K/V of the layers below the exit into the shared
cache and returns the exit's logits (the next chain token: their argmax) and the residual stream
after the exit layer. The verify step then resumes from those states (`precomputed`), so layers
below the exit run once per token, not again in verification.

A chain of depth d costs d + 1 draft calls: the last one only computes the states of the last drafted
token, so the verify step can resume the whole chain. The chain is proposed with running acceptance
rates per depth; it needs the program's pipeline to hold `rewrites.EarlyExit` (the first layers and an
exit) or `rewrites.LayerSkip` (the step with layers left out, verified from the first one left out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpass.drafters.base import DraftModel, Drafter, DraftSession, check_params
from specpass.drafters.stats import AcceptanceStats
from specpass.drafters.tree import Candidate, DraftTree
from specpass.errors import InvalidParameterError
from specpass.ir.layout import SlotLayout

EARLY_EXIT_KIND = "early-exit"  # rewrites.EarlyExit's draft-graph kind
PRIOR = 0.3  # P(a drafted token is accepted | its parent was), before any outcome is seen


@dataclass(frozen=True)
class SelfDraft(Drafter):
    """depth: chain tokens drafted per step with the early-exit draft graph."""

    depth: int = 4

    def __post_init__(self):
        check_params("SelfDraft", depth=self.depth)

    def start(self, prompt: Sequence[int], prefill, memory=None, draft: DraftModel | None = None, seed=0) -> DraftSession:
        if draft is None or draft.spec.kind != EARLY_EXIT_KIND:
            raise InvalidParameterError("SelfDraft needs rewrites.EarlyExit or rewrites.LayerSkip in the pipeline "
                                        "(its draft graph)")
        return SelfDraftSession(self.depth, draft, prefill.hidden.device)


class SelfDraftSession(DraftSession):
    def __init__(self, depth: int, draft: DraftModel, device: torch.device):
        self.depth, self.draft, self.device = depth, draft, device
        self.one_node = torch.ones(1, 1, dtype=torch.bool, device=device)  # [1, 1]: a token sees itself
        self.cache_size = draft.config.cache_size
        self.stats = AcceptanceStats({}, default=PRIOR)  # keyed by depth in the chain
        self.chain: tuple[int, ...] = ()  # the last step's chain, root first
        self.states: torch.Tensor | None = None  # [len(chain), H]: each chain token's exit_hidden

    @torch.no_grad()
    def candidates(self, tokens: Sequence[int]) -> _Chain:
        committed = len(tokens) - 1  # every token but the root is in the cache
        depth = min(self.depth, self.cache_size - committed - 1)  # the chain's slots stay in the cache
        token, chain, states = tokens[-1], [tokens[-1]], []
        for i in range(depth + 1):
            layout = SlotLayout(committed + i, self.one_node)  # after the chain's i earlier tokens
            ids = torch.tensor([[token]], device=layout.device)
            logits, exit_hidden = self.draft(**layout.step_inputs(ids))  # [1, 1, V], [1, 1, H]
            states.append(exit_hidden[0, 0])
            if i < depth:
                token = int(logits[0, 0].argmax())
                chain.append(token)
        self.chain, self.states = tuple(chain), torch.stack(states)
        return _Chain(self.chain[1:], self.stats)

    def precomputed(self, tree: DraftTree) -> torch.Tensor | None:
        """[T, H] exit states of the tree's nodes when the tree is (a prefix of) this step's chain."""
        if self.states is None or not tree.is_chain() or tree.tokens != self.chain[: len(tree)]:
            return None
        return self.states[: len(tree)]


class _Chain:
    def __init__(self, chain: Sequence[int], stats: AcceptanceStats):
        self.chain, self.stats = chain, stats

    def root_candidates(self) -> list[Candidate]:
        return self.child_candidates(None, -1)

    def child_candidates(self, token, state) -> list[Candidate]:
        nxt = state + 1
        return [Candidate(self.chain[nxt], self.stats.rate(nxt), nxt, nxt)] if nxt < len(self.chain) else []
