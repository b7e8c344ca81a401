"""Drafting every row of a batch at once: chain sources and Token Recycling's table, one compiled builder.

A drafter takes part by its `rows_source` (drafters.base): a `ChainSource` gives, each step, every
row's candidate chains with a stats key per token (prompt lookup: the continuations of earlier
occurrences, keyed by the match length they extend); Token Recycling gives its successor table
(successor_table.SuccessorSource). One `ChainDrafting` drafts a batch's rows each step with one
compiled call (drafters.kernels.build_trees): every row's best-first tree over all the chains, then the
table's successors, as `drafters.tree.build_tree` builds it over the same sources in that order (a
combination listing the table first ties otherwise, and stays lossless). Each row's acceptance
estimates are its own (`RowRates`); what a verify step teaches (the table, the rates) is written for
all rows with array operations. A combination with a member that has no rows source, or with two
tables, drafts row by row (drafters.base.Drafter.rows).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from .contract import Chains, ChainSource, DraftSession, RowsDrafting, TargetForward
from .stats import AcceptanceStats
from .successor_table import SuccessorSource
from .best_first import Candidate
from .tree import DraftTree


class RowRates:
    """Beta-smoothed acceptance rate per (row, key), from prior rates per key (drafters.stats for one row)."""

    def __init__(self, priors: np.ndarray, rows: int, strength: float = 8.0):
        self.priors = priors  # [K]
        self.strength = strength
        self.tried = np.zeros((rows, priors.shape[0]))  # [B, K]
        self.accepted = np.zeros((rows, priors.shape[0]))

    def rates(self) -> np.ndarray:
        """[B, K]"""
        return (self.accepted + self.priors * self.strength) / (self.tried + self.strength)

    def keep(self, rows: Sequence[int]) -> None:
        self.tried, self.accepted = self.tried[list(rows)], self.accepted[list(rows)]


class _Histories:
    """The rows' tokens in one padded array, appended to as the rows grow."""

    def __init__(self, prompts: Sequence[Sequence[int]]):
        span = max(64, 2 * max(map(len, prompts)))
        self.tokens = np.full((len(prompts), span), -1, dtype=np.int64)  # [B, S]
        self.lengths = np.zeros(len(prompts), dtype=np.int64)  # [B]
        self.known = [0] * len(prompts)  # lengths as Python ints: read every step, row by row

    def sync(self, histories: Sequence[Sequence[int]]) -> None:
        """Writes each row's tokens past its known length, all rows in one scatter (a step adds a few a row)."""
        ends = [len(h) for h in histories]
        if ends == self.known:
            return
        if max(ends) > self.tokens.shape[1]:
            grow = max(max(ends), 2 * self.tokens.shape[1]) - self.tokens.shape[1]
            self.tokens = np.pad(self.tokens, ((0, 0), (0, grow)), constant_values=-1)
        rows: list[int] = []
        columns: list[int] = []
        values: list[int] = []
        for b, (history, start, end) in enumerate(zip(histories, self.known, ends)):
            if end > start:
                rows += [b] * (end - start)
                columns += range(start, end)
                values += history[start:end]
        self.tokens[rows, columns] = values
        self.known = [max(k, e) for k, e in zip(self.known, ends)]
        self.lengths = np.array(self.known, dtype=np.int64)

    def keep(self, rows: Sequence[int]) -> None:
        self.tokens, self.lengths = self.tokens[list(rows)], self.lengths[list(rows)]
        self.known = [self.known[i] for i in rows]


