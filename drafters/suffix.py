"""Suffix drafting (SuffixDecoding): continuations of the longest match of the sequence's last tokens in a
suffix trie over the current prompt and output and earlier generations of the same program.

The trie is cut at `depth` tokens: every substring of up to `depth` tokens of every stored sequence is a
path from the root, each node counting its occurrences. It grows online (a new token extends the at most
`depth` substrings ending at it) and shrinks the same way when the oldest sequence is evicted (past
`max_tokens`); it is the drafter's memory across generations, as Token Recycling's table is. Drafting:
match the longest suffix (up to `max_match` tokens), then grow the tree through the matched node's
children, each scored by count(child) / count(node), at most `max_spec_factor` x the match length deep.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .base import Drafter, check_params
from .contract import DraftSession, TargetForward
from .stats import AcceptanceStats
from .best_first import Candidate
from .tree import DraftTree

# P(accepted | parent accepted) per match length, before any verify step is seen (then measured).
_PRIORS = {1: 0.3, 2: 0.5, 3: 0.65, 4: 0.75}


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Substrings of up to `depth` tokens of the stored sequences, with their occurrence counts.

    Invariant: a node's count is the number of (sequence, start) pairs whose substring is the node's
    path; sequences are appended token by token (`Writer`) and evicted oldest first past `max_tokens`.
    """

    def __init__(self, depth: int, max_tokens: int):
        self.depth = depth
        self.max_tokens = max_tokens
        self.root = _Node()
        self.writers: deque[Writer] = deque()  # the stored sequences' writers, oldest first (live ones too)
        self.tokens = 0

    def _add(self, active: list[_Node], token: int, delta: int) -> list[_Node]:
        """Extends each substring ending at the previous token (its node in `active`, shortest first,
        the root standing for the empty one) by `token`; returns the nodes of those ending at `token`."""
        extended = []
        for node in [self.root, *active][: self.depth]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += delta
            if child.count == 0:
                del node.children[token]
            extended.append(child)
        return extended

    def writer(self) -> Writer:
        """A new stored sequence, written token by token."""
        writer = Writer(self)
        self.writers.append(writer)
        return writer

    def _evict_oldest(self) -> None:
        """Removes the oldest sequence's substrings; a live one (a batch row still decoding) stops storing."""
        writer = self.writers.popleft()
        active: list[_Node] = []
        for token in writer.sequence:
            active = self._add(active, token, -1)
        self.tokens -= len(writer.sequence)
        writer.evicted = True

    def match(self, tokens: Sequence[int], max_match: int) -> tuple[int, _Node | None]:
        """(n, node): the longest suffix of `tokens` (n <= max_match tokens) that occurs with a
        continuation in the trie, and its node; (0, None) when not even the last token does."""
        for n in range(min(max_match, self.depth - 1, len(tokens)), 0, -1):
            node = self.root
            for token in tokens[len(tokens) - n :]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:
                return n, node
        return 0, None

    def continuations(self, pattern: Sequence[int]) -> dict[int, int]:
        """{next token: how often `pattern` is followed by it} over the stored sequences."""
        node = self.root
        for token in pattern:
            node = node.children.get(token)
            if node is None:
                return {}
        return {token: child.count for token, child in node.children.items()}


class Writer:
    """Appends one sequence to the trie, token by token (evicting the oldest sequences past the limit)."""

    def __init__(self, trie: SuffixTrie):
        self.trie = trie
        self.sequence: list[int] = []
        self.active: list[_Node] = []  # nodes of the substrings ending at the last token, shortest first
        self.evicted = False  # once evicted, the sequence is only followed (its counts are gone)

    def extend(self, tokens: Sequence[int]) -> None:
        trie = self.trie
        for token in tokens:
            if not self.evicted:
                self.active = trie._add(self.active, token, +1)
                trie.tokens += 1
            self.sequence.append(token)
        while trie.tokens > trie.max_tokens and trie.writers[0] is not self:
            trie._evict_oldest()


@dataclass(frozen=True)
class Suffix(Drafter):
    """max_match: the longest suffix matched; depth: the trie's substring length (match + continuation);
    max_spec_factor: a match of n tokens drafts at most factor * n deep; max_branches: children tried
    per node; max_tokens: tokens stored across generations (the oldest generations evicted first)."""

    max_match: int = 8
    depth: int = 16
    max_spec_factor: int = 2
    max_branches: int = 3
    max_tokens: int = 1 << 14

    def __post_init__(self):
        check_params("Suffix", max_match=self.max_match, depth=self.depth, max_spec_factor=self.max_spec_factor,
                     max_branches=self.max_branches, max_tokens=self.max_tokens)  # fmt: skip
        if self.depth <= self.max_match:
            from ..common.errors import InvalidParameterError

            raise InvalidParameterError(f"Suffix.depth {self.depth} must exceed max_match {self.max_match}")

    def new_memory(self) -> SuffixTrie:
        return SuffixTrie(self.depth, self.max_tokens)

    def start(self, prompt: Sequence[int], prefill: TargetForward, memory=None, draft=None, seed=0) -> DraftSession:
        trie = memory if memory is not None else self.new_memory()
        return SuffixSession(self, trie, prompt)


class SuffixSession(DraftSession):
    def __init__(self, config: Suffix, trie: SuffixTrie, prompt: Sequence[int]):
        self.config, self.trie = config, trie
        self.stats = AcceptanceStats(_PRIORS, default=0.8)
        self.writer = trie.writer()
        self.writer.extend(prompt)

    def _sync(self, tokens: Sequence[int]) -> None:
        """Stores the tokens committed since the last call (`tokens` extends what was written)."""
        written = len(self.writer.sequence)
        if len(tokens) > written:
            self.writer.extend(tokens[written:])

    def candidates(self, tokens: Sequence[int]):
        self._sync(tokens)
        n, node = self.trie.match(tokens, self.config.max_match)
        return _Continuations(node, n, min(self.config.max_spec_factor * n, self.config.depth - n), self)

    def observe(self, tree: DraftTree, verified: TargetForward, path: Sequence[int], tokens: Sequence[int]) -> None:
        """Stores the accepted tokens and the target's next choice, so a match can use them at once."""
        self._sync(tokens)
        self.writer.extend([*tree.tokens[list(path[1:])].tolist(), int(verified.choices[path[-1]])])


class _Continuations:
    """A tree's view of the matched node: each child a candidate, scored by its relative frequency."""

    def __init__(self, node: _Node | None, match: int, max_depth: int, session: SuffixSession):
        self.node, self.max_depth = node, max_depth
        self.key = min(match, max(_PRIORS))  # the acceptance stats' key: the match length, capped
        self.rate = session.stats.rate(self.key)
        self.branches = session.config.max_branches

    def _children(self, node: _Node, depth: int) -> list[Candidate]:
        if depth >= self.max_depth or not node.children:
            return []
        total = sum(child.count for child in node.children.values())
        best = sorted(node.children.items(), key=lambda kv: -kv[1].count)[: self.branches]
        return [Candidate(token, self.rate * child.count / total, self.key, (child, depth + 1)) for token, child in best]

    def root_candidates(self) -> list[Candidate]:
        return [] if self.node is None else self._children(self.node, 0)

    def child_candidates(self, token: int, state) -> list[Candidate]:
        node, depth = state
        return self._children(node, depth)
