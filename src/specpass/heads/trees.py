"""Static sparse trees from the heads' measured accuracy (Medusa's "medusa choices", chosen, not hand-written).

A node is a rank path (r1, ..., rd): head 1's rank-r1 token, under it head 2's rank-r2 token, and so
on. With head d's rank-r candidate right with probability accuracy[d-1][r] (independently of the
heads before it, given they were right), a node is accepted with the product of the accuracies on
its path, and the tree's expected accepted length is the sum of those products over its nodes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def expected_length(paths: Sequence[tuple[int, ...]], accuracy: Sequence[Sequence[float]]) -> float:
    """Expected number of drafted tokens accepted (the bonus token not counted)."""
    return sum(math.prod(accuracy[d][r] for d, r in enumerate(path)) for path in paths)


def optimal_static_tree(accuracy: Sequence[Sequence[float]], budget: int) -> list[tuple[int, ...]]:
    """The `budget` rank paths, closed under prefixes, of largest expected accepted length.

    Best-first is optimal: a node's value is at most its parent's (accuracies are <= 1), so the
    best frontier node is always worth at least any node below it, and taking it first loses
    nothing. The list comes out in the order the nodes were taken, so every prefix is optimal for
    its own budget. (The Heads drafter's "static" tree is this construction, on the same numbers.)
    """
    chosen: list[tuple[int, ...]] = []
    frontier = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(frontier)
    while frontier and len(chosen) < budget:
        neg_value, path = heapq.heappop(frontier)
        chosen.append(path)
        depth = len(path)
        if depth < len(accuracy):
            for r in range(len(accuracy[depth])):
                heapq.heappush(frontier, (neg_value * accuracy[depth][r], (*path, r)))
    return chosen
