"""The eviction graphs a KV-eviction pass adds beside the verify step: `kv_observe` scores the
accepted tokens, `kv_evict` keeps the budget. Both are plain torch modules traced into FX graphs
(`trace`), sharing the step's cache buffers and the policy's state buffers:

    k_cache, v_cache   [L, B, KV, budget, D]    the step's cache, cut to `budget` slots
    kv_queries         [L, B, H, R, D]          queries of the step's tokens (written by the verify step;
                                                R = chunk rounded up to a power of two, for padded replays)
    kv_scores          [L, B, KV, budget]       float32 per-slot scores (score-based policies)
    kv_window_queries  [L, B, H, window, D]     queries of the last `window` committed tokens (SnapKV)

`kv_observe(rows, first_slot, positions)` runs after the accepted path was compacted into slots
first_slot .. first_slot + n - 1: rows [n] are the path's node indices in the verified step (the
rows of kv_queries), positions [n] their rotary positions; each accepted token's attention over
the slots it saw updates the scores (the policy's `update`). Rejected nodes never reach it.

`kv_evict()` runs when the cache is full (committed == budget): per layer (and per KV head, where
the policy ranks per head) it keeps `budget - chunk` slots, the policy's protected slots and then
its highest priorities, gathers their K, V and scores into slots [0, kept) in sequence order, and
zeroes the rest of the scores.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from specpass.ir.draft import EVICT_MODULE, OBSERVE_MODULE
from specpass.ir.roles import Role, annotate
from specpass.rewrites.kv_eviction.scores import accepted_attention, gumbel_noise, keep_slots

QUERIES = "kv_queries"
SCORES = "kv_scores"
WINDOW_QUERIES = "kv_window_queries"


def record_queries(store: torch.Tensor, layer: int, q: torch.Tensor) -> torch.Tensor:
    """Inserted before each layer's attention by the pass: keep the step's queries for `kv_observe`.
    store [L, B, H, R, D], q [B, H, T, D] (T <= R); returns q, so the op is never dead code."""
    store[layer, :, :, : q.shape[2]].copy_(q)
    return q


class Observe(nn.Module):
    """kv_observe: fold the accepted tokens' attention into the policy's scores (module docstring)."""

    def __init__(self, policy, buffers: dict[str, torch.Tensor], scales: tuple[float, ...]):
        super().__init__()
        self.policy = policy  # the KVEviction pass (base.py imports this module)
        self.scales = scales  # each layer's softmax scale
        for name, buffer in buffers.items():
            self.register_buffer(name, buffer, persistent=False)

    def forward(self, rows: torch.Tensor, first_slot, positions: torch.Tensor):
        n = rows.shape[0]
        seen = first_slot + n  # slots [0, seen) hold the committed tokens, the accepted ones last
        for layer, scale in enumerate(self.scales):
            q = self.kv_queries[layer].index_select(2, rows)  # [B, H, n, D]
            if self.policy.window_queries:
                window = self.kv_window_queries[layer]  # [B, H, W, D]
                window.copy_(torch.cat((window, q), dim=2)[:, :, -window.shape[2] :])
            if not self.policy.scored:
                continue
            noise, temperature = None, 1.0
            if self.policy.gumbel:  # Keyformer
                noise, temperature = gumbel_noise(layer, q.shape[1], positions, seen), self.policy.temperature  # [1, H, n, S]
            keys = self.k_cache[layer, :, :, :seen]  # [B, KV, S, D]
            attention = accepted_attention(q, keys, first_slot, scale, noise, temperature)  # [B, KV, n, S]
            scores = self.kv_scores[layer, :, :, :seen]  # [B, KV, S]
            scores.copy_(self.policy.update(scores, attention))
        return rows


class Evict(nn.Module):
    """kv_evict: keep `kept` of the `budget` full slots in every layer (module docstring)."""

    def __init__(self, policy, buffers: dict[str, torch.Tensor], scales: tuple[float, ...]):
        super().__init__()
        self.policy = policy  # the KVEviction pass
        self.scales = scales
        for name, buffer in buffers.items():
            self.register_buffer(name, buffer, persistent=False)
        slots = policy.budget
        self.register_buffer("protected", policy.protected(slots), persistent=False)  # [budget] bool

    def forward(self):
        kept = self.policy.kept
        if self.policy.scored:
            priority = self.policy.priority(self.kv_scores)  # [L, B, KV, budget]
        elif self.policy.window_queries:
            priority = torch.stack([self._window_attention(layer) for layer in range(len(self.scales))])
        else:
            priority = torch.zeros(self.k_cache.shape[:4], device=self.k_cache.device)  # [L, B, KV, budget]
        keep = keep_slots(priority, kept, self.protected)  # [L, B, KV, kept]
        rows = keep[..., None].expand(-1, -1, -1, -1, self.k_cache.shape[-1])  # [L, B, KV, kept, D]
        self.k_cache[:, :, :, :kept].copy_(self.k_cache.gather(3, rows))
        self.v_cache[:, :, :, :kept].copy_(self.v_cache.gather(3, rows))
        if self.policy.scored:
            self.kv_scores[..., :kept].copy_(self.kv_scores.gather(3, keep))
            self.kv_scores[..., kept:].zero_()

    def _window_attention(self, layer: int) -> torch.Tensor:
        """SnapKV: the observation window's attention over the full cache, summed over the window and
        pooled over neighbouring slots. The window's tokens are the last W slots. -> [B, KV, budget]"""
        window = self.kv_window_queries[layer]  # [B, H, W, D]
        first = self.policy.budget - window.shape[2]
        attention = accepted_attention(window, self.k_cache[layer], first, self.scales[layer])  # [B, KV, W, S]
        return self.policy.pool(attention.sum(2))


class _BufferTracer(torch.fx.Tracer):
    proxy_buffer_attributes = True  # buffers become get_attr nodes (the step's tensors), never constants


def trace(module: nn.Module) -> torch.fx.GraphModule:
    """The module as an FX graph reading the module's own buffers (shared, not copied); every node
    annotated EVICTION."""
    graph = torch.fx.GraphModule(module, _BufferTracer().trace(module), class_name=type(module).__name__)
    for node in graph.graph.nodes:
        annotate(node, Role.EVICTION)
    return graph
