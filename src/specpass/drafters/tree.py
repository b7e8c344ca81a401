"""Draft trees and the best-first builder that merges candidates from several drafters into one tree.

A draft tree's node 0 is the root: the last committed token, whose K/V is not cached yet. Every
other node is a drafted token. Nodes are stored in insertion order and a parent always precedes its
children, so every prefix of the node list is itself a valid tree: the decode loop cuts the tree to
the size the device's cost curve favours.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[0] == -1
    scores: tuple[float, ...]  # estimated probability that the node is accepted (root: 1.0)
    origins: tuple[tuple[tuple[int, Hashable], ...], ...]  # per node, every proposal's (source index, stats key)

    def __post_init__(self):
        if not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root (parents[0] == -1)")
        if any(not 0 <= p < i for i, p in enumerate(self.parents[1:], start=1)):
            raise ValueError("every parent must precede its child")

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        depths = [0] * len(self)
        for i in range(1, len(self)):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    def ancestor_mask(self) -> torch.Tensor:
        """[T, T] bool: mask[i, j] is True iff j is i or an ancestor of i."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            p = self.parents[i]
            if p >= 0:
                mask[i] |= mask[p]
        return mask

    def prefix(self, size: int) -> DraftTree:
        return DraftTree(self.tokens[:size], self.parents[:size], self.scores[:size], self.origins[:size])

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @staticmethod
    def chain(tokens: Sequence[int]) -> DraftTree:
        n = len(tokens)
        return DraftTree(tuple(tokens), tuple(range(-1, n - 1)), (1.0,) * n, ((),) * n)


class CandidateSource(Protocol):
    """A drafter's view for the builder: what may follow the root, and what may follow a node."""

    def root_candidates(self) -> list[tuple[int, float, Hashable, object]]:
        """(token, probability given the parent was accepted, stats key, continuation state)."""

    def child_candidates(self, token: int, state: object) -> list[tuple[int, float, Hashable, object]]:
        """Candidates following a node with `token` that this source proposed with `state`."""


def build_tree(root: int, sources: Sequence[CandidateSource], max_nodes: int, max_depth: int) -> DraftTree:
    """Best-first tree: repeatedly add the candidate with the highest path probability.

    A candidate's score is its parent's score times its probability given the parent. Proposals of
    the same token under the same parent (from several sources, or from one source by several routes:
    two prompt-lookup branches, a token recycled in two contexts) are one candidate with the highest
    of their probabilities. Every proposal of a node is made when its parent joins the tree (the
    root's before any), so all of them are known when the node joins: the node records every proposal
    as an origin (each proposer then learns from the outcome) and is expanded once per source and
    state. Candidate states must be hashable.

    Measured against combining agreeing proposals (CPU, 64-node trees, 24 HumanEval prompts 100-123):
    the noisy-or 1 - prod(1 - p) orders the tree better (τ 3.99 against 3.97 training-free, 4.84
    against 4.75 with Hydra heads), but it overrates agreement between correlated proposers, so the
    cost-curve budget grows the trees past what pays: 5-10% fewer tokens/s in the benchmark. The
    noisy-or rescaled by its own running calibration was no faster than the highest probability.
    """
    tokens, parents, scores, origins, depths = [root], [-1], [1.0], [()], [0]
    children: dict[tuple[int, int], int] = {}
    expanded: set[tuple[int, int, object]] = set()  # (node, source, state) already pushed
    pending: dict[tuple[int, int], list] = {}  # (parent, token) -> [best probability, [(source, key, state)]]
    heap: list = []  # (-score, tie, parent, token, probability): entries below the best are stale
    tie = itertools.count()

    def expand(node: int, s: int, state) -> None:
        if (node, s, state) in expanded or depths[node] >= max_depth:
            return
        expanded.add((node, s, state))
        for token, prob, key, child_state in sources[s].child_candidates(tokens[node], state):
            propose(node, token, prob, s, key, child_state)

    def propose(parent: int, token: int, prob: float, s: int, key, state) -> None:
        if prob <= 0.0:
            return
        if (parent, token) in children:  # the docstring's invariant: every proposal precedes its node
            raise AssertionError(f"a proposal of token {token} under node {parent} after that node joined the tree")
        entry = pending.setdefault((parent, token), [0.0, []])
        entry[1].append((s, key, state))
        if prob > entry[0]:
            entry[0] = prob
            heapq.heappush(heap, (-scores[parent] * prob, next(tie), parent, token, prob))

    if max_depth > 0:
        for s, source in enumerate(sources):
            for token, prob, key, state in source.root_candidates():
                propose(0, token, prob, s, key, state)
    while heap and len(tokens) < max_nodes:
        neg_score, _, parent, token, prob = heapq.heappop(heap)
        entry = pending.get((parent, token))
        if entry is None or entry[0] != prob:
            continue  # superseded by a likelier proposal of the same token (or already placed)
        del pending[parent, token]
        node = len(tokens)
        children[parent, token] = node
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg_score)
        origins.append(tuple((s, key) for s, key, _ in entry[1]))
        depths.append(depths[parent] + 1)
        for s, _, state in entry[1]:
            expand(node, s, state)
    return DraftTree(tuple(tokens), tuple(parents), tuple(scores), tuple(origins))


def accept_greedy(tree: DraftTree, predictions: Sequence[int]) -> list[int]:
    """Longest root-to-node path whose every token equals the target's greedy choice at its parent."""
    children: dict[tuple[int, int], int] = {}
    for i in range(1, len(tree)):
        children.setdefault((tree.parents[i], tree.tokens[i]), i)
    path = [0]
    while (nxt := children.get((path[-1], predictions[path[-1]]))) is not None:
        path.append(nxt)
    return path
