"""A KV-eviction pass's runtime half: after each commit every row's accepted tokens are scored, and a
row's cache is evicted when its tokens fill it; each row has its own budget and its own policy state,
so a row's tokens are the tokens that sequence has alone under the same policy. `GraphEviction` runs
the step's own in-place graphs (PyTorch lowerings) on one row at a time (views of the row's cache and
state); `onnx_runtime.OrtEviction` runs the exported graphs on ORT, for a batch row by row (they are
exported for one row: each row's slices are copied to contiguous tensors and back)."""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Iterator, Sequence

import torch

from ...ir.draft import EVICT_MODULE, OBSERVE_MODULE
from ...ir.layout import SlotLayout
from ...passes.runtime import RuntimeHook
from .ops import QUERIES, RETENTION, SCORES, SLOT_POSITIONS, WINDOW_QUERIES

PER_ROW = ("k_cache", "v_cache", SCORES, QUERIES, WINDOW_QUERIES, RETENTION, SLOT_POSITIONS)  # a row axis (axis 1)
KEPT_ACROSS_STEPS = (SCORES, WINDOW_QUERIES, SLOT_POSITIONS)  # per-row state that must follow its row in keep_rows


class Eviction(RuntimeHook):
    """A policy's state beside a cache: `observe` scores each commit's accepted tokens, `evict` keeps
    the policy's `kept` slots of a row when the row's committed tokens fill its cache."""

    policy: object  # the KVEviction pass (rewrites.kv_eviction.base): budget, chunk, kept
    device: torch.device

    @property
    def max_step(self) -> int:
        """No step takes more tokens than an eviction frees (the policy's chunk)."""
        return self.policy.chunk

    @property
    def fixed_cache(self) -> int:
        """A sequence's cache is the policy's budget."""
        return self.policy.budget

    def __str__(self) -> str:
        return f"evicts its KV cache to {self.policy.budget} slots ({self.policy.name})"

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

    def new_sequence(self) -> None:
        self.reset()

    def row(self, b: int) -> contextlib.AbstractContextManager:
        """Inside the block, `observe` and `evict` act on row b alone (one-row programs: a no-op)."""
        return contextlib.nullcontext()

    def after_commit(self, layout: SlotLayout, paths: Sequence[Sequence[int]], committed: list[int]) -> list[int]:
        """Score each row's accepted path (already compacted into slots committed_b, ...), evict the
        rows whose cache is full."""
        committed = list(committed)
        positions = layout.positions()  # [B, T]
        for b, path in enumerate(paths):
            if not path:  # a row with nothing committed this step (a prefill padding row)
                continue
            nodes = torch.tensor(list(path), device=self.device)  # [n]
            with self.row(b):
                self.observe(nodes, layout.committed[b], positions[b, list(path)].to(self.device))
                if committed[b] >= self.policy.budget:
                    self.evict()
                    committed[b] = self.policy.kept
        return committed


class GraphEviction(Eviction):
    """The evicting step's own graphs `kv_observe` / `kv_evict`, in place on its buffers."""

    def __init__(self, gm: torch.fx.GraphModule, policy):
        self.policy = policy
        self._observe = getattr(gm, OBSERVE_MODULE)
        self._evict = getattr(gm, EVICT_MODULE)
        self.device = gm.k_cache.device
        self.rows = gm.k_cache.shape[1]

    @contextlib.contextmanager
    def row(self, b: int) -> Iterator[None]:
        """Both graphs read and write views of row b of their buffers inside the block (views write
        through: the graphs own references to the step's tensors)."""
        if self.rows == 1:
            yield
            return
        swapped = []
        for graph in (self._observe, self._evict):
            for name in PER_ROW:
                full = graph._buffers.get(name)
                if full is not None:
                    swapped.append((graph, name, full))
                    graph._buffers[name] = full[:, b : b + 1]
        try:
            yield
        finally:
            for graph, name, full in swapped:
                graph._buffers[name] = full

    def keep_rows(self, keep: Sequence[int]) -> None:
        moved = [(src, dst) for dst, src in enumerate(keep) if src != dst]
        if not moved:
            return
        src = torch.tensor([s for s, _ in moved], device=self.device)
        dst = torch.tensor([d for _, d in moved], device=self.device)
        state = {name: graph._buffers[name] for graph in (self._observe, self._evict)
                 for name in KEPT_ACROSS_STEPS if graph._buffers.get(name) is not None}  # fmt: skip
        for buffer in state.values():
            buffer[:, dst] = buffer[:, src]

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
