"""Attention whose result for a query does not depend on the rest of the call (CPU, numba).

Speculation is exact by construction only when a token's logits are one function of its own visible
keys; SDPA splits its reductions by the call's shape (docs/design.md, "Lossless by construction"). For
query (b, h, t), over its visible slots s_0 < s_1 < ... (its mask row, in slot order):

    score_i = sum over d of (q[d] * scale) * k_i[d], d in order     (soft-capped through `_tanh`)
    out     = (sum over i of e_i * v_i) / (sum over i of e_i),      e_i = `_exp`(score_i - max score)

Each step rounds as written (numba emits no fused multiply-add without fastmath); `_exp` is float32
arithmetic, the same in every lane. Hidden slots are skipped: other queries, rows, padding, T, the
attended length and the thread count (a query is one thread's) change no bit.
"""

from __future__ import annotations

import os
import threading
import types as types_module

import numba
import numpy as np
import torch
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

KEY_BLOCK = 64  # keys per score block
QUERY_BLOCK = 4  # queries per score block
DIM_BLOCK = 64  # value dims per accumulation pass
SERIAL_WORK = 1 << 14  # calls of fewer query-dims x slots run on the calling thread
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # ln 2 in two parts: n * _LN2_HI is exact for |n| < 2**9
_LN2_LO = np.float32(1.428606765330187e-06)
_FLOOR = np.float32(-87.0)  # exp arguments are clamped here (e**-87 ~ 1.6e-38, the normal range)


def _stack_array(size: int):
    """An intrinsic returning a float32 scratch array of `size` elements on the stack: LLVM keeps it in
    registers when its indices are constants after unrolling, where a heap array goes through memory."""

    @intrinsic
    def stack(typingctx):
        def codegen(context, builder, signature, args):
            return cgutils.alloca_once(builder, context.get_value_type(types.float32),
                                       size=context.get_constant(types.intp, size))  # fmt: skip

        return types.CPointer(types.float32)(), codegen

    return stack


