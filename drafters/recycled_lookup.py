"""Prompt lookup and Token Recycling for every row of a batch at once, with array ops.

One `RecycledLookup` drafts a batch's rows each step with two compiled calls (drafters.kernels):
prompt lookup's branches for every row from the rows' histories, then every row's best-first tree
over those branches and Token Recycling's shared table (token_recycling.SuccessorTable). A row's
tree is the one its own sessions and `drafters.tree.build_tree` would build; its acceptance
estimates are its own (`RowRates`), as with one session per row. What it learns from a verify step
(the table's rows, the rates) is written for all rows with array operations.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from .base import Combined, Drafter, RowsDrafting, TargetForward, VerifiedRows
from .prompt_lookup import DEFAULT_PRIOR as LOOKUP_DEFAULT
from .prompt_lookup import MAX_MATCH, PromptLookup, lookup_branches
from .prompt_lookup import PRIORS as LOOKUP_PRIORS
from .token_recycling import DEFAULT_PRIOR as RECYCLING_DEFAULT
from .token_recycling import PRIORS as RECYCLING_PRIORS
from .token_recycling import SuccessorTable, TokenRecycling
from .tree_rows import TreeRows


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

    def sync(self, histories: Sequence[Sequence[int]]) -> None:
        longest = max(map(len, histories))
        if longest > self.tokens.shape[1]:
            grow = max(longest, 2 * self.tokens.shape[1]) - self.tokens.shape[1]
            self.tokens = np.pad(self.tokens, ((0, 0), (0, grow)), constant_values=-1)
        for b, history in enumerate(histories):
            n = int(self.lengths[b])
            if len(history) > n:
                self.tokens[b, n : len(history)] = history[n:]
                self.lengths[b] = len(history)

    def keep(self, rows: Sequence[int]) -> None:
        self.tokens, self.lengths = self.tokens[list(rows)], self.lengths[list(rows)]


class RecycledLookup(RowsDrafting):
    """Prompt lookup, Token Recycling or both, drafting all rows of a batch at once (module docstring).

    Stats keys: Token Recycling's token-table ranks 0 .. k - 1, its pair-table ranks k .. 2k - 1, then
    prompt lookup's match lengths 2k + 1 .. 2k + MAX_MATCH."""

    def __init__(self, prompts: Sequence[Sequence[int]], prefills: Sequence[TargetForward],
                 lookup: PromptLookup | None = None, recycling: TokenRecycling | None = None,
                 table: SuccessorTable | None = None):  # fmt: skip
        self.lookup, self.recycling = lookup, recycling
        self.histories = _Histories(prompts)
        k = recycling.top_k if recycling is not None else 0
        self.key_base = 2 * k  # prompt lookup's keys start here
        priors = [RECYCLING_PRIORS.get((table_name, r), RECYCLING_DEFAULT) for table_name in ("tok", "ctx") for r in range(k)]
        priors += [LOOKUP_PRIORS.get(n, LOOKUP_DEFAULT) for n in range(MAX_MATCH + 1)]
        self.rates = RowRates(np.array(priors), len(prompts))
        self.table = None
        if recycling is not None:
            self.table = table if table is not None else recycling.new_memory()
            for prompt, prefill in zip(prompts, prefills, strict=True):
                self.table.write_prompt(prompt, prefill.topk)

    def draft(self, histories, max_nodes, max_depths) -> TreeRows:
        from . import kernels  # compiled on first use

        self.histories.sync(histories)
        tokens, lengths = self.histories.tokens, self.histories.lengths
        rows = np.arange(len(histories))
        roots = tokens[rows, lengths - 1]
        previous = np.where(lengths > 1, tokens[rows, np.maximum(lengths - 2, 0)], -1)
        rates = self.rates.rates()  # [B, K]
        if self.lookup is not None:
            branches, matched = lookup_branches(tokens, lengths, self.lookup)
        else:
            branches, matched = np.zeros((len(rows), 0, 1), dtype=np.int64), np.zeros((len(rows), 0), dtype=np.int64)
        k = self.key_base // 2
        table = self.table if self.table is not None else _NO_TABLE
        built = kernels.build_trees(roots, previous, branches, matched, rates[:, self.key_base :], self.key_base,
                                    table.by_token, table.pair_keys, table.by_pair, rates[:, :k], rates[:, k : 2 * k],
                                    max_nodes, np.asarray(max_depths, dtype=np.int64), MAX_MATCH)  # fmt: skip
        tokens, parents, origins, scores, sizes, ancestors = built
        n = int(sizes.max())
        return TreeRows(tokens[:, :n], parents[:, :n], scores[:, :n], sizes, ancestors[:, :n, :n], origins=origins[:, :n])

    def observe(self, trees: TreeRows, verified: VerifiedRows, paths, histories) -> None:
        from . import kernels  # compiled on first use

        lengths = np.array([len(p) for p in paths], dtype=np.int64)
        flat = np.fromiter(itertools.chain.from_iterable(paths), dtype=np.int64, count=int(lengths.sum()))
        table = self.table if self.table is not None else _NO_TABLE
        if self.table is not None:
            self.table.reserve(int(trees.tokens.max()))
        tokens, ends = self.histories.tokens, self.histories.lengths  # synced by draft: each row ends at its root
        root_previous = np.where(ends > 1, tokens[np.arange(len(paths)), np.maximum(ends - 2, 0)], -1)
        kernels.learn(trees.tokens, trees.parents, trees.origins, trees.sizes, flat, lengths, root_previous,
                      verified.topk.numpy(), self.rates.tried, self.rates.accepted, table.by_token, table.pair_keys,
                      table.by_pair)  # fmt: skip

    def keep(self, rows) -> None:
        self.histories.keep(rows)
        self.rates.keep(rows)


class _NoTable:
    by_token = np.zeros((0, 1), dtype=np.int64)
    pair_keys = np.full(1, -1, dtype=np.int64)
    by_pair = np.full((1, 1), -1, dtype=np.int64)


_NO_TABLE = _NoTable()


def rows_drafting(drafter: Drafter, prompts: Sequence[Sequence[int]], prefills: Sequence[TargetForward],
                  memory=None, draft=None, seeds: Sequence[int] = (), drafting_row=None) -> RowsDrafting:  # fmt: skip
    """The drafting of a batch with `drafter` (Drafter.rows' arguments): prompt lookup, Token Recycling
    or their combination draft every row at once (RecycledLookup); any other drafter, its `rows`."""
    members, memories = (drafter.drafters, memory) if isinstance(drafter, Combined) else ((drafter,), (memory,))
    rows = recycled_lookup(members, prompts, prefills, memories)
    return rows if rows is not None else drafter.rows(prompts, prefills, memory, draft, seeds, drafting_row)


def recycled_lookup(drafters: Sequence, prompts, prefills, memory) -> RecycledLookup | None:
    """The array form of a combination of at most one PromptLookup and one TokenRecycling (memory:
    Combined's memories in the drafters' order); None for any other combination."""
    lookups = [d for d in drafters if type(d) is PromptLookup]
    recyclings = [(d, m) for d, m in zip(drafters, memory or (None,) * len(drafters)) if type(d) is TokenRecycling]
    if len(lookups) + len(recyclings) != len(drafters) or len(lookups) > 1 or len(recyclings) > 1:
        return None
    recycling, table = recyclings[0] if recyclings else (None, None)
    return RecycledLookup(prompts, prefills, lookup=lookups[0] if lookups else None, recycling=recycling, table=table)
