"""Draft trees: one type for one row's tree and for a batch's rows, as host arrays.

Node 0 is the root: the last committed token, whose K/V is not cached yet; every other node is a
drafted token. A parent precedes its children and nodes are stored best first, so every prefix of a
tree is a tree: the decode loop cuts trees to the size the cost budget favours. One row's tree has
arrays [N]; a batch's rows have arrays [B, N], row b's nodes past sizes[b] padding (token 0, no
parent, score 0, seeing only themselves); `row(b)` is row b's tree. Drafting is host work: the loop
moves tokens and masks to the device once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One tree ([N] arrays) or a batch's trees ([B, N]). One tree is built from tokens and parents (the
    rest defaults, the ancestors derived and the parents checked); a batch by `stack`, `roots` or a
    builder, with every array given."""

    tokens: np.ndarray  # [(B,) N] int64
    parents: np.ndarray  # [(B,) N] int64: -1 at the root and at padding nodes
    scores: np.ndarray | None = None  # [(B,) N] float64: estimated P(node accepted); root 1, padding 0 (default 1)
    origins: np.ndarray | None = None  # [(B,) N]: who proposed each node, in its builder's terms (see below)
    drawn: np.ndarray | None = None  # [(B,) N] object: how each node was drawn from a draft law (Drawn or None)
    sizes: np.ndarray | None = None  # [(B,)] int64: real nodes per row (default N)
    ancestors: np.ndarray | None = None  # [(B,) N, N] bool: [.., i, j] iff j is i or an ancestor of i
    # origins: the per-row builder (drafters.best_first) records (source index, stats key) or None per
    # node (object); the all-rows builder (drafters.chains) an int64 stats key, -1 for none.

    def __post_init__(self):
        tokens = np.asarray(self.tokens, dtype=np.int64)
        parents = np.asarray(self.parents, dtype=np.int64)
        if tokens.ndim not in (1, 2) or tokens.shape[-1] == 0 or parents.shape != tokens.shape:
            raise ValueError("a draft tree needs tokens and parents of one shape [(B,) N], N >= 1")
        setter = object.__setattr__
        setter(self, "tokens", tokens)
        setter(self, "parents", parents)
        scores = np.ones(tokens.shape) if self.scores is None else np.asarray(self.scores, dtype=np.float64)
        setter(self, "scores", scores)
        if self.origins is not None and not isinstance(self.origins, np.ndarray):
            setter(self, "origins", _objects(self.origins))
        drawn = self.drawn
        if drawn is not None and not isinstance(drawn, np.ndarray):
            setter(self, "drawn", _objects(drawn) if len(drawn) else None)
        if self.sizes is None:
            setter(self, "sizes", np.asarray(tokens.shape[-1]) if tokens.ndim == 1 else np.full(len(tokens), tokens.shape[-1]))
        if self.ancestors is None:
            if tokens.ndim == 2:
                raise ValueError("a batch's trees come with their ancestors: build it with DraftTree.stack")
            setter(self, "ancestors", _ancestors(parents))

    def __len__(self) -> int:
        """A batch's rows, or one tree's nodes (the arrays' first axis)."""
        return len(self.tokens)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DraftTree):
            return NotImplemented
        fields = ("tokens", "parents", "scores", "origins", "drawn", "sizes", "ancestors")
        return all(_same(getattr(self, f), getattr(other, f)) for f in fields)

    __hash__ = None

    @property
    def width(self) -> int:
        """N: nodes per row, padding included."""
        return self.tokens.shape[-1]

    def row(self, b: int) -> DraftTree:
        """Row b's tree, cut to its size."""
        n = int(self.sizes[b])
        pick = lambda a: a[b, :n] if a is not None else None  # noqa: E731
        return DraftTree(pick(self.tokens), pick(self.parents), pick(self.scores), pick(self.origins),
                         pick(self.drawn), np.asarray(n), self.ancestors[b, :n, :n])  # fmt: skip

    def prefix(self, size: int) -> DraftTree:
        """Every row cut to its first min(size, its size) nodes (a best-first prefix is a tree)."""
        if size >= self.width:
            return self
        sizes = np.minimum(self.sizes, size)
        real = np.arange(size) < sizes[..., None]  # [(B,) size]

        def cut(a: np.ndarray | None, padding: object) -> np.ndarray | None:
            return None if a is None else np.where(real, a[..., :size], padding)

        return DraftTree(cut(self.tokens, 0), cut(self.parents, -1), cut(self.scores, 0.0),
                         cut(self.origins, _no_origin(self.origins)), cut(self.drawn, None), sizes,
                         self.ancestors[..., :size, :size])  # fmt: skip

    def expected_tokens(self) -> np.ndarray:
        """[(B,) N] float64: [.., n - 1] = expected tokens per step when a row verifies its first n nodes
        (the bonus token included; flat past the row's size)."""
        return np.cumsum(self.scores, axis=-1)  # the root's score 1 is the bonus token; padding adds 0

    def depths(self) -> list[int]:
        """One tree: each node's depth below the root."""
        depths = [0] * len(self)
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            depths[i] = depths[p] + 1
        return depths

    def ancestor_mask(self) -> torch.Tensor:
        """[(B,) N, N] bool tensor of `ancestors`."""
        return torch.from_numpy(self.ancestors)

    def is_chain(self) -> bool:
        """One tree: every node is its predecessor's child."""
        return bool(np.array_equal(self.parents, np.arange(-1, len(self) - 1)))

    @staticmethod
    def chain(tokens: Sequence[int]) -> DraftTree:
        """One tree: the tokens as a chain below tokens[0]."""
        return DraftTree(tokens, np.arange(-1, len(tokens) - 1))

    @classmethod
    def stack(cls, trees: Sequence[DraftTree]) -> DraftTree:
        """A batch from one-row trees, padded to the widest."""
        n, rows = max(len(t) for t in trees), len(trees)
        tokens = np.zeros((rows, n), dtype=np.int64)
        parents = np.full((rows, n), -1, dtype=np.int64)
        scores = np.zeros((rows, n))
        ancestors = np.broadcast_to(np.eye(n, dtype=bool), (rows, n, n)).copy()
        origins = _padded([t.origins for t in trees], n)
        drawn = _padded([t.drawn for t in trees], n, dtype=object)
        for b, tree in enumerate(trees):
            size = len(tree)
            tokens[b, :size], parents[b, :size], scores[b, :size] = tree.tokens, tree.parents, tree.scores
            ancestors[b, :size, :size] = tree.ancestors
        sizes = np.array([len(t) for t in trees], dtype=np.int64)
        return cls(tokens, parents, scores, origins, drawn, sizes, ancestors)

    @classmethod
    def roots(cls, tokens: Sequence[int]) -> DraftTree:
        """One-node trees: each row verifies its root only (a plain step)."""
        tokens = np.fromiter(tokens, dtype=np.int64, count=len(tokens))[:, None]  # [B, 1]
        rows = len(tokens)
        return cls(tokens, np.full((rows, 1), -1, dtype=np.int64), np.ones((rows, 1)), None, None,
                   np.ones(rows, dtype=np.int64), np.ones((rows, 1, 1), dtype=bool))  # fmt: skip


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


