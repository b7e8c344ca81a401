"""Draft-head candidates for the tree: Medusa and Hydra heads (rewrites.DraftHeads) as a drafter.

After every verify step the session runs the draft graph on the last accepted token's hidden state; head
d proposes depth d. Medusa: one call, head d's top-k under every depth d-1 node. Hydra: one call per
depth, on the `beam` likeliest depth d-1 paths with their tokens. A batch's rows share these calls
(`HeadsSession.draft_rows`); a row alone runs the same code. "dynamic" scores a candidate by the
head's probability, calibrated against what the target accepts; "static" by the acceptance rate of its
(depth, rank), from heads.json and updated as the target accepts, which makes the best-first tree the one
of largest expected accepted length (tests/test_heads.py). With `temperature`, candidates are drawn
without replacement (Gumbel-top-k) and carry their law (tree.Drawn) for the multi-candidate rule: a draw
is scored by its rank only, so the tree keeps the first draws of every law and never decides on a draw
by its token. Medusa's nodes of one depth share one draw; Hydra draws per path.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import Drafter, check_params
from .contract import DraftModel, DraftSession, TargetForward
from .stats import AcceptanceStats, ProbabilityCalibration
from .best_first import Candidate, DrawnCandidate
from .tree import DraftLaw, Drawn, DraftTree
from ..common.errors import InvalidParameterError
from ..ir.draft import HEADS_KIND

TREES = ("dynamic", "static")


@dataclass(frozen=True)
class Heads(Drafter):
    """tree: dynamic or static (module docstring); top_k: candidates per head (Medusa) or per node
    (Hydra); beam: Hydra nodes expanded per depth. The defaults propose more candidates than a 64-node
    tree holds (Hydra: 8 + 3 x 64), so the tree builder chooses among them; the draft call's cost barely
    depends on its row count (it reads the draft vocabulary's LM-head rows once). temperature: None
    proposes each head's top_k tokens; a float > 0 draws top_k candidates without replacement from the
    head's softmax at that temperature (module docstring; needs tree="static")."""

    tree: str = "dynamic"
    top_k: int = 8
    beam: int = 8
    temperature: float | None = None

    def __post_init__(self):
        if self.tree not in TREES:
            raise InvalidParameterError(f"Heads.tree must be one of {TREES}, got {self.tree!r}")
        check_params("Heads", top_k=self.top_k, beam=self.beam)
        if self.temperature is not None:
            t = self.temperature
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t < math.inf:
                raise InvalidParameterError(f"Heads.temperature must be None or a finite float > 0, got {t!r}")
            if self.tree != "static":
                raise InvalidParameterError(
                    "Heads(temperature=...) draws its candidates, and a draw must be scored by its rank, not by the "
                    "token drawn (that would bias the multi-candidate rule): pass tree='static'"
                )

    @property
    def draws(self) -> bool:
        return self.temperature is not None

    def start(self, prompt: Sequence[int], prefill: TargetForward, memory=None, draft: DraftModel | None = None,
              seed: int = 0):  # fmt: skip
        if draft is None or draft.spec.kind != HEADS_KIND:
            found = "no draft graph" if draft is None else f"a {draft.spec.kind!r} draft graph"
            raise InvalidParameterError(
                f"the Heads drafter needs draft heads in the pipeline (it has {found}): add rewrites.DraftHeads(design=...)"
            )
        return HeadsSession(self, draft, prefill.hidden[-1], int(prefill.choices[-1]), seed)


class HeadsSession(DraftSession):
    def __init__(self, config: Heads, draft: DraftModel, hidden: torch.Tensor, root: int, seed: int = 0):
        self.config = config
        self.generator = torch.Generator(hidden.device).manual_seed(seed ^ 0x6865616473)  # draws' own stream
        self.draft = draft
        self.heads = draft.config
        accuracy = self.heads.accuracy
        priors = {(d, r): accuracy[d][r] for d in range(len(accuracy)) for r in range(len(accuracy[d]))}
        self.stats = HeadStats(priors)
        self.hidden = hidden  # [H] of the token before the root
        self.root = root
        self.table: dict[tuple[int, ...], list] | None = None  # drafted by draft_rows, not yet handed out
        self.skips = not config.draws  # a drawn step's sample differs from a plain step's: no timing may pick them

    def observe(self, tree: DraftTree, verified: TargetForward, path: Sequence[int], tokens: Sequence[int]) -> None:
        self.hidden = verified.hidden[path[-1]]
        self.root, self.table = int(verified.choices[path[-1]]), None

    def candidates(self, tokens: Sequence[int]):
        if tokens[-1] != self.root:
            raise AssertionError("the heads session lost track of the root")  # the decode loop's contract
        if self.table is None:
            HeadsSession.draft_rows([self])
        table, self.table = self.table, None
        if self.heads.design == "hydra":
            return CandidateTable(table, (self.root,), by_path=True)
        return CandidateTable(table, (0,), by_path=False)

    @classmethod
    @torch.no_grad()
    def draft_rows(cls, sessions: Sequence[HeadsSession]) -> None:
        """Each session's candidate table for its next tree, drafted for all of them at once: Medusa in
        one draft call, Hydra in one call per depth (module docstring); their candidates() hand the
        tables out. A row's draws come from its own generator, in the order it would draw alone."""
        groups: dict[tuple, list[HeadsSession]] = {}
        for s in sessions:
            groups.setdefault((id(s.draft), s.config), []).append(s)
        for group in groups.values():
            tables = _hydra(group) if group[0].heads.design == "hydra" else _medusa(group)
            for session, table in zip(group, tables, strict=True):
                session.table = table

    def _scored(self, depth: int, tokens: list[int], probs: list[float], drawn: list[Drawn | None]
                ) -> list[tuple[int, float, tuple, Drawn | None]]:  # fmt: skip
        """One head's ranked tokens as candidates (token, score, stats key, drawn); the score is the
        calibrated draft probability (dynamic tree) or the measured acceptance rate of that depth and
        rank (static; for draws, the running minimum over ranks, so later draws never outrank earlier ones)."""
        if self.config.tree == "dynamic":
            return calibrated(self.stats, depth, tokens, probs, drawn)
        score = [self.stats.rate((depth, r)) for r in range(len(tokens))]
        if self.config.draws:
            score = [min(score[: r + 1]) for r in range(len(score))]
        return [(t, s, (depth, r, p), d) for r, (t, s, p, d) in enumerate(zip(tokens, score, probs, drawn))]

    def _ranked(self, logits: torch.Tensor, vocab: torch.Tensor) -> tuple[list[list[int]], list[list[float]], list[list]]:
        """Each row of this session's logits [n, D]: its top-k tokens, or its draws in draw order
        (Heads.temperature), with their draft probabilities and how they were drawn."""
        k = self.config.top_k
        if not self.config.draws:
            top = logits.float().softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)
            return vocab[top.indices].tolist(), top.values.tolist(), [[None] * k] * len(logits)
        law = (logits.float() / self.config.temperature).softmax(-1)  # [n, D]
        uniform = torch.rand(law.shape, generator=self.generator, device=law.device)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(uniform.dtype).tiny)))  # [n, D]
        order = (law.log() + gumbel).topk(min(k, law.shape[-1]), dim=-1).indices  # [n, k]: Gumbel-top-k
        vocab_ids = vocab.cpu().numpy()
        tokens_out, probs_out, drawn_out = [], [], []
        for row, row_order in zip(law.double().cpu().numpy(), order.tolist()):
            row_order = [j for j in row_order if row[j] > 0.0]  # a law with fewer than k tokens
            draft_law = DraftLaw(vocab_ids, row / row.sum())
            tokens_out.append(vocab_ids[row_order].tolist())
            probs_out.append(draft_law.probs[row_order].tolist())
            drawn_out.append([Drawn(draft_law, r, j) for r, j in enumerate(row_order)])
        return tokens_out, probs_out, drawn_out


