"""Drafters: a frozen config that drafts a batch's rows (`rows`), at once where every member has a rows
source (drafters.chains), else row by row through sessions and the best-first builder."""

from __future__ import annotations

import contextlib
from abc import ABC
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .chains import ChainSession, drafting_at_once
from .contract import ChainSource, DraftModel, DraftSession, RowsDrafting, TargetForward
from .best_first import build_tree
from .tree import DraftTree
from ..common.errors import InvalidParameterError


class Drafter(ABC):
    """A drafting method's parameters (a frozen dataclass); `start` opens a session for one prompt.

    A drafter may also keep a memory across the generations of one program (`new_memory`): Token
    Recycling's successor table is inherited from query to query, as in the paper ("hot start").
    """

    def new_memory(self) -> Any:
        """A fresh cross-generation memory for this drafter (None: it keeps nothing)."""
        return None

    @property
    def target_topk(self) -> int:
        """How many of the target's top next tokens per position the drafter reads (`TargetForward.topk`)."""
        return 8

    @property
    def draws(self) -> bool:
        """True when every candidate is drawn from a draft law (tree.Drawn): the decode loop then
        accepts by the multi-candidate rule when it samples (backends.runtime.multi_candidate)."""
        return False

    def start(
        self, prompt: Sequence[int], prefill: TargetForward, memory: Any = None, draft: DraftModel | None = None,
        seed: int = 0,
    ) -> DraftSession:  # fmt: skip
        """One row's session. prefill: the target's forward over the prompt; memory: what `new_memory`
        made, carried over from earlier generations (None: start cold); draft: the program's draft graph,
        if it has one; seed: the generation's seed, for a drafter that draws its candidates at random.
        The default serves a ChainSource's chains to the per-row builder (drafters.chains.ChainSession)."""
        source = self.rows_source(memory)
        if not isinstance(source, ChainSource):
            raise NotImplementedError(f"{type(self).__name__} has neither a session (start) nor a chain source")
        return ChainSession(source)

    def sessions(
        self, prompt: Sequence[int], prefill: TargetForward, memory: Any = None, draft: DraftModel | None = None,
        seed: int = 0,
    ) -> list[DraftSession]:  # fmt: skip
        return [self.start(prompt, prefill, memory, draft, seed)]

    def rows_source(self, memory: Any = None) -> Any:
        """This drafter's part when every row is drafted at once by one compiled builder
        (drafters.chains): a ChainSource, or Token Recycling's table (drafters.token_recycling.
        SuccessorSource); None (the default): it drafts row by row, through its sessions."""
        return None

    def members(self, memory: Any = None) -> list[tuple[Drafter, Any]]:
        """The drafters feeding one tree, each with its memory (Combined: its members)."""
        return [(self, memory)]

    def rows(
        self, prompts: Sequence[Sequence[int]], prefills: Sequence[TargetForward], memory: Any = None,
        draft: DraftModel | None = None, seeds: Sequence[int] = (), drafting_row: Callable | None = None,
    ) -> RowsDrafting:  # fmt: skip
        """The drafting of a batch (the decode loop's one way to draft): prompts and prefills per row,
        seeds per row (default 0), and drafting_row(b), a context in which a cache-sharing draft graph
        drafts for row b. Where every member has a rows source, all rows are drafted at once
        (drafters.chains); else each row runs its own sessions and the best-first builder."""
        at_once = drafting_at_once([d.rows_source(m) for d, m in self.members(memory)], prompts, prefills)
        if at_once is not None:
            return at_once
        seeds = seeds or [0] * len(prompts)
        sessions = [self.sessions(p, f, memory, draft, s) for p, f, s in zip(prompts, prefills, seeds, strict=True)]
        return PerRowDrafting(sessions, drafting_row)


