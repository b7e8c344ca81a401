"""The build-time check that a program computes one function: a token's logits (and the K/V it writes)
come out bit for bit the same whatever else its step holds.

Through the program's own `forward` and `compact` (the commit's compaction, without the rewrites' hooks)
on its own cache, with random tokens: a prompt fed whole, in two pieces and its last tokens one at a time
(logits, committed cache entries); a random tree over it, some nodes each against the same token decoded
alone (ancestors committed into consecutive slots, then a one-token forward); for programs of several
rows, two prompts of other lengths prefilled and verified together against each alone. Compared with
`torch.equal`, no tolerance: a lowering whose kernels depend on the rest of the call fails
(tests/test_invariance.py injects one). The check leaves the cache's contents undefined; a generation's
prefill overwrites what it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ir.layout import SlotLayout

PROMPT = 45  # tokens of the first prompt (odd, and large enough that elementwise ops split it over threads)
OTHER_PROMPT = 6  # of the second row's prompt
TREE_NODES = 11
ALONE_NODES = 4  # tree nodes compared with their one-token forward


@dataclass(frozen=True)
class InvarianceCheck:
    """What the check compared (tokens whose logits were compared) and what differed (empty: passed)."""

    compared: int
    differences: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.differences

    cases: tuple[str, ...] = ("prompt pieces", "tree nodes alone")

    def __str__(self) -> str:
        if self.passed:
            return f"bit for bit on {self.compared} tokens ({', '.join(self.cases)})"
        return f"{len(self.differences)} difference(s) in {self.compared} tokens: " + "; ".join(self.differences)


def check_invariance(program, seed: int = 0) -> InvarianceCheck:
    """Run the module docstring's cases on `program` (a backends.runtime.program.DecodeProgram) and
    report what differed."""
    run = _Runner(program, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        run.pieces()
        tree_logits = run.tree()
        if program.rows > 1:
            run.rows(tree_logits)
    cases = ("prompt pieces", "tree nodes alone", *(("rows",) if program.rows > 1 else ()))
    return InvarianceCheck(run.compared, tuple(run.differences), cases)


class _Runner:
    def __init__(self, program, gen: torch.Generator):
        self.program, self.gen = program, gen
        step = program.hooks.max_step
        room = program.cache_size if step is None else min(program.cache_size, step)
        self.prompt = min(PROMPT, max(2, program.cache_size // 3), room)
        self.nodes = max(1, min(TREE_NODES, program.max_nodes, room, program.cache_size - self.prompt))
        self.tokens = self._tokens(self.prompt)
        self.parents = self._parents(self.nodes)
        self.tree_tokens = self._tokens(self.nodes)
        self.compared = 0
        self.differences: list[str] = []

    def _tokens(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.program.vocab_size, (n,), generator=self.gen)

    def _parents(self, n: int) -> list[int]:
        """A random tree of n nodes, parents before children; a chain where the step verifies no trees."""
        if not self.program.verifies_trees:
            return list(range(-1, n - 1))
        draws = torch.randint(0, 2**16, (n,), generator=self.gen).tolist()
        return [-1] + [i - 1 if draws[i] % 2 else draws[i] // 2 % i for i in range(1, n)]

    def forward(self, tokens: list[torch.Tensor], rows: list[SlotLayout]) -> torch.Tensor:
        layout = SlotLayout.of(rows)
        return self.program.forward(layout.pad_tokens(tokens), layout)[0].cpu()  # [B, T, V]

    def commit(self, rows: list[SlotLayout], paths: list[list[int]]) -> None:
        self.program.compact(SlotLayout.of(rows), paths)

    def committed_cache(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(c[:, 0, :, :slots].cpu() for c in self.program.kv_buffers())

    def compare(self, what: str, got: torch.Tensor, expected: torch.Tensor, tokens: int) -> None:
        self.compared += tokens
        if not torch.equal(got, expected):
            differing = (got != expected).flatten(1).any(-1).sum() if got.dim() > 1 else 1
            gap = (got.float() - expected.float()).abs().max().item()
            self.differences.append(f"{what}: {int(differing)} differ, by up to {gap:.3g}")

    def pieces(self) -> None:
        n = self.prompt
        layout = SlotLayout.chain(0, n)
        whole = self.forward([self.tokens], [layout])[0]  # [n, V]
        self.commit([layout], [list(range(n))])
        self.prompt_logits, cache = whole, self.committed_cache(n)
        splits = [(n // 2 + 1, n - n // 2 - 1), (n - 3, 1, 1, 1)] if n > 4 else [(1,) * n]
        for split in splits:
            start, parts = 0, []
            for size in split:
                piece = SlotLayout.chain(start, size)
                parts.append(self.forward([self.tokens[start : start + size]], [piece])[0])
                self.commit([piece], [list(range(size))])
                start += size
            self.compare(f"prompt in pieces {split}, logits", torch.cat(parts), whole, n)
            for name, got, expected in zip("KV", self.committed_cache(n), cache):
                self.compare(f"prompt in pieces {split}, {name} cache", got, expected, 0)

    def tree(self) -> torch.Tensor:
        """The tree over the prompt (committed in row 0 by `pieces`); returns its logits [N, V]."""
        c, n = self.prompt, self.nodes
        layout = _tree_layout(c, self.parents)
        logits = self.forward([self.tree_tokens], [layout])[0]  # [N, V]
        depths = (layout.ancestors[0].sum(-1) - 1).tolist()
        deepest = max(range(n), key=depths.__getitem__)
        picks = sorted({0, deepest, *torch.randperm(n, generator=self.gen)[: ALONE_NODES - 2].tolist()})
        for node in picks:
            path = _path(self.parents, node)
            if node:  # the tree verified again (its K/V are the step's), its ancestors committed
                self.forward([self.tree_tokens], [layout])
                self.commit([layout], [path[:-1]])
            d = len(path) - 1
            alone = self.forward([self.tree_tokens[node : node + 1]], [SlotLayout.chain(c + d, 1)])[0, 0]
            self.compare(f"tree node {node} (depth {d}) against its one-token forward, logits", alone, logits[node], 1)
        return logits

    def rows(self, tree_logits: torch.Tensor) -> None:
        """Row 0: the prompt and tree above; row 1: another prompt and tree. Each alone in row 0, then
        both in one prefill and one tree forward."""
        other = self._tokens(min(OTHER_PROMPT, self.prompt - 1))
        other_parents = self._parents(max(1, self.nodes - 3))
        other_tree = self._tokens(len(other_parents))
        m, n = other.shape[0], self.prompt
        other_prompt = self.forward([other], [SlotLayout.chain(0, m)])[0]
        self.commit([SlotLayout.chain(0, m)], [list(range(m))])
        other_logits = self.forward([other_tree], [_tree_layout(m, other_parents)])[0]
        prefill = [SlotLayout.chain(0, n), SlotLayout.chain(0, m)]
        both_prompts = self.forward([self.tokens, other], prefill)
        self.commit(prefill, [list(range(n)), list(range(m))])
        self.compare("row 0 of a prefill of two rows, logits", both_prompts[0], self.prompt_logits, n)
        self.compare("row 1 of a prefill of two rows, logits", both_prompts[1, :m], other_prompt, m)
        both = self.forward([self.tree_tokens, other_tree], [_tree_layout(n, self.parents), _tree_layout(m, other_parents)])
        self.compare("row 0 of a tree forward of two rows, logits", both[0, : self.nodes], tree_logits, self.nodes)
        self.compare("row 1 of a tree forward of two rows, logits", both[1, : len(other_parents)], other_logits,
                     len(other_parents))  # fmt: skip


def _tree_layout(committed: int, parents: list[int]) -> SlotLayout:
    n = len(parents)
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            ancestors[i] = ancestors[p]
        ancestors[i, i] = True
    return SlotLayout.tree(committed, ancestors)


def _path(parents: list[int], node: int) -> list[int]:
    """Root first, ending at `node`."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]
