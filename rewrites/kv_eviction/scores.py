"""The tensor math of KV eviction, as plain torch functions on one layer's tensors (tested against
brute-force references in tests/test_kv_eviction.py).

Shapes: B batch, H query heads, KV key/value heads (G = H / KV query heads read each), n accepted
tokens, S cache slots, D head dim. Query head h reads KV head h // G (HF's `repeat_kv` order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accepted_attention(
    q: torch.Tensor, keys: torch.Tensor, first_slot: int, scale: float, noise: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """The attention each accepted token paid to the cache, per KV head (mean over its G query heads).

    q [B, H, n, D]: the tokens' rotary-applied queries; keys [B, KV, S, D]: slots [0, S), the tokens
    themselves at slots first_slot .. first_slot + n - 1 (S = first_slot + n); token j sees slots
    <= first_slot + j, as it did when it was verified. noise [B, H, n, S] (Keyformer's Gumbel
    noise) is added to the logits before a softmax at `temperature`. Returns [B, KV, n, S] float32.
    """
    b, h, n, d = q.shape
    kv, s = keys.shape[1], keys.shape[2]
    logits = torch.matmul(q.reshape(b, kv, (h // kv) * n, d), keys.transpose(-1, -2))  # [B, KV, G*n, S]
    logits = logits.view(b, h, n, s).float() * scale  # [B, H, n, S]
    if noise is not None:
        logits = (logits + noise) / temperature
    visible = torch.arange(s, device=q.device)[None, :] <= first_slot + torch.arange(n, device=q.device)[:, None]
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)  # [B, H, n, S]
    return probs.view(b, kv, h // kv, n, s).mean(2)  # [B, KV, n, S]


def gumbel_noise(layer: int, heads: int, positions: torch.Tensor, slots: int) -> torch.Tensor:
    """Deterministic Gumbel(0, 1) noise [1, heads, n, slots] for the logits of the queries at
    `positions` [n] against cache slots [0, slots) of `layer`: a fixed integer hash of (layer, head,
    query position, slot), so that a run is reproducible and the same in every lowering."""
    head = torch.arange(heads, device=positions.device)[:, None, None]  # [H, 1, 1]
    slot = torch.arange(slots, device=positions.device)[None, None, :]  # [1, 1, S]
    key = ((layer * 131 + head) * 1_000_003 + positions[None, :, None]) * 1_000_033 + slot  # [H, n, S] int64
    key = key & 0xFFFFFFFF  # 32-bit steps below: the products stay inside int64
    key = (key ^ (key >> 17)) * 0x2C1B3C6D & 0xFFFFFFFF
    key = (key ^ (key >> 12)) * 0x297A2D39 & 0xFFFFFFFF
    key = key ^ (key >> 15)
    uniform = ((key & 0xFFFFFF).double() + 0.5) / 2**24  # (0, 1)
    return (-torch.log(-torch.log(uniform))).float()[None]  # [1, H, n, S]


def decayed_sum(scores: torch.Tensor, attention: torch.Tensor, decay: float) -> torch.Tensor:
    """A2SF: after each accepted token, scores <- decay * scores + its attention. scores [B, KV, S],
    attention [B, KV, n, S] in the tokens' order -> [B, KV, S]."""
    n = attention.shape[2]
    weights = decay ** torch.arange(n - 1, -1, -1, device=attention.device, dtype=torch.float64)  # [n]
    return scores * decay**n + (attention * weights.float()[:, None]).sum(2)


def keep_slots(priority: torch.Tensor, kept: int, protected: torch.Tensor) -> torch.Tensor:
    """The `kept` slots to keep, ascending (so kept tokens stay in sequence order): every protected
    slot, then the highest priorities. priority [..., S] float, protected [S] bool (at most `kept`
    of them) -> [..., kept] int64."""
    ranked = priority.masked_fill(protected, float("inf"))
    return ranked.topk(kept, dim=-1).indices.sort(-1).values


def pooled(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """SnapKV's smoothing: average over each slot's `kernel` neighbours. scores [B, KV, S] -> same."""
    b, kv, s = scores.shape
    return F.avg_pool1d(scores.reshape(b * kv, 1, s), kernel, stride=1, padding=kernel // 2,
                        count_include_pad=False).view(b, kv, s)  # fmt: skip


def merged_into_kept(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor,
    similarity: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """EMS's evict-then-merge. keys, values [L, B, KV, S, D]; scores, weights [L, B, KV, S] (weights > 0);
    keep [L, B, KV, K] ascending: the slots kept (K < S). Every other slot goes to a class: the kept
    slot whose key is nearest by cosine similarity of keys centred on their mean over the S slots
    (softmax attention is blind to a shift shared by every key), if that similarity is >= `similarity`,
    else the zero class (index K: dropped). A kept slot that receives slots becomes the
    `weights`-weighted mean of its members' keys and values, and its score their sum; one that receives
    none keeps its bits. Only the E = S - K slots not kept are compared with the kept ones (E x K
    similarities per head); one scatter over K + 1 classes does every layer and head at once. Returns
    keys, values [L, B, KV, K, D] and scores [L, B, KV, K]."""
    count, dim = keep.shape[-1], keys.shape[-1]
    is_kept = torch.zeros_like(scores, dtype=torch.bool).scatter(3, keep, True)  # [L, B, KV, S]
    others = (~is_kept).float().topk(keys.shape[3] - count, dim=-1).indices  # [L, B, KV, E]: the slots not kept
    slots = torch.cat((keep, others), dim=-1)  # [L, B, KV, S]: the kept first, in keep's order
    exact = keys.float()  # [L, B, KV, S, D]
    unit = F.normalize(exact - exact.mean(3, keepdim=True), dim=-1)  # [L, B, KV, S, D]: centred

    def spread(index: torch.Tensor) -> torch.Tensor:  # [L, B, KV, n] -> [L, B, KV, n, D]
        return index[..., None].expand(-1, -1, -1, -1, dim)

    nearest_similarity, nearest = (unit.gather(3, spread(others)) @ unit.gather(3, spread(keep)).transpose(-1, -2)).max(-1)
    joined = torch.where(nearest_similarity >= similarity, nearest, torch.full_like(nearest, count))  # [L, B, KV, E]
    classes = torch.cat((torch.arange(count, device=keep.device).expand_as(keep), joined), dim=-1)  # [L, B, KV, S] in [0, K]
    w = weights.float().gather(3, slots)  # [L, B, KV, S] in `slots` order
    empty = torch.zeros_like(w[..., : count + 1])  # [L, B, KV, K + 1]: K is the zero class
    members = empty.scatter_add(3, classes, torch.ones_like(w))[..., :count]
    mass = empty.scatter_add(3, classes, w)[..., :count, None]  # [L, B, KV, K, 1]
    merged = members > 1  # [L, B, KV, K]: the kept slots that received others

    def kept_or_mean(x: torch.Tensor) -> torch.Tensor:  # [L, B, KV, S, D] -> [L, B, KV, K, D]
        x = x.gather(3, spread(slots))  # in `slots` order: x[..., :K, :] are the kept slots'
        total = torch.zeros_like(unit[..., : count + 1, :]).scatter_add(3, spread(classes), w[..., None] * x.float())
        return torch.where(merged[..., None], (total[..., :count, :] / mass).to(x.dtype), x[..., :count, :])

    ordered_scores = scores.gather(3, slots)
    score_sums = empty.scatter_add(3, classes, ordered_scores.float())[..., :count].to(scores.dtype)
    return kept_or_mean(keys), kept_or_mean(values), torch.where(merged, score_sums, ordered_scores[..., :count])
