"""The draft trees of a batch's rows as arrays: what the decode loop lays out, verifies and accepts.

Row b's nodes 0 .. sizes[b] - 1 form its tree exactly as a `DraftTree` does (node 0 the root, a parent
before its children, best first: every prefix is a tree); nodes past sizes[b] are padding (token 0,
no parent, score 0, seeing only themselves). Arrays live on the host (numpy): drafting is host work;
the loop moves tokens and masks to the device once per step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .tree import DraftTree


@dataclass(frozen=True, eq=False)
class TreeRows:
    tokens: np.ndarray  # [B, N] int64
    parents: np.ndarray  # [B, N] int64: -1 at the root and at padding nodes
    scores: np.ndarray  # [B, N] float64: estimated probability a node is accepted (root 1, padding 0)
    sizes: np.ndarray  # [B] int64: real nodes per row, >= 1
    ancestors: np.ndarray  # [B, N, N] bool: [b, i, j] iff j is i or an ancestor of i (padding: itself only)
    trees: tuple[DraftTree, ...] | None = None  # the rows' trees, when they were built one row at a time
    origins: np.ndarray | None = None  # [B, N] int64: the drafter's stats key of each node (-1: none), when built at once

    @property
    def width(self) -> int:
        """N: nodes per row, padding included."""
        return self.tokens.shape[1]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def stack(cls, trees: Sequence[DraftTree]) -> TreeRows:
        """Rows from per-row trees (kept in `trees` for what needs a row's own tree: drawn drafts)."""
        n = max(len(t) for t in trees)
        tokens = np.zeros((len(trees), n), dtype=np.int64)
        parents = np.full((len(trees), n), -1, dtype=np.int64)
        scores = np.zeros((len(trees), n))
        ancestors = np.broadcast_to(np.eye(n, dtype=bool), (len(trees), n, n)).copy()
        for b, tree in enumerate(trees):
            size = len(tree)
            tokens[b, :size] = tree.tokens
            parents[b, :size] = tree.parents
            scores[b, :size] = tree.scores
            ancestors[b, :size, :size] = tree.ancestor_mask().numpy()
        sizes = np.array([len(t) for t in trees], dtype=np.int64)
        return cls(tokens, parents, scores, sizes, ancestors, tuple(trees))

    @classmethod
    def roots(cls, tokens: Sequence[int]) -> TreeRows:
        """One-node trees: each row verifies its root only (a plain step: built every step, so the
        arrays every batch of this size shares are made once; nothing writes into a TreeRows)."""
        tokens = np.fromiter(tokens, dtype=np.int64, count=len(tokens))[:, None]  # [B, 1]
        return cls(tokens, *_one_node_rows(len(tokens)))

    def prefix(self, size: int) -> TreeRows:
        """Every row cut to its first min(size, sizes[b]) nodes (a best-first prefix is a tree)."""
        if size >= self.width:
            return self
        sizes = np.minimum(self.sizes, size)
        real = np.arange(size)[None, :] < sizes[:, None]  # [B, n]
        ancestors = self.ancestors[:, :size, :size]
        trees = tuple(t.prefix(size) for t in self.trees) if self.trees is not None else None
        origins = np.where(real, self.origins[:, :size], -1) if self.origins is not None else None
        return TreeRows(np.where(real, self.tokens[:, :size], 0), np.where(real, self.parents[:, :size], -1),
                        np.where(real, self.scores[:, :size], 0.0), sizes, ancestors, trees, origins)  # fmt: skip

    def expected_tokens(self) -> np.ndarray:
        """[B, N] float64: [b, n - 1] = row b's expected tokens per step when it verifies its first n nodes
        (the bonus token included; flat past the row's size)."""
        return np.cumsum(self.scores, axis=1)  # the root's score 1 is the bonus token; padding adds 0

    def row(self, b: int) -> DraftTree:
        """Row b's tree."""
        if self.trees is not None:
            return self.trees[b]
        size = int(self.sizes[b])
        return DraftTree(tuple(self.tokens[b, :size].tolist()), tuple(self.parents[b, :size].tolist()),
                         tuple(self.scores[b, :size].tolist()), (None,) * size)  # fmt: skip


@functools.lru_cache(maxsize=64)
def _one_node_rows(rows: int) -> tuple[np.ndarray, ...]:
    """parents, scores, sizes, ancestors of `rows` one-node trees (shared: never written)."""
    return (np.full((rows, 1), -1, dtype=np.int64), np.ones((rows, 1)), np.ones(rows, dtype=np.int64),
            np.ones((rows, 1, 1), dtype=bool))  # fmt: skip


def first_branches(trees: TreeRows) -> TreeRows:
    """Each row's branch through every node's first child: what a program without tree attention verifies."""
    chains = []
    for b in range(len(trees)):
        size, parents = int(trees.sizes[b]), trees.parents[b]
        keep, node = [0], 0
        while True:
            children = np.flatnonzero(parents[node + 1 : size] == node)
            if children.size == 0:
                break
            node = node + 1 + int(children[0])
            keep.append(node)
        chains.append(keep)
    if trees.trees is not None:
        return TreeRows.stack([_chain_of(t, keep) for t, keep in zip(trees.trees, chains)])
    n = max(map(len, chains))
    tokens = np.zeros((len(trees), n), dtype=np.int64)
    scores = np.zeros((len(trees), n))
    origins = np.full((len(trees), n), -1, dtype=np.int64)
    for b, keep in enumerate(chains):
        tokens[b, : len(keep)] = trees.tokens[b, keep]
        scores[b, : len(keep)] = trees.scores[b, keep]
        if trees.origins is not None:
            origins[b, : len(keep)] = trees.origins[b, keep]
    sizes = np.array([len(k) for k in chains], dtype=np.int64)
    real = np.arange(n)[None, :] < sizes[:, None]
    parents = np.where(real, np.arange(-1, n - 1)[None, :], -1)
    chain_mask = np.tril(np.ones((n, n), dtype=bool))
    ancestors = np.where(real[:, :, None] & real[:, None, :], chain_mask, np.eye(n, dtype=bool))
    return TreeRows(tokens, parents, scores, sizes, ancestors, origins=origins if trees.origins is not None else None)


def _chain_of(tree: DraftTree, keep: list[int]) -> DraftTree:
    return DraftTree(
        tuple(tree.tokens[i] for i in keep),
        tuple(range(-1, len(keep) - 1)),
        tuple(tree.scores[i] for i in keep),
        tuple(tree.origins[i] for i in keep),
        tuple(tree.drawn[i] for i in keep) if tree.drawn else (),  # each node's first child: its first draw
    )
