"""The multi-candidate rule: lossless acceptance of drafts drawn from known draft distributions.

When a node's children x_1, x_2, ... were drawn from a draft law q without replacement, in that order
(tree.Drawn), the target's processed law p is sampled exactly by recursive rejection (SpecInfer; the
without-replacement form of Recursive Speculative Decoding): accept x_i with probability
min(1, p(x_i) / q(x_i)); else p <- normalize(max(p - q, 0)) and q <- q without x_i, normalized; if no
child is accepted, sample the last residual. The token leaving a node follows p whatever q was, provided
the decision to try another child never depends on that child (the builder keeps a prefix of draws).
The tokens are not those of non-speculative sampling with the same seed: the rule is proven by
distribution tests (tests/test_multi_candidate.py). p and q are float64 on the host; a residual that
rounds to zero mass keeps the previous p with the rejected tokens removed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ...drafters.tree import DraftTree


NodeLaw = Callable[[int], np.ndarray]  # node -> the target's processed distribution after it, [V] float64


def node_laws(scores: torch.Tensor) -> NodeLaw:
    """The target's law after each node from its processed logits scores [T, V] (-inf: excluded),
    computed only for the nodes the walk visits."""
    return lambda node: scores[node].double().softmax(-1).cpu().numpy()


def accept_drawn(tree: DraftTree, target: NodeLaw, rng: np.random.Generator) -> tuple[list[int], int]:
    """Walk `tree` from the root by the multi-candidate rule; target(node): the target's processed
    distribution after the node. Returns the accepted path (node indices, root first) and the token
    the target emits after its last node."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children.setdefault(parent, []).append(i)
    path = [0]
    while True:
        node = path[-1]
        p = target(node)  # [V]
        kids = children.get(node, [])
        accepted, p = _accept_one(tree, kids, p, rng) if kids else (None, p)
        if accepted is None:
            return path, _sample(p, rng)
        path.append(accepted)


def _accept_one(tree: DraftTree, kids: Sequence[int], p: np.ndarray, rng: np.random.Generator
                ) -> tuple[int | None, np.ndarray]:  # fmt: skip
    """The child accepted at one node (None: none) and the distribution left to sample from."""
    law = tree.drawn[kids[0]].law
    if any(tree.drawn[kid].law is not law or tree.drawn[kid].rank != r for r, kid in enumerate(kids)):
        raise ValueError("a node's children must be the first draws of one draft law, in draw order (tree.Drawn)")
    q = law.probs.copy()  # [D]
    for kid in kids:
        token, index = int(tree.tokens[kid]), tree.drawn[kid].index
        if rng.random() * q[index] < p[token]:  # probability min(1, p / q)
            return kid, p
        residual = p.copy()  # p is the caller's: never written in place
        residual[law.tokens] -= q
        np.maximum(residual, 0.0, out=residual)
        residual[token] = 0.0  # exactly: p(x) < q(x) when x is rejected
        mass = residual.sum()
        if mass > 0.0:
            p = residual / mass
        else:  # p == q up to rounding: the previous p without the rejected token
            p = p.copy()
            p[token] = 0.0
            p = p / p.sum()
        q[index] = 0.0
        left = q.sum()
        if left <= 0.0:  # every token of the law was drawn and rejected
            break
        q /= left
    return None, p


def _sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from p [V] (non-negative, summing to about 1) by inverting its cumulative sum."""
    cumulative = np.cumsum(p)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), len(p) - 1))