@intrinsic
def _as_float32(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits`."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.int32), codegen


_score_tile = _stack_array(QUERY_BLOCK * KEY_BLOCK)
_sum_tile = _stack_array(QUERY_BLOCK * DIM_BLOCK)


@numba.njit(cache=True, inline="always")
def _exp(x):
    """e**x for x <= 0 in float32 arithmetic only (no library call, so a vectorised lane and a scalar
    one round alike): x = n ln2 + r, |r| <= ln2 / 2, e**r by its degree-6 Taylor polynomial (within
    2 ulp), times 2**n built from its bits."""
    x = min(max(x, _FLOOR), np.float32(0.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.0 / 720.0)
    p = np.float32(1.0 / 120.0) + r * p
    p = np.float32(1.0 / 24.0) + r * p
    p = np.float32(1.0 / 6.0) + r * p
    p = np.float32(0.5) + r * p
    p = np.float32(1.0) + r * p
    p = np.float32(1.0) + r * p
    return p * _as_float32(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))


@numba.njit(cache=True, inline="always")
def _tanh(y):
    """tanh(y) = sign(y) (1 - e) / (1 + e), e = e**(-2|y|), through `_exp`."""
    e = _exp(np.float32(-2.0) * abs(y))
    t = (np.float32(1.0) - e) / (np.float32(1.0) + e)
    return t if y >= 0 else -t


@numba.njit(cache=True, boundscheck=False)
def _score_tile_of(queries, block, scores):
    """scores [QUERY_BLOCK, KEY_BLOCK] = queries [QUERY_BLOCK, D] times block [D, KEY_BLOCK], each score
    summed over d in order, the tile's accumulators in registers."""
    acc = numba.carray(_score_tile(), (QUERY_BLOCK, KEY_BLOCK))
    for x in range(QUERY_BLOCK):
        for j in range(KEY_BLOCK):
            acc[x, j] = 0.0
    for d in range(block.shape[0]):
        row = block[d]
        for x in range(QUERY_BLOCK):
            qd = queries[x, d]
            for j in range(KEY_BLOCK):
                acc[x, j] += qd * row[j]
    for x in range(QUERY_BLOCK):
        for j in range(KEY_BLOCK):
            scores[x, j] = acc[x, j]


def _attend(q, keys, values, visible, scale, softcap, sinks, threads, out):
    """q [B, H, T, D] f32; keys / values [B, KV, S', D] f32 C-contiguous, S' >= S;
    visible [B, 1, T, S] bool C-contiguous; out [B, H, T, D] f32. softcap <= 0: none. sinks [H] f32 or
    [0]: none. threads: how many run the parallel loops (it sizes the jobs).

    Two passes, each parallel over independent work: the scores of every query of a KV head by blocks
    of 64 keys, then each query's softmax and weighted sum of values."""
    batch, heads, tokens, dim = q.shape
    kv_heads, slots = keys.shape[1], visible.shape[3]
    group = heads // kv_heads
    n_queries = tokens * group  # a KV head's queries: query i is head kv * group + i % group, token i // group
    padded = (n_queries + QUERY_BLOCK - 1) // QUERY_BLOCK * QUERY_BLOCK
    key_blocks = (slots + KEY_BLOCK - 1) // KEY_BLOCK
    last_seen = np.full((batch, tokens), -1, np.int64)  # each query's last visible slot (-1: none)
    for job in prange(batch * tokens):
        b, t = job // tokens, job % tokens
        seen = visible[b, 0, t]
        for s in range(slots - 1, -1, -1):
            if seen[s]:
                last_seen[b, t] = s
                break
    scores = np.empty((batch, kv_heads, padded, slots), np.float32)
    spans = min(key_blocks, max(1, -(-4 * threads // (batch * kv_heads))))  # about 4 jobs a thread
    per_span = -(-key_blocks // spans)
    for job in prange(batch * kv_heads * spans):
        b, kv, span = job // (kv_heads * spans), (job // spans) % kv_heads, job % spans
        scaled = np.zeros((padded, dim), np.float32)
        for i in range(n_queries):
            row = q[b, kv * group + i % group, i // group]
            for d in range(dim):
                scaled[i, d] = row[d] * scale
        block = np.empty((dim, KEY_BLOCK), np.float32)  # keys s0 .. s0 + 63, transposed
        tile = np.empty((QUERY_BLOCK, KEY_BLOCK), np.float32)
        for s0 in range(span * per_span * KEY_BLOCK, min(slots, (span + 1) * per_span * KEY_BLOCK), KEY_BLOCK):
            width = min(KEY_BLOCK, slots - s0)  # past the last block's keys: stale columns, their scores unused
            for j in range(width):
                key = keys[b, kv, s0 + j]
                for d in range(dim):
                    block[d, j] = key[d]
            for i0 in range(0, padded, QUERY_BLOCK):
                reach = -1  # the tile's queries see no key of this block: its scores are never read (a prefill's future)
                for x in range(min(QUERY_BLOCK, n_queries - i0)):
                    reach = max(reach, last_seen[b, (i0 + x) // group])
                if reach < s0:
                    continue
                _score_tile_of(scaled[i0 : i0 + QUERY_BLOCK], block, tile)
                for x in range(QUERY_BLOCK):
                    for j in range(width):
                        scores[b, kv, i0 + x, s0 + j] = tile[x, j]
    for job in prange(batch * kv_heads * tokens):  # a token's heads of one KV head see the same slots
        b, kv, t = job // (kv_heads * tokens), (job // tokens) % kv_heads, job % tokens
        order = np.empty(slots, np.int64)  # the visible slots, ascending
        count = 0
        seen = visible[b, 0, t]
        for s in range(slots):
            if seen[s]:
                order[count] = s
                count += 1
        weights = np.empty((QUERY_BLOCK, slots), np.float32)
        totals = np.ones(QUERY_BLOCK, np.float32)
        for g0 in range(0, group, QUERY_BLOCK):
            n_heads = min(QUERY_BLOCK, group - g0)
            weights[n_heads:] = 0.0  # a missing head's row: computed and never written
            for x in range(n_heads):
                totals[x] = _softmax_weights(scores[b, kv, t * group + g0 + x], order[:count], softcap, sinks,
                                             kv * group + g0 + x, weights[x])  # fmt: skip
            first = kv * group + g0
            _weighted_sum(weights, totals, order[:count], values[b, kv], out[b, first : first + n_heads, t])


def _named(function, name: str):
    """`function` under another name: numba caches compiled code by a function's name, and the parallel
    and the one-thread build of one function would take each other's place in that cache."""
    renamed = types_module.FunctionType(function.__code__, function.__globals__, name)
    renamed.__qualname__ = name
    return renamed


_attend_parallel = numba.njit(cache=True, parallel=True, boundscheck=False)(_named(_attend, "_attend_parallel"))
_attend_serial = numba.njit(cache=True, boundscheck=False)(_named(_attend, "_attend_serial"))  # on the calling thread


@numba.njit(cache=True, boundscheck=False)
def _softmax_weights(row, order, softcap, sinks, head, weights):
    """One query's scores row [S] (soft-capped here when softcap > 0) and its visible slots `order`
    (ascending): weights[s] = e**(score_s - max over order); returns their sum over `order`, in order.
    With sinks (sinks.shape[0] > 0), the head's sink joins the max and its e**(sink - max) ends the sum."""
    slots = row.shape[0]
    if softcap > 0:
        for s in range(slots):
            row[s] = softcap * _tanh(row[s] / softcap)
    top = np.float32(-np.inf)
    for n in range(order.shape[0]):
        top = max(top, row[order[n]])
    if sinks.shape[0] > 0:
        top = max(top, sinks[head])
    for s in range(slots):
        weights[s] = _exp(row[s] - top)
    total = np.float32(0.0)
    for n in range(order.shape[0]):
        total += weights[order[n]]
    if sinks.shape[0] > 0:
        total += _exp(sinks[head] - top)
    return total


@numba.njit(cache=True, boundscheck=False)
def _weighted_sum(weights, totals, order, values, out):
    """out[x] [D] = (sum over n of weights[x, order[n]] * values[order[n]]) / totals[x], n in order, for
    the len(out) <= QUERY_BLOCK queries x sharing `order`; values [S', D]. Four queries at a time, 64
    dims at a time, the accumulators in registers (a missing query's row of weights is unused)."""
    n_heads, dim = out.shape[0], out.shape[1]
    for d0 in range(0, dim, DIM_BLOCK):
        if d0 + DIM_BLOCK <= dim:
            acc = numba.carray(_sum_tile(), (QUERY_BLOCK, DIM_BLOCK))
            for x in range(QUERY_BLOCK):
                for d in range(DIM_BLOCK):
                    acc[x, d] = 0.0
            for n in range(order.shape[0]):
                s = order[n]
                value = values[s, d0 : d0 + DIM_BLOCK]  # a slice: indexed by d alone, it vectorises
                for x in range(QUERY_BLOCK):
                    w = weights[x, s]
                    for d in range(DIM_BLOCK):
                        acc[x, d] += w * value[d]
            for x in range(n_heads):
                for d in range(DIM_BLOCK):
                    out[x, d0 + d] = acc[x, d] / totals[x]
        else:  # the last, partial block of dims: the same operations in the same order
            for x in range(n_heads):
                for d in range(d0, dim):
                    summed = np.float32(0.0)
                    for n in range(order.shape[0]):
                        summed += weights[x, order[n]] * values[order[n], d]
                    out[x, d] = summed / totals[x]


def ordered_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The module docstring's attention over the S = mask.shape[-1] first slots of the cache rows.

    q [B, H, T, D]; keys / values [B, KV, S' >= S, D] (a step's written cache rows); mask [B, 1, T, S]
    bool; sinks [H] (gpt-oss: a logit per head in the softmax's denominator) or None. Returns [B, H, T, D] in q's dtype; other dtypes than float32 are computed in float32 (every
    bfloat16 or float16 value is a float32 exactly)."""
    slots, dtype = mask.shape[-1], q.dtype
    if dtype != torch.float32:
        q, keys, values = q.float(), keys[:, :, :slots].float(), values[:, :, :slots].float()
    q, keys, values, mask = (x.detach().contiguous() for x in (q, keys, values, mask))
    out = torch.empty(q.shape, dtype=torch.float32)
    threads = numba_threads(q.numel() * slots)
    attend = _attend_parallel if threads > 1 else _attend_serial
    sinks = _NO_SINKS if sinks is None else sinks.detach().float().contiguous().numpy()  # [H]
    attend(q.numpy(), keys.numpy(), values.numpy(), mask.numpy(), np.float32(scale), np.float32(softcap or 0.0),
           sinks, threads, out.numpy())  # fmt: skip
    return out if dtype == torch.float32 else out.to(dtype)


def numba_threads(work: int) -> int:
    """How many threads a kernel call of `work` element operations runs on (1: the calling thread's
    serial build, since a thread hand-off would cost more; no bit depends on it); numba's pool is
    started and set to that count where it is more than one."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if work < SERIAL_WORK:
        return 1
    if threads > 1:
        _start_numba_threads()
        if numba.get_num_threads() != threads:
            numba.set_num_threads(threads)  # the calling thread's setting
    return threads


_NO_SINKS = np.zeros(0, np.float32)
_START = threading.Lock()
_started = False


def _start_numba_threads() -> None:
    """Start numba's thread pool once, only for a parallel call, leaving torch's thread count as it was.
    Starting it sets the OpenMP thread count of the runtime torch may share (set back here), and its
    threads join that runtime's pool, whose idle threads spin at every parallel region; it starts
    with passive waiting where its runtime is its own (docs/design.md, "Lossless by construction")."""
    global _started
    with _START:
        if _started:
            return
        threads, chosen = torch.get_num_threads(), "OMP_WAIT_POLICY" in os.environ
        if not chosen:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read by an OpenMP runtime that starts now
        try:
            numba.get_num_threads()  # starts the pool: omp_set_num_threads(numba's count) in its runtime
        finally:
            if not chosen:
                del os.environ["OMP_WAIT_POLICY"]
            torch.set_num_threads(threads)
        _started = True
