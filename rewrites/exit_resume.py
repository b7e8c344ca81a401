"""The runtime half of draft graphs that share the step's cache: drafting one cache row at a time
(rewrites.HiddenTransfer, and the self-drafts), and the self-drafts' resumed verify (rewrites.EarlyExit,
rewrites.LayerSkip).

A cache-sharing draft graph writes its tokens' K/V in their own slots of the step's cache. With several
rows it drafts one row after another, each in its own cache row (`drafting_row`: the draft graph's cache
buffers are that row's views while it drafts). A self-draft's draft graph runs each chain token's layers
below the exit (drafters.SelfDraft); when every row's tree is that chain, the verify step resumes from
the states the draft left (`resumed_forward`, the lowered resume graph), so those layers run once per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..ir.split import EXIT_HIDDEN
from ..passes.runtime import LoweredStep, RuntimeHook


class CacheRowDrafting(RuntimeHook):
    """A cache-sharing draft graph drafts in one cache row at a time."""

    def __init__(self, step: LoweredStep):
        self.draft = step.draft.gm if step.draft is not None else None  # owns references to the step's cache
        self.k_cache, self.v_cache = step.graph_module.k_cache, step.graph_module.v_cache  # [L, B, KV, S, D]

    @contextlib.contextmanager
    def drafting_row(self, row: int) -> Iterator[None]:
        """The draft graph's cache buffers are cache row `row`'s views [L, 1, KV, S, D] inside the block
        (ir.draft: the graph owns references to the step's cache tensors, so views of them write through)."""
        if self.draft is None or self.k_cache.shape[1] == 1:
            yield
            return
        self.draft.k_cache, self.draft.v_cache = self.k_cache[:, row : row + 1], self.v_cache[:, row : row + 1]
        try:
            yield
        finally:
            self.draft.k_cache, self.draft.v_cache = self.k_cache, self.v_cache


class ExitResume(CacheRowDrafting):
    """The lowered resume graph from a self-draft's exit states, and its draft graph in one cache row at a time."""

    def __init__(self, step: LoweredStep):
        super().__init__(step)
        self.resume = step.resume

    @torch.no_grad()
    def resumed_forward(self, layout, precomputed):
        """precomputed [B, T, H]: every node's states after the layers below the exit."""
        device = self.k_cache.device
        ids = torch.zeros(precomputed.shape[:2], dtype=torch.long, device=device)  # [B, T]: the resume graph reads none
        inputs = layout.to(device).step_inputs(ids) | {EXIT_HIDDEN: precomputed}
        logits, hidden = self.resume.run_graph(inputs)[:2]  # [B, T, V], [B, T, H]
        return logits, hidden