@dataclass(frozen=True, init=False)
class Combined(Drafter):
    """Several drafters feeding one tree; candidates compete on estimated acceptance probability."""

    drafters: tuple[Drafter, ...]

    def __init__(self, *drafters: Drafter):
        if not drafters or not all(isinstance(d, Drafter) and not isinstance(d, Combined) for d in drafters):
            raise InvalidParameterError("Combined takes one or more non-combined Drafter objects")
        if any(d.draws for d in drafters):
            drawing = next(d for d in drafters if d.draws)
            raise InvalidParameterError(
                f"{drawing!r} draws its candidates at random and cannot share a tree: the multi-candidate rule "
                "needs every child of a node drawn from one draft law (use it alone, or drop its temperature)"
            )
        object.__setattr__(self, "drafters", tuple(drafters))

    def __repr__(self) -> str:
        return f"Combined({', '.join(map(repr, self.drafters))})"

    def new_memory(self) -> tuple:
        return tuple(d.new_memory() for d in self.drafters)

    @property
    def target_topk(self) -> int:
        return max(d.target_topk for d in self.drafters)

    def start(self, prompt, prefill, memory=None, draft=None, seed=0):  # pragma: no cover - expanded by `sessions`
        raise TypeError("Combined drafters are started through sessions()")

    def members(self, memory=None) -> list[tuple[Drafter, Any]]:
        return list(zip(self.drafters, memory if memory is not None else (None,) * len(self.drafters), strict=True))

    def sessions(self, prompt, prefill, memory=None, draft=None, seed=0) -> list[DraftSession]:
        return [d.start(prompt, prefill, m, draft, seed) for d, m in self.members(memory)]


class PerRowDrafting(RowsDrafting):
    """Each row drafts with its own sessions (one per member drafter) and the best-first builder
    (drafters.tree.build_tree); a batch's sessions of one class first prepare together (draft_rows)."""

    def __init__(self, sessions: Sequence[Sequence[DraftSession]], drafting_row: Callable[[int], Any] | None = None):
        self.sessions = [list(row) for row in sessions]
        self.drafting_row = drafting_row or (lambda b: contextlib.nullcontext())
        self.skips = all(session.skips for row in self.sessions for session in row)

    def draft(self, histories, max_nodes, max_depths) -> DraftTree:
        by_class: dict[type, list[DraftSession]] = {}
        for row in self.sessions:
            for session in row:
                by_class.setdefault(type(session), []).append(session)
        for session_class, sessions in by_class.items():
            session_class.draft_rows(sessions)
        trees = []
        for b, (row, tokens, depth) in enumerate(zip(self.sessions, histories, max_depths, strict=True)):
            with self.drafting_row(b):  # a self-draft writes its chain's lower layers in this row
                trees.append(draft_row(row, tokens, max_nodes, depth))
        return DraftTree.stack(trees)

    def precomputed(self, trees: DraftTree) -> torch.Tensor | None:
        """The exit states of every row's nodes, if in each row a session computed them all
        (DraftSession.precomputed); padding nodes' states are zeros."""
        rows = []
        for b, row in enumerate(self.sessions):
            tree = trees.row(b)
            rows.append(next((states for s in row if (states := s.precomputed(tree)) is not None), None))
        if any(r is None for r in rows):
            return None
        states = rows[0].new_zeros(len(rows), trees.width, rows[0].shape[-1])  # [B, T, H]
        for b, r in enumerate(rows):
            states[b, : r.shape[0]] = r
        return states

    def observe(self, trees, verified, paths, histories) -> None:
        for b, (row, path, tokens) in enumerate(zip(self.sessions, paths, histories, strict=True)):
            observe_row(row, trees.row(b), verified.row(b, int(trees.sizes[b])), path, tokens)

    def keep(self, rows) -> None:
        self.sessions = [self.sessions[i] for i in rows]


def draft_row(sessions: Sequence[DraftSession], tokens: Sequence[int], max_nodes: int, max_depth: int) -> DraftTree:
    """One row's tree rooted at tokens[-1]: its sessions' candidates, merged best first."""
    return build_tree(tokens[-1], [s.candidates(tokens) for s in sessions], max_nodes, max_depth)


def observe_row(sessions: Sequence[DraftSession], tree: DraftTree, verified: TargetForward, path: Sequence[int],
                tokens: Sequence[int]) -> None:  # fmt: skip
    """One row's verify step: each drafted node whose parent was accepted is credited to the session
    that proposed it (accepted or not), then every session observes the step."""
    on_path, parents = set(path), tree.parents.tolist()
    for i in range(1, len(tree)):
        origin = tree.origins[i] if tree.origins is not None else None
        if origin is not None and parents[i] in on_path:
            source, key = origin
            sessions[source].stats.record(key, i in on_path)
    for session in sessions:
        session.observe(tree, verified, path, tokens)


def _check_positive_int(owner: str, name: str, value: object, low: int = 1, high: int = 1 << 16) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidParameterError(f"{owner}.{name} must be an int in [{low}, {high}], got {value!r}")


def check_params(owner: str, **params: object) -> None:
    for name, value in params.items():
        _check_positive_int(owner, name, value)


__all__ = ["Combined", "Drafter", "PerRowDrafting", "check_params", "draft_row", "observe_row"]
