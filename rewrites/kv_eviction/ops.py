"""The eviction graphs a KV-eviction pass adds beside the verify step: plain torch modules traced into FX
(`trace`), sharing the step's cache (k_cache, v_cache [L, B, KV, budget, D]) and the policy's state:
kv_queries [L, B, H, R, D] (the step's queries, written by the verify step; R = chunk rounded up to a
power of two, for padded replays), kv_scores [L, B, KV, budget] (float32) and kv_window_queries
[L, B, H, window, D] (SnapKV). `kv_observe(rows, first_slot, positions)` runs after the accepted path
was compacted into slots first_slot ..: each accepted token's attention over the slots it saw updates
the scores (a gated policy's tokens bring their own log retention, recorded by `record_retention`
into kv_retention [L, B, KV, R], and their positions into kv_slot_positions [L, B, KV, budget]);
rejected nodes never reach it. `kv_evict()` runs when the cache is full: per layer (and KV
head, where the policy ranks per head) it keeps `budget - chunk` slots, the protected ones, then the
highest priorities, in sequence order in slots [0, kept), and zeroes the rest of the scores (a merging
policy, EMS, first folds the others into their nearest kept slot: scores.merged_into_kept). Their math
is pure functions (`observed`, `evicted`), which the graphs call and copy into the buffers and the ONNX
export exports as they are (rewrites.kv_eviction.export), so every lowering keeps the same slots.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from ...ir.draft import EVICT_MODULE, OBSERVE_MODULE
from ...ir.roles import Role, annotate
from .scores import accepted_attention, gumbel_noise, keep_slots, merged_into_kept

QUERIES = "kv_queries"
SCORES = "kv_scores"
WINDOW_QUERIES = "kv_window_queries"
RETENTION = "kv_retention"  # [L, B, KV, R] float32: the step's tokens' log retention (TrimKV)
SLOT_POSITIONS = "kv_slot_positions"  # [L, B, KV, budget] float32: each slot's token position (TrimKV)


def record_queries(store: torch.Tensor, layer: int, q: torch.Tensor) -> torch.Tensor:
    """Inserted before each layer's attention by the pass: keep the step's queries for `kv_observe`.
    store [L, rows, H, R, D], q [B, H, T, D] (B <= rows: the live rows first; T <= R); returns q, so
    the op is never dead code."""
    store[layer, : q.shape[0], :, : q.shape[2]].copy_(q)
    return q


def record_retention(store: torch.Tensor, layer: int, x: torch.Tensor, log_retention: torch.Tensor) -> torch.Tensor:
    """Inserted by a gated policy (TrimKV) at each layer's attention input: keep the step's tokens' log
    retention [B, T, KV] in store [L, rows, KV, R]; returns x [B, T, hidden], which the layer's query
    projection then reads (so the op is never dead code)."""
    store[layer, : x.shape[0], :, : x.shape[1]].copy_(log_retention.transpose(1, 2))
    return x


def retained(scores: torch.Tensor, slot_positions: torch.Tensor, retention: torch.Tensor, first_slot: int,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A gated policy's state after n accepted tokens: their log retention [L, B, KV, n] and positions
    [n] written to slots first_slot .. first_slot + n - 1 of scores and slot_positions [L, B, KV, S]."""
    slots = (torch.arange(retention.shape[-1], device=retention.device) + first_slot).expand_as(retention)
    placed = positions.to(slot_positions.dtype).expand_as(retention)  # [L, B, KV, n]
    return scores.scatter(3, slots, retention), slot_positions.scatter(3, slots, placed)