class ChainDrafting(RowsDrafting):
    """Chain sources and at most one successor table drafting all rows of a batch at once (module
    docstring). Stats keys: the table's token ranks 0 .. k - 1 and pair ranks k .. 2k - 1, then each
    chain source's keys in turn. A step without drafting still teaches the table (`observe`)."""

    skips = True

    def __init__(self, prompts: Sequence[Sequence[int]], prefills: Sequence[TargetForward],
                 chains: Sequence[ChainSource], table: SuccessorSource | None = None):  # fmt: skip
        self.sources = list(chains)
        self.histories = _Histories(prompts)
        self.table = table.table if table is not None else None
        k = table.top_k if table is not None else 0
        priors = [table.priors()] if table is not None else []
        self.key_bases = []  # each chain source's first key
        start = 2 * k
        for source in self.sources:
            self.key_bases.append(start)
            priors.append(np.asarray(source.priors, dtype=np.float64))
            start += len(source.priors)
        self.table_ranks = k
        self.rates = RowRates(np.concatenate(priors) if priors else np.zeros(0), len(prompts))
        if self.table is not None:
            for prompt, prefill in zip(prompts, prefills, strict=True):
                self.table.write_prompt(prompt, prefill.topk)

    def draft(self, histories, max_nodes, max_depths) -> DraftTree:
        from . import kernels  # compiled on first use

        self.histories.sync(histories)
        tokens, lengths = self.histories.tokens, self.histories.lengths
        rows = np.arange(len(histories))
        roots = tokens[rows, lengths - 1]
        previous = np.where(lengths > 1, tokens[rows, np.maximum(lengths - 2, 0)], -1)
        chains = self._chains(tokens, lengths)
        table = self.table if self.table is not None else _NO_TABLE
        built = kernels.build_trees(roots, previous, chains.tokens, chains.keys, chains.divisors, self.rates.rates(),
                                    table.by_token, table.pair_keys, table.by_pair, max_nodes,
                                    np.asarray(max_depths, dtype=np.int64))  # fmt: skip
        tokens, parents, origins, scores, sizes, ancestors = built
        n = int(sizes.max())
        return DraftTree(tokens[:, :n], parents[:, :n], scores[:, :n], origins[:, :n], None, sizes, ancestors[:, :n, :n])

    def _chains(self, history: np.ndarray, lengths: np.ndarray) -> Chains:
        """Every source's chains side by side, their keys moved to the sources' places in the rates."""
        batch = history.shape[0]
        if not self.sources:
            return Chains(np.full((batch, 0, 1), -1, dtype=np.int64), np.zeros((batch, 0, 1), dtype=np.int64),
                          np.ones((batch, 0)))  # fmt: skip
        parts = [source.chains(history, lengths) for source in self.sources]
        if len(parts) == 1:  # the common case: no padding or concatenation
            tokens, keys, divisors = parts[0]
            return Chains(np.ascontiguousarray(tokens, dtype=np.int64),
                          np.ascontiguousarray(keys + self.key_bases[0], dtype=np.int64),
                          np.ascontiguousarray(divisors, dtype=np.float64))  # fmt: skip
        depth = max(p.tokens.shape[2] for p in parts)
        pad = lambda a, value: np.pad(a, ((0, 0), (0, 0), (0, depth - a.shape[2])), constant_values=value)  # noqa: E731
        tokens = np.concatenate([pad(p.tokens, -1) for p in parts], axis=1)  # [B, M, D]
        keys = np.concatenate([pad(p.keys + base, 0) for p, base in zip(parts, self.key_bases)], axis=1)
        divisors = np.concatenate([p.divisors for p in parts], axis=1)  # [B, M]
        return Chains(np.ascontiguousarray(tokens, dtype=np.int64), np.ascontiguousarray(keys, dtype=np.int64),
                      np.ascontiguousarray(divisors, dtype=np.float64))  # fmt: skip

    def observe(self, trees: DraftTree, verified: TargetForward, paths, histories) -> None:
        from . import kernels  # compiled on first use

        lengths = np.fromiter(map(len, paths), dtype=np.int64, count=len(paths))
        flat = np.fromiter(itertools.chain.from_iterable(paths), dtype=np.int64, count=int(lengths.sum()))
        table = self.table if self.table is not None else _NO_TABLE
        origins = trees.origins if trees.origins is not None else np.full(trees.tokens.shape, -1, dtype=np.int64)
        if self.table is not None:
            self.table.reserve(int(trees.tokens.max()))
        # each history ends at its tree's root; the rows' arrays catch up at the next draft (a plain step has none)
        root_previous = np.fromiter((h[-2] if len(h) > 1 else -1 for h in histories), dtype=np.int64, count=len(paths))
        kernels.learn(trees.tokens, trees.parents, origins, trees.sizes, flat, lengths, root_previous,
                      verified.topk.numpy(), self.rates.tried, self.rates.accepted, table.by_token, table.pair_keys,
                      table.by_pair)  # fmt: skip

    def keep(self, rows) -> None:
        self.histories.keep(rows)
        self.rates.keep(rows)
        for source in self.sources:
            source.keep(rows)


class ChainSession(DraftSession):
    """One row drafted from a chain source by the per-row builder (drafters.tree.build_tree), when its
    drafter is combined with one that has no rows source: the same candidates, scores and stats keys
    as the row gets in a ChainDrafting."""

    def __init__(self, source: ChainSource):
        self.source = source
        self.stats = AcceptanceStats(dict(enumerate(np.asarray(source.priors).tolist())), default=0.0)

    def candidates(self, tokens: Sequence[int]) -> _ChainCandidates:
        history = np.asarray(tokens, dtype=np.int64)[None, :]  # [1, S]
        chains = self.source.chains(history, np.array([history.shape[1]]))
        return _ChainCandidates(chains.tokens[0], chains.keys[0], chains.divisors[0], self.stats)


class _ChainCandidates:
    """A row's chains as a CandidateSource: a candidate's state is (chain, offset)."""

    def __init__(self, tokens: np.ndarray, keys: np.ndarray, divisors: np.ndarray, stats: AcceptanceStats):
        self.tokens, self.keys, self.divisors = tokens.tolist(), keys.tolist(), divisors.tolist()  # [M, D], [M, D], [M]
        self.stats = stats

    def _at(self, chain: int, offset: int) -> list[Candidate]:
        """The chain's token at `offset` (none past its end)."""
        if offset >= len(self.tokens[chain]) or self.tokens[chain][offset] < 0:
            return []
        key = self.keys[chain][offset]
        rate = self.stats.rate(key)
        prob = rate / self.divisors[chain] if offset == 0 else rate
        return [Candidate(self.tokens[chain][offset], prob, key, (chain, offset))]

    def root_candidates(self) -> list[Candidate]:
        return [c for m in range(len(self.tokens)) for c in self._at(m, 0)]

    def child_candidates(self, token: int, state) -> list[Candidate]:
        chain, offset = state
        return self._at(chain, offset + 1)


class _NoTable:
    by_token = np.zeros((0, 1), dtype=np.int64)
    pair_keys = np.full(1, -1, dtype=np.int64)
    by_pair = np.full((1, 1), -1, dtype=np.int64)


_NO_TABLE = _NoTable()


def drafting_at_once(sources: Sequence, prompts: Sequence[Sequence[int]], prefills: Sequence[TargetForward]
                     ) -> ChainDrafting | None:  # fmt: skip
    """A ChainDrafting over the members' rows sources (drafters.base.Drafter.rows_source, in the
    members' order), or None where a member has none or two are tables."""
    if not sources or any(s is None for s in sources):
        return None
    tables = [s for s in sources if isinstance(s, SuccessorSource)]
    if len(tables) > 1:
        return None
    return ChainDrafting(prompts, prefills, [s for s in sources if not isinstance(s, SuccessorSource)],
                         tables[0] if tables else None)  # fmt: skip
