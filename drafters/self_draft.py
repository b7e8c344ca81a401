"""Self-drafting: a greedy chain from the model's own layers (the EarlyExit or LayerSkip draft graph).

Each step the session runs the draft graph once per chain node, one token at a time, in the node's own
tree slot (the root at `committed`, its child at `committed + 1`, ...): each call writes the token's K/V
of the layers below the exit and returns the exit's logits and `exit_hidden`. A chain of depth d costs
d + 1 calls (the last only computes the last token's states), so the verify step resumes the whole
chain from those states (`precomputed`) and the layers below the exit run once per token. With
`adaptive` the depth is chosen anew each step, 0 when self-drafting does not pay
(drafters.depth_control); without it every step drafts `depth` tokens. Needs rewrites.EarlyExit or
rewrites.LayerSkip in the program's pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import Drafter, check_params
from .contract import DraftModel, DraftSession, TargetForward
from .depth_control import DepthController
from .stats import AcceptanceStats
from .best_first import Candidate
from .tree import DraftTree
from ..common.errors import InvalidParameterError
from ..ir.draft import EARLY_EXIT_KIND
from ..ir.layout import SlotLayout

PRIOR = 0.3  # P(a drafted token is accepted | its parent was), before any outcome is seen (no measured agreement)

clock = time.perf_counter  # the adaptive controller's seconds (a test injects its own)


@dataclass(frozen=True)
class SelfDraft(Drafter):
    """depth: chain tokens drafted per step with the early-exit draft graph (with `adaptive`: at most
    that many, chosen each step, 0 when self-drafting does not pay)."""

    depth: int = 4
    adaptive: bool = False

    def __post_init__(self):
        check_params("SelfDraft", depth=self.depth)
        if not isinstance(self.adaptive, bool):
            raise InvalidParameterError(f"SelfDraft.adaptive must be a bool, got {self.adaptive!r}")

    def start(self, prompt: Sequence[int], prefill, memory=None, draft: DraftModel | None = None, seed=0) -> DraftSession:
        if draft is None or draft.spec.kind != EARLY_EXIT_KIND:
            raise InvalidParameterError("SelfDraft needs rewrites.EarlyExit or rewrites.LayerSkip in the pipeline "
                                        "(its draft graph)")
        return SelfDraftSession(self.depth, draft, prefill.hidden.device, self.adaptive)


class SelfDraftSession(DraftSession):
    skips = False  # its chain's lower layers and the depth controller's timings follow every step

    def __init__(self, depth: int, draft: DraftModel, device: torch.device, adaptive: bool = False):
        self.depth, self.draft, self.device = depth, draft, device
        self.controller = DepthController(depth) if adaptive else None
        self.step_started: float | None = None  # when the last step's candidates were asked for
        self.calls, self.call_seconds = 0, 0.0  # the last step's draft calls and their wall time
        self.emitted, self.from_chain, self.resumed = 0, 0, False  # what the last step's verify gave
        self.one_node = torch.ones(1, 1, dtype=torch.bool, device=device)  # [1, 1]: a token sees itself
        self.cache_size = draft.config.cache_size
        prior = draft.config.agreement or PRIOR  # an exit adapter's measured agreement (EarlyExitConfig)
        self.stats = AcceptanceStats({}, default=prior)  # keyed by depth in the chain
        self.chain: tuple[int, ...] = ()  # the last step's chain, root first
        self.states: torch.Tensor | None = None  # [len(chain), H]: each chain token's exit_hidden
        names = draft.spec.output_names  # with an exit adapter, logits over a draft vocabulary and its ids
        self.vocab_output = names.index("vocab") if "vocab" in names else None

    @torch.no_grad()
    def candidates(self, tokens: Sequence[int]) -> _Chain:
        now = clock()
        if self.controller is not None and self.step_started is not None:
            self.controller.measure(now - self.step_started, self.calls, self.call_seconds, self.emitted,
                                    self.from_chain, self.resumed)  # fmt: skip
        self.step_started, self.resumed = now, False
        committed = len(tokens) - 1  # every token but the root is in the cache
        depth = self.depth
        if self.controller is not None:
            depth = self.controller.choose([self.stats.rate(j) for j in range(self.depth)])
        depth = min(depth, self.cache_size - committed - 1)  # the chain's slots stay in the cache
        token, chain, states = tokens[-1], [tokens[-1]], []
        for i in range(depth + 1 if depth else 0):  # depth 0: self-drafting is off this step, no call at all
            layout = SlotLayout.tree(committed + i, self.one_node)  # after the chain's i earlier tokens
            ids = torch.tensor([[token]], device=layout.device)
            outputs = self.draft(**layout.step_inputs(ids))
            logits, exit_hidden = outputs[:2]  # [1, 1, V] (or [1, 1, D]: an adapter's), [1, 1, H]
            states.append(exit_hidden[0, 0])
            if i < depth:
                best = logits[0, 0].argmax()
                token = int(best if self.vocab_output is None else outputs[self.vocab_output][best])
                chain.append(token)
        self.calls, self.call_seconds = len(states), clock() - now
        self.chain, self.states = tuple(chain), torch.stack(states) if states else None
        return _Chain(self.chain[1:], self.stats)

    def precomputed(self, tree: DraftTree) -> torch.Tensor | None:
        """[T, H] exit states of the tree's nodes when the tree is (a prefix of) this step's chain."""
        if self.states is None or not tree.is_chain() or tuple(tree.tokens.tolist()) != self.chain[: len(tree)]:
            return None
        return self.states[: len(tree)]

    def observe(self, tree: DraftTree, verified: TargetForward, path: Sequence[int], tokens: Sequence[int]) -> None:
        """Keep what the step gave for the controller: tokens emitted, and how many the chain drafted."""
        accepted, drafted = tree.tokens[list(path[1:])].tolist(), self.chain[1:]
        from_chain = 0
        while from_chain < min(len(accepted), len(drafted)) and accepted[from_chain] == drafted[from_chain]:
            from_chain += 1
        self.emitted, self.from_chain, self.resumed = len(path), from_chain, verified.resumed


class _Chain:
    def __init__(self, chain: Sequence[int], stats: AcceptanceStats):
        self.chain, self.stats = chain, stats

    def root_candidates(self) -> list[Candidate]:
        return self.child_candidates(None, -1)

    def child_candidates(self, token, state) -> list[Candidate]:
        nxt = state + 1
        return [Candidate(self.chain[nxt], self.stats.rate(nxt), nxt, nxt)] if nxt < len(self.chain) else []
