"""The functions a captured step calls as single graph nodes (the capture never traces into them).

Rewrites and the verifier find them by target (`ir.query`): a sliding-window layer's mask is
`sliding_window_visibility(base mask, positions, window)` over the step's one shared mask, and a
soft-capped attention is `softcapped_attention(...)` and an attention with sinks `sink_attention(...)`
where other layers call SDPA; a layer's K and V go into the cache through `write_cache(cache, slots, new)`.
A sparse-attention rewrite (rewrites.sparse_attention) adds `select_slots(...)` and `selected_attention(...)`;
a prefill-pruning rewrite (rewrites.lazy_llm) restricts a layer's mask by `pruned_visibility(...)`.
"""

from __future__ import annotations

import torch


def sliding_window_visibility(mask: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """A sliding-window layer's mask: `mask` [B, 1, T, S] restricted to keys at index s > position - window
    (HF: a query at p sees keys at p - window < position <= p).

    Exact for every slot layout (`ir.layout`) whose committed slot s holds position s and whose step
    slots come after the committed ones, when a tree is shallower than the window: a step token's
    ancestors then lie within its window, and so does every step slot index."""
    key_slots = torch.arange(mask.shape[-1], device=positions.device)  # [S]
    inside = key_slots[None, None, :] > positions[:, :, None] - window  # [B, T, S]
    return mask & inside.unsqueeze(1)  # [B, 1, T, S]


def pruned_visibility(mask: torch.Tensor, pruned: torch.Tensor, stage: int) -> torch.Tensor:
    """A layer's mask with its stage's pruned slots hidden: `mask` [B, 1, T, S] bool, `pruned`
    [stages, B_max, S_max] bool (row `stage`: the slots whose tokens were pruned at this stage's pruning
    layer or an earlier one; they have no keys in this layer)."""
    batch, slots = mask.shape[0], mask.shape[-1]
    return mask & ~pruned[stage, :batch, None, None, :slots]  # [B, 1, T, S]


def softcapped_attention(q, k, v, attn_mask, scale: float, softcap: float):
    """Attention with soft-capped logits, `softcap * tanh(q k^T scale / softcap)`, as HF's eager
    attention computes it (Gemma 2). q [B, H, T, D], k/v [B, KV, S, D], attn_mask [B, 1, T, S] bool."""
    b, h, t, d = q.shape
    kv = k.shape[1]
    q = q.reshape(b, kv, h // kv, t, d)  # [B, KV, G, T, D]: each K/V head serves its group of query heads
    scores = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, KV, G, T, S]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~attn_mask.unsqueeze(1), float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (weights @ v.unsqueeze(2)).reshape(b, h, t, d)  # [B, H, T, D]


def sink_attention(q, k, v, attn_mask, scale: float, sinks):
    """Attention with a learned logit per head in the softmax's denominator (gpt-oss's sinks), as HF's
    eager attention computes it: softmax over [scores | sink], less the row's max, the sink's column
    dropped. q [B, H, T, D], k/v [B, KV, S, D], attn_mask [B, 1, T, S] bool, sinks [H]."""
    b, h, t, d = q.shape
    kv = k.shape[1]
    q = q.reshape(b, kv, h // kv, t, d)  # [B, KV, G, T, D]
    scores = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, KV, G, T, S]
    scores = scores.masked_fill(~attn_mask.unsqueeze(1), float("-inf"))
    sink = sinks.reshape(1, kv, h // kv, 1, 1).expand(b, -1, -1, t, 1).to(scores.dtype)  # [B, KV, G, T, 1]
    combined = torch.cat([scores, sink], dim=-1)  # [B, KV, G, T, S + 1]
    combined = combined - combined.amax(dim=-1, keepdim=True)
    weights = torch.softmax(combined, dim=-1)[..., :-1].to(v.dtype)  # [B, KV, G, T, S]
    return (weights @ v.unsqueeze(2)).reshape(b, h, t, d)  # [B, H, T, D]


def write_cache(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Write each row's new K or V into its own cache slots, in place, and return the rows the step runs.

    cache [B_max, KV, S_max, D] (one layer's buffer: rows are sequences), slots [B, T] int64 (row b's
    token t goes to slot slots[b, t]; rows lay out their tokens independently, ir.layout), new
    [B, KV, T, D] for the first B <= B_max rows. Returns cache[:B], the written rows [B, KV, S_max, D]
    (attention reads their first kv_len slots)."""
    index = slots[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])  # [B, KV, T, D]
    return cache[: new.shape[0]].scatter_(2, index, new)


def select_slots(q, k, attn_mask, scale: float, count: int, own_slots, vote: bool):
    """The `count` cache slots each query attends to in a sparse layer: its own slot (where the step
    wrote its key), then the visible slots of highest score; ascending, -1 first where fewer are visible.

    vote False (TidalDecode): each query head by its logits q k^T scale. vote True (TokenSelect): the
    heads of a token share one choice, by the sum over heads of each head's softmax over its visible
    slots. q [B, H, T, D], k [B, KV, S' >= S, D], attn_mask [B, 1, T, S] bool, own_slots [B, T] int64.
    Returns [B, H, T, count] int64. (The CPU kernel set runs backends.kernels.sparse_attention.)"""
    b, h, t, d = q.shape
    kv, s = k.shape[1], attn_mask.shape[-1]
    logits = torch.matmul(q.reshape(b, kv, (h // kv) * t, d), k[:, :, :s].transpose(-1, -2))  # [B, KV, G*T, S]
    scores = logits.view(b, h, t, s).float() * scale  # [B, H, T, S]
    if vote:
        weights = scores.masked_fill(~attn_mask, float("-inf")).softmax(-1).nan_to_num(0.0)
        scores = weights.sum(1, keepdim=True)  # [B, 1, T, S]
    own = own_slots[:, None, :, None].expand(b, scores.shape[1], t, 1)  # [B, H or 1, T, 1]
    scores = scores.scatter(-1, own, float("inf")).masked_fill(~attn_mask, float("-inf"))
    scores = torch.nn.functional.pad(scores, (0, count), value=float("-inf"))  # topk(count) for any S
    top = scores.topk(count, dim=-1)  # [B, H or 1, T, count]
    slots = top.indices.masked_fill(top.values == float("-inf"), -1).sort(-1).values
    return slots.expand(b, h, t, count).contiguous()


def selected_attention(q, k, v, attn_mask, scale: float, selected):
    """Attention over each query's selected slots only (`select_slots`): selected [B, H, T, C] int64
    (-1: none), q [B, H, T, D], k / v [B, KV, S' >= S, D], attn_mask [B, 1, T, S] bool; a slot also has
    to be visible. A query that sees none gets zeros. Returns [B, H, T, D] in q's dtype."""
    b, h, t, d = q.shape
    kv, c = k.shape[1], selected.shape[-1]
    taken = selected.clamp(min=0)  # [B, H, T, C]
    index = taken.reshape(b, kv, -1, 1).expand(-1, -1, -1, d)  # [B, KV, G*T*C, D]: head h reads KV head h // G
    keys = k.gather(2, index).view(b, h, t, c, d).float()
    values = v.gather(2, index).view(b, h, t, c, d).float()
    visible = (selected >= 0) & attn_mask.expand(b, h, t, -1).gather(-1, taken)  # [B, H, T, C]
    scores = (keys @ q.float()[..., None]).squeeze(-1) * scale  # [B, H, T, C]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    return (weights[..., None, :] @ values).squeeze(-2).to(q.dtype)  # [B, H, T, D]


GRAPH_FUNCTIONS = (sliding_window_visibility, softcapped_attention, sink_attention, write_cache)