def _top(sessions: Sequence[HeadsSession], tokens: torch.Tensor, heads: torch.Tensor, counts: Sequence[int]) -> list:
    """One draft call for every session's rows: session j owns the next counts[j] rows of tokens [N, K]
    (its drafted prefixes) and heads [N] (which head each row evaluates), all read from its hidden state.
    Per session: its rows' ranked tokens, probabilities and draws (HeadsSession._ranked)."""
    hidden = torch.cat([s.hidden.expand(n, -1) for s, n in zip(sessions, counts)])  # [N, H]
    logits, vocab = sessions[0].draft(hidden, tokens, heads)  # [N, D], [D]
    if sessions[0].config.draws:  # each session draws from its own stream
        return [s._ranked(rows, vocab) for s, rows in zip(sessions, logits.split(list(counts)))]
    tokens_all, probs_all, none = sessions[0]._ranked(logits, vocab)  # one top-k for every row
    ends = list(itertools.accumulate(counts))
    return [(tokens_all[e - n : e], probs_all[e - n : e], none[e - n : e]) for n, e in zip(counts, ends)]


def _medusa(sessions: Sequence[HeadsSession]) -> list[dict[tuple[int, ...], list]]:
    """Candidates per depth, shared by every node of that depth: {(depth,): [(token, score, key)]}, per session."""
    k = sessions[0].heads.num_heads
    device = sessions[0].hidden.device
    tokens = torch.zeros(len(sessions) * k, k, dtype=torch.long, device=device)  # Medusa reads no tokens
    heads = torch.arange(k, device=device).repeat(len(sessions))  # [B * K]: every head, each row
    ranked = _top(sessions, tokens, heads, [k] * len(sessions))
    return [{(d,): s._scored(d, *by_head) for d, by_head in enumerate(zip(*r))} for s, r in zip(sessions, ranked)]