def observed(
    policy, scales: tuple[float, ...], queries: torch.Tensor, keys: torch.Tensor, scores: torch.Tensor | None,
    window: torch.Tensor | None, first_slot, positions: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """The policy's state after n accepted tokens, as a function (the in-place graph and the ONNX
    export both run it). queries [L, B, H, n, D]: the accepted tokens' queries; keys [L, B, KV, S, D]:
    the cache, the tokens themselves in slots first_slot .. first_slot + n - 1 (first_slot: an int or
    a 0-dim int64 tensor); scores [L, B, KV, S] (score-based policies; zero past the committed slots),
    window [L, B, H, W, D] (SnapKV), positions [n]. Slots past the committed ones are masked out of
    the attention, so they keep a zero score. Returns the new (scores, window)."""
    new_scores, new_window = [], []
    for layer, scale in enumerate(scales):
        q = queries[layer]  # [B, H, n, D]
        if window is not None:
            new_window.append(torch.cat((window[layer], q), dim=2)[:, :, -window.shape[3] :])  # the last W
        if scores is None:
            continue
        noise, temperature = None, 1.0
        if policy.gumbel:  # Keyformer
            noise, temperature = gumbel_noise(layer, q.shape[1], positions, keys.shape[3]), policy.temperature  # [1, H, n, S]
        attention = accepted_attention(q, keys[layer], first_slot, scale, noise, temperature)  # [B, KV, n, S]
        new_scores.append(policy.update(scores[layer], attention))  # [B, KV, S]
    return (torch.stack(new_scores) if scores is not None else None,
            torch.stack(new_window) if window is not None else None)  # fmt: skip


def evicted(
    policy, scales: tuple[float, ...], protected: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    scores: torch.Tensor | None, window: torch.Tensor | None, slot_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The full cache after an eviction, as a function. keys, values [L, B, KV, budget, D] (every slot
    committed), scores [L, B, KV, budget] or None, window [L, B, H, W, D] (SnapKV) or None, protected
    [budget] bool. Per layer and KV head the `kept` slots (protected first, then the policy's highest
    priorities) move to slots [0, kept) in sequence order; K/V past them are left as they were (the
    next tokens overwrite them), their scores are zeroed. slot_positions [L, B, KV, budget] (a gated
    policy) rank with the scores and move with them. Returns (keys, values, scores), and slot_positions
    where given."""
    kept = policy.kept
    local = None  # [L, B, KV, budget]: the observation window's attention (SnapKV, EMS)
    if window is not None:
        local = torch.stack([_window_attention(policy, window[layer], keys[layer], scale)
                             for layer, scale in enumerate(scales)])  # fmt: skip
    if scores is None and local is None:
        priority = torch.zeros(keys.shape[:4], device=keys.device)  # [L, B, KV, budget]: by position only
    else:
        priority = policy.priority(scores, slot_positions=slot_positions, local=local)  # [L, B, KV, budget]
    keep = keep_slots(priority, kept, protected)  # [L, B, KV, kept]
    if policy.merges:  # EMS: the slots not kept merge into their nearest kept slot or are dropped
        kept_keys, kept_values, kept_scores = merged_into_kept(keys, values, scores, priority, keep, policy.similarity)
    else:
        rows = keep[..., None].expand(-1, -1, -1, -1, keys.shape[-1])  # [L, B, KV, kept, D]
        kept_keys, kept_values = keys.gather(3, rows), values.gather(3, rows)
        kept_scores = scores.gather(3, keep) if scores is not None else None
    keys = torch.cat((kept_keys, keys[:, :, :, kept:]), dim=3)
    values = torch.cat((kept_values, values[:, :, :, kept:]), dim=3)
    if scores is not None:
        scores = torch.cat((kept_scores, torch.zeros_like(scores[..., kept:])), dim=3)
    if slot_positions is not None:
        slot_positions = torch.cat((slot_positions.gather(3, keep), torch.zeros_like(slot_positions[..., kept:])), dim=3)
        return keys, values, scores, slot_positions
    return keys, values, scores


def _window_attention(policy, window: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """SnapKV, EMS: one layer's observation-window attention over the full cache, summed over the
    window and smoothed by the policy's `pool`. window [B, H, W, D] (the last W slots' queries), keys
    [B, KV, budget, D] -> [B, KV, budget]"""
    first = policy.budget - window.shape[2]
    return policy.pool(accepted_attention(window, keys, first, scale).sum(2))  # [B, KV, W, S] summed


class Observe(nn.Module):
    """kv_observe: fold the accepted tokens' attention into the policy's scores (module docstring)."""

    def __init__(self, policy, buffers: dict[str, torch.Tensor], scales: tuple[float, ...]):
        super().__init__()
        self.policy = policy  # the KVEviction pass (base.py imports this module)
        self.scales = scales  # each layer's softmax scale
        for name, buffer in buffers.items():
            self.register_buffer(name, buffer, persistent=False)

    def forward(self, rows: torch.Tensor, first_slot, positions: torch.Tensor):
        if self.policy.gated:  # the scores are the tokens' own log retention: no attention to compute
            retention = self.kv_retention.index_select(3, rows)  # [L, B, KV, n]
            scores, slot_positions = retained(self.kv_scores, self.kv_slot_positions, retention, first_slot, positions)
            self.kv_scores.copy_(scores)
            self.kv_slot_positions.copy_(slot_positions)
            return rows
        queries = self.kv_queries.index_select(3, rows)  # [L, B, H, n, D]
        scores = self.kv_scores if self.policy.scored else None
        window = self.kv_window_queries if self.policy.window_queries else None
        scores, window = observed(self.policy, self.scales, queries, self.k_cache, scores, window, first_slot, positions)
        if scores is not None:
            self.kv_scores.copy_(scores)
        if window is not None:
            self.kv_window_queries.copy_(window)
        return rows


class Evict(nn.Module):
    """kv_evict: keep `kept` of the `budget` full slots in every layer (module docstring)."""

    def __init__(self, policy, buffers: dict[str, torch.Tensor], scales: tuple[float, ...]):
        super().__init__()
        self.policy = policy  # the KVEviction pass
        self.scales = scales
        for name, buffer in buffers.items():
            self.register_buffer(name, buffer, persistent=False)
        protected = policy.protected(policy.budget).to(buffers["k_cache"].device)  # [budget] bool, beside the cache
        self.register_buffer("protected", protected, persistent=False)

    def forward(self):
        scores = self.kv_scores if self.policy.scored else None
        window = self.kv_window_queries if self.policy.window_queries else None
        positions = self.kv_slot_positions if self.policy.gated else None
        keys, values, scores, *moved = evicted(self.policy, self.scales, self.protected, self.k_cache, self.v_cache,
                                               scores, window, positions)  # fmt: skip
        if moved:
            self.kv_slot_positions.copy_(moved[0])
        kept = self.policy.kept
        self.k_cache[:, :, :, :kept].copy_(keys[:, :, :, :kept])
        self.v_cache[:, :, :, :kept].copy_(values[:, :, :, :kept])
        if scores is not None:
            self.kv_scores.copy_(scores)


class _BufferTracer(torch.fx.Tracer):
    proxy_buffer_attributes = True  # buffers become get_attr nodes (the step's tensors), never constants


def trace(module: nn.Module) -> torch.fx.GraphModule:
    """The module as an FX graph reading the module's own buffers (shared, not copied); every node
    annotated EVICTION."""
    graph = torch.fx.GraphModule(module, _BufferTracer().trace(module), class_name=type(module).__name__)
    for node in graph.graph.nodes:
        annotate(node, Role.EVICTION)
    return graph