def first_branches(trees: DraftTree) -> DraftTree:
    """Each row's branch through every node's first child: what a program without tree attention verifies."""
    return DraftTree.stack([_first_branch(trees.row(b)) for b in range(len(trees))])


def accept_greedy(tree: DraftTree, predictions: Sequence[int]) -> list[int]:
    """One tree: the longest root-to-node path whose every token equals the target's greedy choice at its parent."""
    children: dict[tuple[int, int], int] = {}
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    for i in range(1, len(tokens)):
        children.setdefault((parents[i], tokens[i]), i)
    predictions = [int(p) for p in predictions]
    path = [0]
    while (nxt := children.get((path[-1], predictions[path[-1]]))) is not None:
        path.append(nxt)
    return path


def _first_branch(tree: DraftTree) -> DraftTree:
    keep, node, parents = [0], 0, tree.parents
    while (children := np.flatnonzero(parents[node + 1 :] == node)).size:
        node = node + 1 + int(children[0])
        keep.append(node)
    take = lambda a: a[keep] if a is not None else None  # noqa: E731  (a node's first child: its first draw)
    return DraftTree(tree.tokens[keep], np.arange(-1, len(keep) - 1), tree.scores[keep], take(tree.origins),
                     take(tree.drawn))  # fmt: skip


def _ancestors(parents: np.ndarray) -> np.ndarray:
    """[N, N] bool of one tree, built on the host as one byte row per node (its parent's row plus
    itself): no array op per node (this runs for every drafted row every step). Checks the parents."""
    n = len(parents)
    parent_list = parents.tolist()
    if parent_list[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parent_list[1:], start=1)):
        raise ValueError("a draft tree needs a root (parents[0] == -1), and every parent must precede its child")
    rows: list[bytearray] = []
    for i, p in enumerate(parent_list):
        row = bytearray(rows[p]) if p >= 0 else bytearray(n)
        row[i] = 1
        rows.append(row)
    return np.frombuffer(bytearray().join(rows), dtype=bool).reshape(n, n)


def _objects(values: Sequence[object]) -> np.ndarray:
    """[N] object array of `values` (tuples stay elements, not rows)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _no_origin(origins: np.ndarray | None) -> object:
    return -1 if origins is not None and origins.dtype != object else None


def _padded(rows: Sequence[np.ndarray | None], n: int, dtype: type | None = None) -> np.ndarray | None:
    """[B, n] of per-row arrays (None where every row has none), padded with no origin / no draw."""
    present = [r for r in rows if r is not None]
    if not present:
        return None
    dtype = dtype or (object if any(r.dtype == object for r in present) else np.int64)
    padding = None if dtype is object else -1
    out = np.full((len(rows), n), padding, dtype=dtype)
    for b, r in enumerate(rows):
        if r is not None:
            out[b, : len(r)] = r
    return out


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(np.all(a == b))
