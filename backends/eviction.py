"""Running a KV-eviction pass's graphs (rewrites.kv_eviction) after each commit."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpass.ir.draft import EVICT_MODULE, OBSERVE_MODULE
from specpass.ir.layout import SlotLayout
from specpass.rewrites.kv_eviction import EVICTION_META, KVEviction


class Eviction:
    """The policy of an evicting step and its two graphs: `kv_observe` scores each commit's accepted
    tokens, `kv_evict` runs when they fill the cache."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.policy: KVEviction = gm.meta[EVICTION_META]
        self.observe = getattr(gm, OBSERVE_MODULE)
        self.evict = getattr(gm, EVICT_MODULE)
        self.device = gm.k_cache.device

    @classmethod
    def of(cls, gm: torch.fx.GraphModule) -> Eviction | None:
        return cls(gm) if EVICTION_META in gm.meta else None

    def reset(self) -> None:
        """Zero the policy's state (scores, window queries): a new sequence starts."""
        for name, buffer in self.evict.named_buffers():
            if name.startswith("kv_"):
                buffer.zero_()

    def after_commit(self, layout: SlotLayout, path: Sequence[int]) -> int:
        """Score the accepted `path` (already compacted into slots layout.committed, ...), evict when
        the cache is full; returns how many slots hold committed tokens now."""
        path = list(path)
        rows = torch.tensor(path, device=self.device)  # [n]
        positions = layout.positions()[path].to(self.device)  # [n]
        self.observe(rows, layout.committed, positions)
        committed = layout.committed + len(path)
        if committed < self.policy.budget:
            return committed
        self.evict()
        return self.policy.kept
