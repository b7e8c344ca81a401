"""Greedy and sample-and-match acceptance of every row's tree at once: one compiled pass on the host
over the target's choices, after the step's one copy from the device.

A row's accepted path descends from the root to the child whose token is the target's choice after
the current node, as long as there is one (drafters.tree.accept_greedy, for every row).
"""

from __future__ import annotations

import numba
import numpy as np


def accept_rows(tokens: np.ndarray, parents: np.ndarray, sizes: np.ndarray, choices: np.ndarray) -> list[list[int]]:
    """tokens, parents [B, T] int64 (drafters.DraftTree), sizes [B], choices [B, T] int64 (the target's
    choice after each node) -> each row's accepted path (node indices, root first)."""
    paths, lengths = _accept(tokens, parents, sizes, choices)
    return [row[:n] for row, n in zip(paths.tolist(), lengths.tolist())]


@numba.njit(cache=True)
def _accept(tokens, parents, sizes, choices):
    batch, width = tokens.shape
    paths = np.zeros((batch, width), np.int64)
    lengths = np.ones(batch, np.int64)
    for b in range(batch):
        node, length = 0, 1
        while True:
            wanted, found = choices[b, node], -1
            for i in range(node + 1, sizes[b]):  # children come after their parent
                if parents[b, i] == node and tokens[b, i] == wanted:
                    found = i
                    break
            if found < 0:
                break
            paths[b, length] = found
            length += 1
            node = found
        lengths[b] = length
    return paths, lengths
