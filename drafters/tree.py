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
from typing import NamedTuple, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[0] == -1
    scores: tuple[float, ...]  # estimated probability that the node is accepted (root: 1.0)
    origins: tuple[tuple[int, Hashable] | None, ...]  # (source index, source key) that proposed each node
    drawn: tuple[Drawn | None, ...] = ()  # per node: how it was drawn from a draft law (empty: none was)

    def __post_init__(self):
        if not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root (parents[0] == -1)")
        if any(not 0 <= p < i for i, p in enumerate(self.parents[1:], start=1)):
            raise ValueError("every parent must precede its child")
        if self.drawn and len(self.drawn) != len(self.tokens):
            raise ValueError("drawn needs one entry per node")

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        depths = [0] * len(self)
        for i in range(1, len(self)):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    def ancestor_mask(self) -> torch.Tensor:
        """[T, T] bool: mask[i, j] is True iff j is i or an ancestor of i.

        Built on the host as one byte row per node (its parent's row plus itself; parents precede
        their children) and turned into a tensor once: no tensor op per node (this runs every step).
        """
        n = len(self)
        rows: list[bytearray] = []
        for i, p in enumerate(self.parents):
            row = bytearray(rows[p]) if p >= 0 else bytearray(n)
            row[i] = 1
            rows.append(row)
        return torch.frombuffer(bytearray().join(rows), dtype=torch.bool).view(n, n)

    def prefix(self, size: int) -> DraftTree:
        return DraftTree(self.tokens[:size], self.parents[:size], self.scores[:size], self.origins[:size],
                         self.drawn[:size])  # fmt: skip

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @staticmethod
    def chain(tokens: Sequence[int]) -> DraftTree:
        n = len(tokens)
        return DraftTree(tuple(tokens), tuple(range(-1, n - 1)), (1.0,) * n, (None,) * n)


@dataclass(frozen=True, eq=False)
class DraftLaw:
    """A draft distribution q over vocabulary ids that a node's candidates were drawn from."""

    tokens: np.ndarray  # [D] int64 vocabulary ids
    probs: np.ndarray  # [D] float64, q(tokens[j]); sums to 1


class Drawn(NamedTuple):
    """A candidate drawn from `law` without replacement: the `rank`-th draw, the law's entry `index`.

    The multi-candidate rule (backends.runtime.multi_candidate) relies on a node's children being the first
    draws of one law in draw order, and on the builder deciding to keep a draw without looking at
    what was drawn: a drawn candidate's probability must not depend on its token (drafters.Heads
    scores draws by their rank)."""

    law: DraftLaw
    rank: int
    index: int


class Candidate(NamedTuple):
    """One proposal of a source to the tree builder."""

    token: int
    probability: float  # P(the token is accepted | its parent was accepted), as the source estimates it
    key: Hashable  # the source's stats key: the node's origin, credited with the verify step's outcome
    state: object  # hashable; handed back to child_candidates to continue from the node


class DrawnCandidate(NamedTuple):
    """A Candidate drawn from a draft law: the same four fields, then how it was drawn."""

    token: int
    probability: float  # a function of the draw's rank, never of its token (Drawn)
    key: Hashable
    state: object
    drawn: Drawn


class CandidateSource(Protocol):
    """A drafter's view for the builder: what may follow the root, and what may follow a node."""

    def root_candidates(self) -> list[Candidate]:
        """The candidates following the root."""

    def child_candidates(self, token: int, state: object) -> list[Candidate]:
        """The candidates following a node with `token` that this source proposed with `state`."""


def build_tree(root: int, sources: Sequence[CandidateSource], max_nodes: int, max_depth: int) -> DraftTree:
    """Best-first tree: repeatedly add the candidate with the highest path probability.

    A candidate's score is its parent's score times the source's probability; two sources proposing
    the same token under the same parent share one node and both continue from it. Candidate
    states must be hashable (a node is expanded once per source and state).

    The node keeps the first (likelier) proposal's score and origin. A noisy-or of the agreeing
    proposals, or crediting every proposer, made the scores overconfident on the CPU: the cost
    budget then grew trees past what pays (README, the decode loop).
    """
    tokens, parents, scores, origins, depths, drawn = [root], [-1], [1.0], [None], [0], [None]
    children: dict[tuple[int, int], int] = {}
    expanded: set[tuple[int, int, object]] = set()  # (node, source, state) already pushed
    heap: list = []
    tie = itertools.count()

    def push(parent: int, source: int, candidates: Sequence[Candidate]) -> None:
        if depths[parent] >= max_depth:
            return
        base = scores[parent]
        for candidate in candidates:  # Candidate, DrawnCandidate or a bare tuple of their fields
            if candidate[1] > 0.0:
                heapq.heappush(heap, (-base * candidate[1], next(tie), parent, source, candidate))

    for s, src in enumerate(sources):
        push(0, s, src.root_candidates())
    while heap and len(tokens) < max_nodes:
        neg_score, _, parent, s, candidate = heapq.heappop(heap)
        token, _, key, state = candidate[:4]
        node = children.get((parent, token))
        if node is None:
            node = len(tokens)
            children[parent, token] = node
            tokens.append(token)
            parents.append(parent)
            scores.append(-neg_score)
            origins.append((s, key))
            depths.append(depths[parent] + 1)
            drawn.append(candidate[4] if len(candidate) > 4 else None)
        if (node, s, state) not in expanded:
            expanded.add((node, s, state))
            push(node, s, sources[s].child_candidates(token, state))
    drawn_nodes = tuple(drawn) if any(d is not None for d in drawn) else ()
    return DraftTree(tuple(tokens), tuple(parents), tuple(scores), tuple(origins), drawn_nodes)


def accept_greedy(tree: DraftTree, predictions: Sequence[int]) -> list[int]:
    """Longest root-to-node path whose every token equals the target's greedy choice at its parent."""
    children: dict[tuple[int, int], int] = {}
    for i in range(1, len(tree)):
        children.setdefault((tree.parents[i], tree.tokens[i]), i)
    path = [0]
    while (nxt := children.get((path[-1], predictions[path[-1]]))) is not None:
        path.append(nxt)
    return path
