"""Running a KV-eviction pass's policy (rewrites.kv_eviction) after each commit: the accepted tokens
are scored, and the cache is evicted when they fill it. `GraphEviction` runs the step's own in-place
graphs (PyTorch lowerings); `backends.onnx_eviction.OrtEviction` runs the exported ones on ORT."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from specpass.ir.draft import EVICT_MODULE, OBSERVE_MODULE
from specpass.ir.layout import SlotLayout
from specpass.rewrites.kv_eviction import EVICTION_META, KVEviction


class Eviction(ABC):
    """A policy's state beside a cache: `observe` scores each commit's accepted tokens, `evict` keeps
    the policy's `kept` slots when the committed tokens fill the cache."""

    policy: KVEviction
    device: torch.device

    @abstractmethod
    def observe(self, rows: torch.Tensor, first_slot: int, positions: torch.Tensor) -> None:
        """Score the accepted tokens: rows [n] (their nodes in the verified step), now in slots
        first_slot .., at rotary positions [n]."""

    @abstractmethod
    def evict(self) -> None:
        """Keep `policy.kept` of the full cache's slots, in slots [0, kept)."""

    @abstractmethod
    def reset(self) -> None:
        """Zero the policy's state (scores, window queries): a new sequence starts."""

    def state_bytes(self) -> int:
        """Bytes of the policy's state tensors (scores, queries)."""
        return 0

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


class GraphEviction(Eviction):
    """The evicting step's own graphs `kv_observe` / `kv_evict`, in place on its buffers."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.policy = gm.meta[EVICTION_META]
        self._observe = getattr(gm, OBSERVE_MODULE)
        self._evict = getattr(gm, EVICT_MODULE)
        self.device = gm.k_cache.device

    @classmethod
    def of(cls, gm: torch.fx.GraphModule) -> GraphEviction | None:
        return cls(gm) if EVICTION_META in gm.meta else None

    def observe(self, rows: torch.Tensor, first_slot: int, positions: torch.Tensor) -> None:
        self._observe(rows, first_slot, positions)

    def evict(self) -> None:
        self._evict()

    def _state(self) -> list[torch.Tensor]:
        """The policy's state buffers (kv_scores, kv_queries, kv_window_queries), each once: a traced
        graph holds the buffers it reads, so both graphs are asked."""
        state = {}
        for graph in (self._observe, self._evict):
            state.update({name: buffer for name, buffer in graph.named_buffers() if name.startswith("kv_")})
        return list(state.values())

    def reset(self) -> None:
        for buffer in self._state():
            buffer.zero_()

    def state_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._state())
