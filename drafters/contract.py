"""The drafting contract below the drafters: what a target forward tells them, a batch's drafting, a
row's session, and the chains a drafter gives when every row is drafted at once (drafters.chains)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from .stats import AcceptanceStats
from .best_first import CandidateSource
from .tree import DraftTree
from ..ir.draft import DraftGraphSpec


@dataclass(frozen=True)
class TargetForward:
    """What a target forward tells the drafters about its tokens: one row's T tokens (the prompt, or a
    verified tree: shapes [T, ...]) or a verify step's B rows ([B, T, ...]; `row` takes one; padding
    nodes' entries are meaningless)."""

    topk: torch.Tensor  # [(B,) T, k] int64 on the CPU: the target's top-k next tokens after each token (raw logits)
    hidden: torch.Tensor  # [(B,) T, H] on the model's device: final normed hidden states
    choices: torch.Tensor  # [(B,) T] int64 on the CPU: the token the target chose after each token (greedy or sampled)
    resumed: bool = False  # the forward resumed above an early exit from a session's precomputed states

    def row(self, b: int, size: int) -> TargetForward:
        """Row b's first `size` tokens of a batch's forward."""
        return TargetForward(self.topk[b, :size], self.hidden[b, :size], self.choices[b, :size], self.resumed)


class RowsDrafting(ABC):
    """The drafting of a batch's live rows during one generation: every step, one tree per row.

    Row b of a call is the loop's live row b; `keep` follows the loop when rows finish."""

    skips = False  # True: a step may verify roots only without drafting (then `observe` sees those trees)

    @abstractmethod
    def draft(self, histories: Sequence[Sequence[int]], max_nodes: int, max_depths: Sequence[int]) -> DraftTree:
        """Each row's tree rooted at its history's last token, at most max_nodes nodes and
        max_depths[b] levels below the root."""

    def precomputed(self, trees: DraftTree) -> torch.Tensor | None:
        """[B, T, H]: when every row's tree was already run through the layers below an early exit
        (DraftSession.precomputed), those states (padding nodes' zeros); else None."""
        return None

    @abstractmethod
    def observe(self, trees: DraftTree, verified: TargetForward, paths: Sequence[Sequence[int]],
                histories: Sequence[Sequence[int]]) -> None:  # fmt: skip
        """Learn from a verify step whose accepted paths (node indices, root first) are `paths`;
        histories: each row's tokens up to and including its tree's root."""

    @abstractmethod
    def keep(self, rows: Sequence[int]) -> None:
        """Only `rows` (ascending) go on, as rows 0, 1, ..."""


class RootsOnly(RowsDrafting):
    """One-node trees: nothing is drafted."""

    def draft(self, histories, max_nodes, max_depths) -> DraftTree:
        return DraftTree.roots([h[-1] for h in histories])

    def observe(self, trees, verified, paths, histories) -> None:
        pass

    def keep(self, rows) -> None:
        pass


class Chains(NamedTuple):
    """Every row's candidate chains for one step, each continuing the row's root (drafters.chains)."""

    tokens: np.ndarray  # [B, M, D] int64: chain m's tokens, -1 past its end (a chain starting with -1: none)
    keys: np.ndarray  # [B, M, D] int64: each token's stats key, among its source's (0 .. len(priors) - 1)
    divisors: np.ndarray  # [B, M] float64: the chain's first token's rate is divided by this


class ChainSource(ABC):
    """A drafter's part when every row of a batch is drafted at once (drafters.chains): each step, the
    chains every row's tree may take. A token's estimated acceptance, given its parent's, is the row's
    running rate of its stats key (from `priors`, learned from each verify step like a session's)."""

    priors: np.ndarray  # [K] float64: the prior rate of each stats key

    @abstractmethod
    def chains(self, history: np.ndarray, lengths: np.ndarray) -> Chains:
        """history [B, S] int64: row b's tokens in [0, lengths[b]) (its tree's root last), -1 past them."""

    def keep(self, rows: Sequence[int]) -> None:
        """Only `rows` (ascending) go on (a source with per-row state drops the others)."""


class DraftModel(Protocol):
    """A program's draft graph (ir.draft), as the decode loop hands it to the drafters: a drafter
    drives the graphs whose `spec.kind` it knows (drafters.Heads: "heads")."""

    spec: DraftGraphSpec

    @property
    def config(self) -> Any:
        """spec.config: the draft graph's own config (heads: HeadsConfig)."""

    def __call__(self, *args: torch.Tensor, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The spec's inputs (positionally in its order, or by name) -> the spec's outputs."""


class DraftSession(ABC):
    """State of one drafter during one generation."""

    stats: AcceptanceStats
    skips = True  # observe() takes a step that drafted nothing (a one-node tree), and drafting goes on from it

    @abstractmethod
    def candidates(self, tokens: Sequence[int]) -> CandidateSource:
        """The source of candidates for the tree rooted at tokens[-1]."""

    def observe(self, tree: DraftTree, verified: TargetForward, path: Sequence[int], tokens: Sequence[int]) -> None:
        """Learn from a verify step of `tree` whose accepted nodes are `path`; tokens is the sequence
        up to and including the tree's root."""

    @classmethod
    def draft_rows(cls, sessions: Sequence[DraftSession]) -> None:
        """Prepare the next candidates of several rows' sessions of this class at once, ahead of their
        candidates() calls (drafters.FeatureSession: one draft call per depth for every row). The
        default does nothing: each session drafts in its own candidates()."""

    def precomputed(self, tree: DraftTree) -> torch.Tensor | None:
        """[T, H]: when this session already ran every node of `tree` through the layers below an
        early exit, in the node's own tree slot (drafters.SelfDraft), the states after them; the
        verify step may then resume from there (and says so in TargetForward.resumed). None (the
        default): the verify step runs every layer. No side effects: asking does not commit the loop."""
        return None
