"""ADED (Liu et al., 2024; "Adaptix" at AAAI 2025): draft from a tri-gram table that adapts to what the
model writes, with a Monte-Carlo tree search that balances likely and unexplored continuations.

The table (`TrigramTable`, the drafter's memory across the generations of a program) maps a token pair
(a, b) to at most `successors` next tokens c with weights. ADED builds it from a corpus (P(c | a, b),
the 12 likeliest c per pair; `TrigramTable.from_corpus`) and, every step, adds `bump` (capped at `cap`)
to each tri-gram of the sequence's last `window` tokens: the model's own text outweighs the corpus.
Drafting a row: `iterations` rounds of search from its last pair. A round descends by pUCT, Q + (c1 +
ln((N + c2 + 1) / c2)) * p * sqrt(N) / (1 + n), unvisited children first (p: the child's weight, N and n:
the visits of the node and child), expands a leaf into all its successors and steps into the last,
rolls out by drawing successors in proportion to their weights until the path holds `depth` tokens,
and backs up 1 + the sum of the weights along it. The `paths` most visited nodes' root paths, each
extended by its heaviest successor, are the row's chains, likeliest first; the builder merges them
into one tree. Parameters are the paper code's (12, 16, 0.04, 3.0, 150, 4, 24, c1 = 32, c2 = 8). Without a
corpus (`Aded.corpus`) a row's prompt seeds the table once; the paper's code bumps only the last 16
tokens of the prompt and relies on the corpus for the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .base import Drafter, check_params
from .contract import Chains, ChainSource, DraftSession
from .chains import ChainSession
from ..common.errors import InvalidParameterError


PRIOR = 0.4  # each depth's acceptance rate before a verify step is seen (then measured per row)


class TrigramTable:
    """(a, b) -> {c: weight}, at most `successors` c per pair (the heaviest kept)."""

    def __init__(self, successors: int = 12):
        self.successors = successors
        self.rows: dict[tuple[int, int], dict[int, float]] = {}

    @classmethod
    def from_corpus(cls, sequences: Iterable[Sequence[int]], successors: int = 12) -> TrigramTable:
        """ADED's offline table: P(c | a, b) over the corpus's tri-grams, each pair's `successors`
        likeliest c (not renormalised after the cut, as the paper's code loads it)."""
        counts: dict[tuple[int, int], dict[int, int]] = {}
        for sequence in sequences:
            tokens = list(sequence)
            for a, b, c in zip(tokens, tokens[1:], tokens[2:]):
                row = counts.setdefault((a, b), {})
                row[c] = row.get(c, 0) + 1
        table = cls(successors)
        for pair, row in counts.items():
            total = sum(row.values())
            best = sorted(row.items(), key=lambda item: (-item[1], item[0]))[:successors]
            table.rows[pair] = {c: n / total for c, n in best}
        return table

    def copy(self) -> TrigramTable:
        table = TrigramTable(self.successors)
        table.rows = {pair: dict(row) for pair, row in self.rows.items()}
        return table

    def bump(self, tokens: Sequence[int], amount: float, cap: float) -> None:
        """Each tri-gram of `tokens` gains `amount`, up to `cap`; a new successor of a full pair replaces
        the lightest one if it outweighs it."""
        for a, b, c in zip(tokens, tokens[1:], tokens[2:]):
            row = self.rows.setdefault((a, b), {})
            if c in row:
                row[c] = min(row[c] + amount, cap)
            elif len(row) < self.successors:
                row[c] = min(amount, cap)
            else:
                lightest = min(row, key=row.get)
                if row[lightest] < amount:
                    del row[lightest]
                    row[c] = min(amount, cap)

    def successors_of(self, a: int, b: int) -> dict[int, float]:
        return self.rows.get((a, b), {})


@dataclass(frozen=True)
class Aded(Drafter):
    """successors: tokens kept per pair; window / bump / cap: the update (module docstring); iterations,
    depth, paths, c1, c2: the search; corpus: a table to start every program from (None: empty, the
    prompt and the generations fill it)."""

    successors: int = 12
    window: int = 16
    bump: float = 0.04
    cap: float = 3.0
    iterations: int = 150
    depth: int = 4
    paths: int = 24
    c1: float = 32.0
    c2: float = 8.0
    corpus: TrigramTable | None = None

    def __post_init__(self):
        check_params("Aded", successors=self.successors, window=self.window, iterations=self.iterations,
                     depth=self.depth, paths=self.paths)  # fmt: skip
        for name in ("bump", "cap", "c1", "c2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < math.inf:
                raise InvalidParameterError(f"Aded.{name} must be a finite number > 0, got {value!r}")
        if self.window < 3:
            raise InvalidParameterError(f"Aded.window must hold a tri-gram (>= 3 tokens), got {self.window}")
        if self.corpus is not None and not isinstance(self.corpus, TrigramTable):
            raise InvalidParameterError(f"Aded.corpus must be a TrigramTable or None, got {type(self.corpus).__name__}")

    def new_memory(self) -> TrigramTable:
        return self.corpus.copy() if self.corpus is not None else TrigramTable(self.successors)

    def start(self, prompt: Sequence[int], prefill, memory=None, draft=None, seed=0) -> DraftSession:
        return ChainSession(self.rows_source(memory))

    def rows_source(self, memory=None) -> ChainSource:
        return AdedChains(self, memory if memory is not None else self.new_memory())


class AdedChains(ChainSource):
    """Every row's most visited search paths as chains (drafters.chains); a token's stats key is its depth
    in the chain, the m-th chain's first token divided by 1 + m (its rank by visits)."""

    def __init__(self, config: Aded, table: TrigramTable):
        self.config, self.table = config, table
        self.priors = np.full(config.depth + 1, PRIOR)
        self.seen: list[int] = []  # per row: the tokens its updates have covered

    def chains(self, history: np.ndarray, lengths: np.ndarray) -> Chains:
        config = self.config
        rows = history.shape[0]
        while len(self.seen) < rows:
            self.seen.append(0)
        tokens = np.full((rows, config.paths, config.depth + 1), -1, dtype=np.int64)
        for b in range(rows):
            length = int(lengths[b])
            start = 0 if self.seen[b] == 0 else max(0, length - config.window)  # a new row: its whole prompt
            self.table.bump(history[b, start:length].tolist(), config.bump, config.cap)
            self.seen[b] = length
            if length < 2:
                continue
            a, c = int(history[b, length - 2]), int(history[b, length - 1])
            rng = np.random.default_rng(length)  # the same row and history: the same search
            for m, path in enumerate(search(self.table, a, c, config, rng)):
                tokens[b, m, : len(path)] = path
        keys = np.broadcast_to(np.arange(config.depth + 1), tokens.shape)
        divisors = np.broadcast_to(1.0 + np.arange(config.paths), (rows, config.paths))
        return Chains(tokens, keys, divisors)

    def keep(self, rows: Sequence[int]) -> None:
        self.seen = [self.seen[i] for i in rows]


def search(table: TrigramTable, a: int, b: int, config: Aded, rng: np.random.Generator) -> list[list[int]]:
    """The `paths` most visited nodes' token paths below the root pair (a, b), each extended by its
    heaviest successor, most visited first (module docstring)."""
    token, pair, parent, prior, depth = [b], [(a, b)], [-1], [1.0], [0]
    visits, value = [0], [0.0]
    children: list[list[int] | None] = [None]
    for _ in range(config.iterations):
        node, path = 0, [0]
        while children[node] and depth[node] < config.depth:  # select
            total = visits[node]
            scale = (config.c1 + math.log((total + config.c2 + 1) / config.c2)) * math.sqrt(total)
            best, best_score = -1, -math.inf
            for child in children[node]:
                if visits[child] == 0:
                    best = child
                    break
                score = value[child] / visits[child] + scale * prior[child] / (1 + visits[child])
                if score > best_score:
                    best, best_score = child, score
            node = best
            path.append(node)
        if children[node] is None and depth[node] < config.depth:  # expand: every successor, step into the last
            successors = table.successors_of(*pair[node])
            children[node] = []
            for c, weight in successors.items():
                children[node].append(len(token))
                token.append(c)
                pair.append((pair[node][1], c))
                parent.append(node)
                prior.append(weight)
                depth.append(depth[node] + 1)
                visits.append(0)
                value.append(0.0)
                children.append(None)
            if children[node]:
                node = children[node][-1]
                path.append(node)
        reward = 1.0 + sum(prior[n] for n in path[1:])
        state, steps = pair[node], depth[node]
        while steps < config.depth:  # roll out: successors drawn by weight
            successors = table.successors_of(*state)
            if not successors:
                break
            left = rng.random() * sum(successors.values())  # one uniform, walked through the weights
            for c, weight in successors.items():
                left -= weight
                if left <= 0.0:
                    break
            reward += successors[c]
            state, steps = (state[1], c), steps + 1
        for n in path:  # back up
            visits[n] += 1
            value[n] += reward
    ranked = sorted(range(1, len(token)), key=lambda n: (-visits[n], n))
    out: list[list[int]] = []
    for n in ranked:
        if visits[n] == 0 or len(out) == config.paths:
            break
        path, node = [], n
        while node > 0:
            path.append(token[node])
            node = parent[node]
        path.reverse()
        nxt = table.successors_of(*pair[n])
        if nxt:
            path.append(max(nxt, key=lambda c: (nxt[c], -c)))
        if path not in out:
            out.append(path)
    return out
