"""Draft-head candidates for the tree: Medusa and Hydra heads (rewrites.DraftHeads) as a drafter.

After every verify step the session runs the program's draft graph on the hidden state of the last
accepted token t; the next tree's root is the target's own next token x[t+1], and head d proposes
depth d.

* Medusa: one draft call, head d's top-k at depth d under every depth d-1 node (the heads do not see
  the drafted tokens).
* Hydra: depth by depth, head d runs on the `beam` most probable depth d-1 nodes with their path's
  tokens, one batched draft call per depth.

Tree: "dynamic" scores a candidate with the head's softmax probability, calibrated per head during
the generation against what the target accepted (`stats.ProbabilityCalibration`), so the tree grows
by cumulative draft probability (DySpec / EAGLE-2 style) and competes with the other drafters'
estimates on one scale; "static" scores it with the acceptance rate of its depth and rank, which
starts at the head's measured accuracy (heads.json) and follows what the target accepts
(`HeadStats`), so the tree's shape depends on those rates only, not on the hidden state. Alone, with
such per-(depth, rank) probabilities, the best-first builder builds the sparse tree of largest expected
accepted length for each budget (Medusa's "medusa choices", chosen rather than hand-written; checked
in tests/test_heads.py). For Hydra that holds among the drafted paths: with a beam narrower than the
budget, depth d + 1 is drafted only under the `beam` best depth-d paths (the shipped Hydra heads'
optimum needs a wider beam from 49 nodes on). Both compete with other drafters' candidates in one tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpass.drafters.base import Drafter, DraftModel, DraftSession, TargetForward, check_params
from specpass.drafters.stats import AcceptanceStats, ProbabilityCalibration
from specpass.drafters.tree import Candidate, DraftTree
from specpass.errors import InvalidParameterError

TREES = ("dynamic", "static")


@dataclass(frozen=True)
class Heads(Drafter):
    """tree: dynamic or static (module docstring); top_k: candidates per head (Medusa) or per node
    (Hydra); beam: Hydra nodes expanded per depth. The defaults propose more candidates than a 64-node
    tree holds (Hydra: 8 + 3 x 64), so the tree builder chooses among them; the draft call's cost barely
    depends on its row count (it reads the draft vocabulary's LM-head rows once)."""

    tree: str = "dynamic"
    top_k: int = 8
    beam: int = 8

    def __post_init__(self):
        if self.tree not in TREES:
            raise InvalidParameterError(f"Heads.tree must be one of {TREES}, got {self.tree!r}")
        check_params("Heads", top_k=self.top_k, beam=self.beam)

    def start(self, prompt: Sequence[int], prefill: TargetForward, memory=None, draft: DraftModel | None = None):
        if draft is None or draft.spec.kind != "heads":
            found = "no draft graph" if draft is None else f"a {draft.spec.kind!r} draft graph"
            raise InvalidParameterError(
                f"the Heads drafter needs draft heads in the pipeline (it has {found}): add rewrites.DraftHeads(kind=...)"
            )
        return HeadsSession(self, draft, prefill.hidden[-1], int(prefill.choices[-1]))


class HeadsSession(DraftSession):
    def __init__(self, config: Heads, draft: DraftModel, hidden: torch.Tensor, root: int):
        self.config = config
        self.draft = draft
        self.heads = draft.config
        accuracy = self.heads.accuracy
        priors = {(d, r): accuracy[d][r] for d in range(len(accuracy)) for r in range(len(accuracy[d]))}
        self.stats = HeadStats(priors)
        self.hidden = hidden  # [H] of the token before the root
        self.root = root

    def observe(self, tree: DraftTree, verified: TargetForward, path: Sequence[int], tokens: Sequence[int]) -> None:
        self.hidden = verified.hidden[path[-1]]
        self.root = int(verified.choices[path[-1]])

    def candidates(self, tokens: Sequence[int]):
        if tokens[-1] != self.root:
            raise AssertionError("the heads session lost track of the root")  # the decode loop's contract
        if self.heads.kind == "hydra":
            return _Candidates(self._hydra(), (self.root,), by_path=True)
        return _Candidates(self._medusa(), (0,), by_path=False)

    def _scored(self, depth: int, tokens: list[int], probs: list[float]) -> list[tuple[int, float, tuple]]:
        """One head's ranked tokens as candidates (token, score, stats key); the score is the calibrated
        draft probability (dynamic tree) or the measured acceptance rate of that depth and rank (static)."""
        if self.config.tree == "dynamic":
            score = [self.stats.calibration(depth, p) for p in probs]
        else:
            score = [self.stats.rate((depth, r)) for r in range(len(tokens))]
        return [(t, s, (depth, r, p)) for r, (t, s, p) in enumerate(zip(tokens, score, probs))]

    def _top(self, tokens: torch.Tensor, heads: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k tokens and draft probabilities of row i's head heads[i] (tokens [N, K]: its drafted prefix)."""
        logits, vocab = self.draft(self.hidden.expand(len(heads), -1), tokens, heads)  # [N, D], [D]
        top = logits.float().softmax(-1).topk(self.config.top_k, dim=-1)
        return vocab[top.indices].tolist(), top.values.tolist()

    def _medusa(self) -> dict[tuple[int, ...], list]:
        """Candidates per depth, shared by every node of that depth: {(depth,): [(token, score, key)]}."""
        k = self.heads.num_heads
        device = self.hidden.device
        tokens, probs = self._top(torch.zeros(k, k, dtype=torch.long, device=device), torch.arange(k, device=device))
        return {(d,): self._scored(d, *ranked) for d, ranked in enumerate(zip(tokens, probs))}

    def _hydra(self) -> dict[tuple[int, ...], list]:
        """Candidates per drafted path (root token first): {path: [(token, score, key)]}.

        Depth d's call evaluates head d on the `beam` best paths so far, each with its path's tokens.
        """
        k = self.heads.num_heads
        device = self.hidden.device
        out: dict[tuple[int, ...], list] = {}
        frontier = [((self.root,), 1.0)]
        for d in range(k):
            padded = [list(path) + [0] * (k - len(path)) for path, _ in frontier]  # head d reads path only
            rows = torch.tensor(padded, dtype=torch.long, device=device)  # [N, K]: one host-to-device copy
            tokens, probs = self._top(rows, torch.full((len(frontier),), d, dtype=torch.long, device=device))
            scored = []
            for (path, score), row_tokens, row_probs in zip(frontier, tokens, probs):
                out[path] = self._scored(d, row_tokens, row_probs)
                scored += [((*path, t), score * s) for t, s, _ in out[path]]
            frontier = sorted(scored, key=lambda item: -item[1])[: self.config.beam]
        return out


class HeadStats(AcceptanceStats):
    """What the heads learn from verification: acceptance per (depth, rank), the static tree's scores,
    and the calibration of each head's probabilities, the dynamic tree's. Keys: (depth, rank, prob)."""

    def __init__(self, priors: dict[tuple[int, int], float]):
        super().__init__(priors, default=0.01)
        self.calibration = ProbabilityCalibration()

    def record(self, key: tuple[int, int, float], accepted: bool) -> None:
        depth, rank, prob = key
        super().record((depth, rank), accepted)
        self.calibration.record(depth, prob, accepted)


class _Candidates:
    """A drafted table of candidates; a node's state is its key: (depth,) for Medusa, its path for Hydra."""

    def __init__(self, table: dict[tuple[int, ...], list], root_key: tuple[int, ...], by_path: bool):
        self.table = table
        self.root_key = root_key
        self.by_path = by_path

    def _list(self, key: tuple[int, ...]) -> list[Candidate]:
        return [Candidate(token, score, stats_key, (*key, token) if self.by_path else (key[0] + 1,))
                for token, score, stats_key in self.table.get(key, ())]  # fmt: skip

    def root_candidates(self) -> list[Candidate]:
        return self._list(self.root_key)

    def child_candidates(self, token: int, state) -> list[Candidate]:
        return self._list(state)
