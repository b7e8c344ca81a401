"""Compiled host kernels for drafting every row of a batch: prompt lookup's matching and the best-first
tree over chain sources and Token Recycling's table (numba, compiled on first call and cached on disk).

Why compiled: drafting is per-row, per-node work (a heap, a table lookup, a sibling check per
candidate). In Python it cost as much as the whole forward of a small model at B = 32; array operations
over rows pay their dispatch per tree depth instead and were no faster on the trees the loop drafts
(docs/experiments.md, "Drafting every row at once"). vLLM's n-gram proposer is compiled the same way.

`build_trees` is `drafters.tree.build_tree` over the sources: the chains (drafters.chains), then Token
Recycling, for every row: the same candidates in the same order, the same scores, merges and ties, so a
row's tree equals the one the per-row sessions build (tests/test_chains.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

PAIR_MULTIPLIERS, PAIR_SHIFT = (0x85EBCA6B, 0x9E3779B1), 7  # Token Recycling's pair hash (pair_slot)


@numba.njit(cache=True)
def pair_slot(previous: int, token: int, slots: int) -> tuple[int, int]:
    """(key, slot) of the pair (previous, token) in a hashed table of `slots` (a power of two) slots
    (successor_table.SuccessorTable): the key is unique while ids < 2**32, nothing overflows while
    ids < 2**30."""
    key = (previous + 1) * (1 << 32) + token
    mixed = (previous + 1) * PAIR_MULTIPLIERS[0] + token * PAIR_MULTIPLIERS[1]
    return key, (mixed >> PAIR_SHIFT) & (slots - 1)


@numba.njit(cache=True)
def lookup_branches(history, lengths, max_ngram, min_ngram, max_depth, max_branches):
    """Each row's continuations of earlier occurrences of its last n tokens, n = max_ngram .. min_ngram,
    longest match and most recent occurrence first; a continuation equal to, or a prefix of, one
    found before is skipped; at most max_branches.

    history [B, S] int64 (row b's tokens in [0, lengths[b])) -> branches [B, M, D] int64 (-1 past a
    continuation's end) and matched [B, M] int64 (the match length; 0: no branch)."""
    batch = history.shape[0]
    branches = np.full((batch, max_branches, max_depth), -1, np.int64)
    matched = np.zeros((batch, max_branches), np.int64)
    kept = np.zeros(max_branches, np.int64)  # lengths of the continuations found
    for b in range(batch):
        length = lengths[b]
        last = length - 1
        found = 0
        for n in range(max_ngram, min_ngram - 1, -1):
            if length < n or found >= max_branches:
                continue
            for end in range(last - 1, n - 2, -1):  # an earlier occurrence ends at `end`
                same = True
                for back in range(n):
                    if history[b, end - back] != history[b, last - back]:
                        same = False
                        break
                if not same:
                    continue
                size = min(max_depth, last - end)  # tokens after the occurrence, up to the last one
                repeated = False
                for f in range(found):
                    if kept[f] >= size:
                        prefix = True
                        for i in range(size):
                            if branches[b, f, i] != history[b, end + 1 + i]:
                                prefix = False
                                break
                        if prefix:
                            repeated = True
                            break
                if repeated:
                    continue
                for i in range(size):
                    branches[b, found, i] = history[b, end + 1 + i]
                kept[found] = size
                matched[b, found] = n
                found += 1
                if found >= max_branches:
                    break
    return branches, matched


PARENT, SOURCE, TOKEN, KEY, STATE = range(5)  # a pushed candidate's fields (STATE: the candidate's chain)
ITEM_FIELDS = 5
CHAIN, RECYCLING = 0, 1  # the sources, in build_tree's order


class Heap(NamedTuple):
    """A binary min-heap of pushed candidates by (score, push order)."""

    score: np.ndarray  # [C] float64: each heap slot's score
    tie: np.ndarray  # [C] int64: each heap slot's push order (its candidate's index in items)
    items: np.ndarray  # [C, ITEM_FIELDS] int64: every candidate pushed, in push order
    counts: np.ndarray  # [2] int64: heap slots in use, candidates pushed


@numba.njit(cache=True)
def _before(s1, t1, s2, t2) -> bool:
    return s1 < s2 or (s1 == s2 and t1 < t2)


@numba.njit(cache=True)
def _push(heap, score, parent, source, token, key, state) -> None:
    """Push a candidate with `score` (lower pops first; ties in push order)."""
    tie = heap.counts[1]
    heap.items[tie, PARENT], heap.items[tie, SOURCE], heap.items[tie, TOKEN] = parent, source, token
    heap.items[tie, KEY], heap.items[tie, STATE] = key, state
    heap.counts[1] += 1
    i = heap.counts[0]
    heap.counts[0] += 1
    while i > 0:
        up = (i - 1) >> 1
        if not _before(score, tie, heap.score[up], heap.tie[up]):
            break
        heap.score[i], heap.tie[i] = heap.score[up], heap.tie[up]
        i = up
    heap.score[i], heap.tie[i] = score, tie


@numba.njit(cache=True)
def _pop(heap):
    """Pop the best candidate: (its score, its fields [ITEM_FIELDS])."""
    best_score, best = heap.score[0], heap.tie[0]
    heap.counts[0] -= 1
    size = heap.counts[0]
    score, tie = heap.score[size], heap.tie[size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and _before(heap.score[child + 1], heap.tie[child + 1], heap.score[child], heap.tie[child]):
            child += 1
        if not _before(heap.score[child], heap.tie[child], score, tie):
            break
        heap.score[i], heap.tie[i] = heap.score[child], heap.tie[child]
        i = child
    if size > 0:
        heap.score[i], heap.tie[i] = score, tie
    return best_score, heap.items[best]


@numba.njit(cache=True)
def build_trees(roots, previous, chains, chain_keys, divisors, rates, by_token, pair_keys, by_pair, max_nodes,
                max_depths):  # fmt: skip
    """Best-first trees (drafters.tree.build_tree) over the chains, then Token Recycling's successors,
    one per row.

    roots, previous [B]: each row's root and the token before it (-1: none); chains [B, M, D]: every
    row's candidate chains from its root (-1 past a chain's end; M = 0: none), chain_keys [B, M, D]
    each token's stats key, divisors [B, M] (a chain's first token's rate is divided by it); rates
    [B, K]: each row's rate per stats key; by_token [V, k], pair_keys [P], by_pair [P, k]: Token
    Recycling's table (V = 0: none), its stats keys r (token table, rank r) and k + r (pair table).
    Returns tokens, parents, origins [B, N] int64, scores [B, N] float64, sizes [B] int64, ancestors
    [B, N, N] bool, N = max_nodes (padding as in drafters.tree)."""
    batch, count = chains.shape[0], chains.shape[1]
    k = by_token.shape[1]
    tokens = np.zeros((batch, max_nodes), np.int64)
    parents = np.full((batch, max_nodes), -1, np.int64)
    origins = np.full((batch, max_nodes), -1, np.int64)
    scores = np.zeros((batch, max_nodes))
    sizes = np.ones(batch, np.int64)
    ancestors = np.zeros((batch, max_nodes, max_nodes), np.bool_)
    depths = np.zeros(max_nodes, np.int64)
    first_child = np.empty(max_nodes, np.int64)
    next_sibling = np.empty(max_nodes, np.int64)
    chain_done = np.zeros((max_nodes, max(count, 1)), np.bool_)
    recycling_done = np.zeros(max_nodes, np.bool_)
    capacity = (max_nodes * (count + 1) + 1) * (2 * k + count + 1) + 1
    heap = Heap(np.empty(capacity), np.empty(capacity, np.int64), np.empty((capacity, ITEM_FIELDS), np.int64),
                np.zeros(2, np.int64))  # fmt: skip
    for b in range(batch):
        tokens[b, 0], scores[b, 0], depths[0] = roots[b], 1.0, 0
        first_child[:] = -1
        next_sibling[:] = -1
        chain_done[:] = False
        recycling_done[:] = False
        size = 1
        heap.counts[:] = 0
        root = np.int64(0)  # expanded by every source, every chain (typed int64: one compiled _expand)
        popped = np.full(ITEM_FIELDS, -1, np.int64)
        for source in range(count + 1):  # the chains, then Token Recycling
            popped[SOURCE], popped[STATE] = (CHAIN, source) if source < count else (RECYCLING, 0)
            _expand(b, root, popped, previous[b], tokens, scores, depths, chain_done, recycling_done, max_depths,
                    chains, chain_keys, divisors, rates, by_token, pair_keys, by_pair, heap)  # fmt: skip
        while heap.counts[0] > 0 and size < max_nodes:
            neg_score, popped = _pop(heap)
            parent, token = popped[PARENT], popped[TOKEN]
            node = first_child[parent]
            while node >= 0 and tokens[b, node] != token:
                node = next_sibling[node]
            if node < 0:  # a new node; two sources proposing one token under one parent share it
                node = size
                size += 1
                tokens[b, node], parents[b, node], scores[b, node] = token, parent, -neg_score
                origins[b, node], depths[node] = popped[KEY], depths[parent] + 1
                next_sibling[node] = first_child[parent]
                first_child[parent] = node
            _expand(b, node, popped, tokens[b, parent], tokens, scores, depths, chain_done, recycling_done, max_depths,
                    chains, chain_keys, divisors, rates, by_token, pair_keys, by_pair, heap)  # fmt: skip
        sizes[b] = size
        for i in range(max_nodes):
            if i > 0 and i < size:
                ancestors[b, i, :] = ancestors[b, parents[b, i], :]
            ancestors[b, i, i] = True
    return tokens, parents, origins, scores, sizes, ancestors


@numba.njit(cache=True)
def _expand(b, node, popped, before, tokens, scores, depths, chain_done, recycling_done, max_depths, chains, chain_keys,
            divisors, rates, by_token, pair_keys, by_pair, heap):  # fmt: skip
    """Push the candidates after `node` of the source that proposed it (`popped`: its source and state),
    once per node and source state (build_tree's `expanded`); before: the token before the node."""
    if depths[node] >= max_depths[b]:
        return
    base = scores[b, node]
    if popped[SOURCE] == CHAIN:  # the next token of the node's chain
        m = popped[STATE]
        offset = depths[node]
        if chain_done[node, m] or offset >= chains.shape[2] or chains[b, m, offset] < 0:
            return
        chain_done[node, m] = True
        key = chain_keys[b, m, offset]
        prob = rates[b, key] / divisors[b, m] if offset == 0 else rates[b, key]
        if prob > 0.0:  # as build_tree: a candidate the source gives no chance is not pushed
            _push(heap, -base * prob, node, np.int64(CHAIN), chains[b, m, offset], key, m)
        return
    if recycling_done[node] or by_token.shape[0] == 0:
        return
    recycling_done[node] = True
    token, k = tokens[b, node], by_token.shape[1]
    key, slot = pair_slot(before, token, pair_keys.shape[0])
    for table in range(2):  # the token table's successors by rank, then the pair table's
        if table == 0 and token >= by_token.shape[0] or table == 1 and pair_keys[slot] != key:
            continue
        for r in range(k):
            successor = by_token[token, r] if table == 0 else by_pair[slot, r]
            rate = rates[b, table * k + r]
            if successor >= 0 and rate > 0.0:
                _push(heap, -base * rate, node, np.int64(RECYCLING), successor, table * k + r, np.int64(0))


@numba.njit(cache=True)
def write_successors(by_token, pair_keys, by_pair, previous, tokens, successors):
    """Token Recycling's table rows: tokens[i] (preceded by previous[i]) is followed by successors[i]
    (ranks 0, 1, ...; -1 past the given ones), written in order (a later row wins). by_token must
    have a row for every token."""
    for i in range(tokens.shape[0]):
        _write_row(by_token, pair_keys, by_pair, previous[i], tokens[i], successors[i])


@numba.njit(cache=True)
def _write_row(by_token, pair_keys, by_pair, previous, token, successors) -> None:
    """One table row: `token` (preceded by `previous`) is followed by successors [k'] (-1 past k')."""
    key, slot = pair_slot(previous, token, pair_keys.shape[0])
    pair_keys[slot] = key
    for r in range(by_token.shape[1]):
        successor = successors[r] if r < successors.shape[0] else -1
        by_token[token, r] = successor
        by_pair[slot, r] = successor


@numba.njit(cache=True)
def pair_rows(pair_keys, by_pair, previous, tokens):
    """previous, tokens [n] -> [n, k]: the pair table's row of each (previous, token), -1 rows where
    the slot holds another pair or none."""
    rows = np.full((tokens.shape[0], by_pair.shape[1]), -1, np.int64)
    for i in range(tokens.shape[0]):
        key, slot = pair_slot(previous[i], tokens[i], pair_keys.shape[0])
        if pair_keys[slot] == key:
            rows[i] = by_pair[slot]
    return rows


@numba.njit(cache=True)
def learn(tokens, parents, origins, sizes, paths, lengths, root_previous, topk, tried, accepted, by_token, pair_keys,
          by_pair):  # fmt: skip
    """What every row's verify step teaches (drafters.chains): each drafted node whose parent
    was accepted (paths: the rows' accepted paths one after another, lengths [B]) counts as tried
    under its stats key (origins, -1: none), and as accepted when on its path; and, when there is a
    table (by_token has rows for every token), every node's successors are the target's top-k after
    it (topk [B, T, k'], -1 past k'), row after row, node after node (a later write wins)."""
    on_path = np.zeros(parents.shape[1], np.bool_)
    start = 0
    for b in range(parents.shape[0]):
        on_path[:] = False
        for j in range(lengths[b]):
            on_path[paths[start + j]] = True
        start += lengths[b]
        for i in range(1, sizes[b]):
            key = origins[b, i]
            if key >= 0 and on_path[parents[b, i]]:
                tried[b, key] += 1.0
                if on_path[i]:
                    accepted[b, key] += 1.0
        if by_token.shape[0] == 0:
            continue
        for i in range(sizes[b]):
            before = root_previous[b] if parents[b, i] < 0 else tokens[b, parents[b, i]]
            _write_row(by_token, pair_keys, by_pair, before, tokens[b, i], topk[b, i])
