"""Sparse attention's two ops (ir.ops `select_slots`, `selected_attention`) whose result for a query
does not depend on the rest of the call (CPU, numba), like backends.kernels.attention.

For query (b, h, t): score_s = sum over d of (q[d] * scale) * k_s[d], d in order; a selection is the
own slot, then the highest scores (ties: the lower slot), ascending; attention over the selected
visible slots is e_i = `_exp`(score_i - max), summed and weighted in slot order. Over every visible
slot that is the ordered attention's arithmetic, step for step: with all of them selected, a sparse
layer gives the bits of a full one. Each query is one job (its keys gathered for it alone): other
queries, rows, T and the thread count change no bit.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import prange

from .attention import KEY_BLOCK, _exp, _named, numba_threads

_NONE = np.int64(-1)


@numba.njit(cache=True, boundscheck=False)
def _scores_of(q, keys, order, scale, block, out):
    """out[i] = sum over d in order of (q[d] * scale) * keys[order[i], d], for the slots in `order`:
    64 slots at a time, copied into block [D, 64] (transposed), so the sums run side by side in lanes,
    each in d order (the ordered attention's score, bit for bit). q [D], keys [S', D]."""
    n, dim = order.shape[0], q.shape[0]
    acc = np.empty(KEY_BLOCK, np.float32)
    for i0 in range(0, n, KEY_BLOCK):
        width = min(KEY_BLOCK, n - i0)
        for j in range(width):
            key = keys[order[i0 + j]]
            for d in range(dim):
                block[d, j] = key[d]
        for j in range(KEY_BLOCK):
            acc[j] = 0.0
        for d in range(dim):
            qd = q[d] * scale
            row = block[d]
            for j in range(KEY_BLOCK):
                acc[j] += qd * row[j]
        for j in range(width):
            out[i0 + j] = acc[j]


@numba.njit(cache=True, boundscheck=False)
def _exponentiate(scores):
    """scores[i] <- `_exp`(scores[i] - their max), in place; returns their sum, in order."""
    top = np.float32(-np.inf)
    for i in range(scores.shape[0]):
        top = max(top, scores[i])
    total = np.float32(0.0)
    for i in range(scores.shape[0]):
        scores[i] = _exp(scores[i] - top)
        total += scores[i]
    return total


@numba.njit(cache=True, boundscheck=False)
def _top(scores, order, count, own, out):
    """out [count] = the own slot (if in `order`) and the slots of `order` (ascending) with the highest
    `scores` (aligned with `order`; ties: the lower slot), ascending, -1 first where fewer than count."""
    n = order.shape[0]
    chosen = np.zeros(n, np.bool_)
    rest = np.empty(n, np.float32)  # the other slots' scores
    m = 0
    for i in range(n):
        if order[i] == own:
            chosen[i] = True
        else:
            rest[m] = scores[i]
            m += 1
    want = min(count - (n - m), m)
    if want > 0:
        threshold = np.partition(rest[:m], m - want)[m - want]  # the want-th highest
        taken = 0
        for i in range(n):
            if order[i] != own and scores[i] > threshold:
                chosen[i] = True
                taken += 1
        for i in range(n):  # ties at the threshold: the lower slots
            if taken < want and order[i] != own and scores[i] == threshold:
                chosen[i] = True
                taken += 1
    picked = 0
    for i in range(n):
        picked += chosen[i]
    j = count - picked
    for i in range(j):
        out[i] = _NONE
    for i in range(n):
        if chosen[i]:
            out[j] = order[i]
            j += 1


def _select(q, keys, visible, own_slots, scale, vote, out):
    """q [B, H, T, D], keys [B, KV, S', D], visible [B, 1, T, S], own_slots [B, T] -> out [B, H, T, C]."""
    batch, heads, tokens, _ = q.shape
    kv_heads, slots, count = keys.shape[1], visible.shape[3], out.shape[3]
    group = heads // kv_heads
    jobs = batch * tokens * (1 if vote else heads)
    for job in prange(jobs):
        if vote:
            b, t, first, last = job // tokens, job % tokens, 0, heads
        else:
            b, t = job // (tokens * heads), (job // heads) % tokens
            first = job % heads
            last = first + 1
        order = np.empty(slots, np.int64)
        n = 0
        for s in range(slots):
            if visible[b, 0, t, s]:
                order[n] = s
                n += 1
        scores = np.zeros(n, np.float32)  # the visible slots', in `order`
        row = np.empty(n, np.float32)
        block = np.zeros((q.shape[3], KEY_BLOCK), np.float32)
        for h in range(first, last):
            _scores_of(q[b, h, t], keys[b, h // group], order[:n], scale, block, scores if not vote else row)
            if vote:  # each head's softmax, summed over the heads in order
                total = _exponentiate(row)
                for i in range(n):
                    scores[i] += row[i] / total
        _top(scores, order[:n], count, own_slots[b, t], out[b, first, t])
        for h in range(first + 1, heads if vote else last):
            out[b, h, t] = out[b, first, t]


def _attend_selected(q, keys, values, visible, selected, scale, out):
    """q [B, H, T, D], keys / values [B, KV, S', D], visible [B, 1, T, S], selected [B, H, T, C] ->
    out [B, H, T, D]."""
    batch, heads, tokens, dim = q.shape
    group, count, slots = heads // keys.shape[1], selected.shape[3], visible.shape[3]
    for job in prange(batch * heads * tokens):
        b, h, t = job // (heads * tokens), (job // tokens) % heads, job % tokens
        kv = h // group
        order = np.empty(count, np.int64)
        scores = np.empty(count, np.float32)
        block = np.zeros((dim, KEY_BLOCK), np.float32)
        n = 0
        for i in range(count):
            s = selected[b, h, t, i]
            if s >= 0 and s < slots and visible[b, 0, t, s]:
                order[n] = s
                n += 1
        _scores_of(q[b, h, t], keys[b, kv], order[:n], scale, block, scores)
        total = _exponentiate(scores[:n])
        acc = np.zeros(dim, np.float32)
        for i in range(n):
            w = scores[i]
            value = values[b, kv, order[i]]
            for d in range(dim):
                acc[d] += w * value[d]
        for d in range(dim):
            out[b, h, t, d] = acc[d] / total if n > 0 else np.float32(0.0)


_select_parallel = numba.njit(cache=True, parallel=True, boundscheck=False)(_named(_select, "_select_parallel"))
_select_serial = numba.njit(cache=True, boundscheck=False)(_named(_select, "_select_serial"))
_attend_parallel = numba.njit(cache=True, parallel=True, boundscheck=False)(_named(_attend_selected, "_attend_selected_parallel"))
_attend_serial = numba.njit(cache=True, boundscheck=False)(_named(_attend_selected, "_attend_selected_serial"))


def _float32(q: torch.Tensor, *cache: torch.Tensor, slots: int) -> list[np.ndarray]:
    """q and the cache rows as float32 arrays; another dtype converts only the `slots` attended slots."""
    if q.dtype != torch.float32:
        cache = tuple(x[:, :, :slots] for x in cache)
    return [x.detach().float().contiguous().numpy() for x in (q, *cache)]


def select_slots(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float, count: int,
                 own_slots: torch.Tensor, vote: bool) -> torch.Tensor:  # fmt: skip
    """ir.ops.select_slots in the module docstring's arithmetic: [B, H, T, count] int64."""
    out = torch.empty((*q.shape[:3], count), dtype=torch.int64)
    q_, keys_ = _float32(q, keys, slots=mask.shape[-1])
    select = _select_parallel if numba_threads(q.numel() * mask.shape[-1]) > 1 else _select_serial
    select(q_, keys_, mask.detach().contiguous().numpy(), own_slots.detach().contiguous().numpy(),
            np.float32(scale), vote, out.numpy())  # fmt: skip
    return out


def selected_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                       selected: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """ir.ops.selected_attention in the module docstring's arithmetic: [B, H, T, D] in q's dtype."""
    out = torch.empty(q.shape, dtype=torch.float32)
    q_, keys_, values_ = _float32(q, keys, values, slots=mask.shape[-1])
    attend = _attend_parallel if numba_threads(q.numel() * selected.shape[-1]) > 1 else _attend_serial
    attend(q_, keys_, values_, mask.detach().contiguous().numpy(), selected.detach().contiguous().numpy(),
                     np.float32(scale), out.numpy())  # fmt: skip
    return out if q.dtype == torch.float32 else out.to(q.dtype)