def _hydra(sessions: Sequence[HeadsSession]) -> list[dict[tuple[int, ...], list]]:
    """Candidates per drafted path (root token first): {path: [(token, score, key)]}, per session.

    Depth d's call evaluates head d on each session's `beam` best paths so far, each with its path's tokens.
    """
    k = sessions[0].heads.num_heads
    device = sessions[0].hidden.device
    tables: list[dict] = [{} for _ in sessions]
    frontiers = [[((s.root,), 1.0)] for s in sessions]
    for d in range(k):
        padded = [list(path) + [0] * (k - len(path)) for f in frontiers for path, _ in f]  # head d reads path only
        rows = torch.tensor(padded, dtype=torch.long, device=device)  # [N, K]: one host-to-device copy
        heads = torch.full((len(padded),), d, dtype=torch.long, device=device)
        ranked = _top(sessions, rows, heads, [len(f) for f in frontiers])
        for j, (s, frontier, (tokens, probs, drawn)) in enumerate(zip(sessions, frontiers, ranked)):
            scored = []
            for (path, score), row_tokens, row_probs, row_drawn in zip(frontier, tokens, probs, drawn):
                tables[j][path] = s._scored(d, row_tokens, row_probs, row_drawn)
                scored += [((*path, token), score * p) for token, p, _, _ in tables[j][path]]
            frontiers[j] = sorted(scored, key=lambda item: -item[1])[: s.config.beam]
    return tables


def calibrated(stats: HeadStats, depth: int, tokens: list[int], probs: list[float],
               drawn: Sequence[Drawn | None] | None = None) -> list[tuple[int, float, tuple, Drawn | None]]:  # fmt: skip
    """Ranked tokens of one depth as candidates (token, score, stats key, drawn), each scored by its
    draft probability calibrated against what the target accepted at that depth (a dynamic tree)."""
    drawn = drawn or [None] * len(tokens)
    return [(t, stats.calibration(depth, p), (depth, r, p), d) for r, (t, p, d) in enumerate(zip(tokens, probs, drawn))]


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


class CandidateTable:
    """A drafted table of candidates; a node's state is its key: (depth,) for Medusa, its path for Hydra."""

    def __init__(self, table: dict[tuple[int, ...], list], root_key: tuple[int, ...], by_path: bool):
        self.table = table
        self.root_key = root_key
        self.by_path = by_path

    def _list(self, key: tuple[int, ...]) -> list[Candidate | DrawnCandidate]:
        out = []
        for token, score, stats_key, drawn in self.table.get(key, ()):
            state = (*key, token) if self.by_path else (key[0] + 1,)
            out.append(Candidate(token, score, stats_key, state) if drawn is None
                       else DrawnCandidate(token, score, stats_key, state, drawn))  # fmt: skip
        return out

    def root_candidates(self) -> list[Candidate]:
        return self._list(self.root_key)

    def child_candidates(self, token: int, state) -> list[Candidate]:
        return self._list(state)
