"""The best-first builder: candidates from several drafters' sources merged into one row's draft tree."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol

from .tree import DraftTree, Drawn


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
    drawn_nodes = drawn if any(d is not None for d in drawn) else None
    return DraftTree(tokens, parents, scores, origins, drawn_nodes)
