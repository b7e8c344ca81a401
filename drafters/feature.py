"""Feature-draft candidates for the tree (EAGLE-2's dynamic tree over an EAGLE-3 style draft layer,
Clover's or Chimera's draft, rewrites.FeatureDraft: the same calls drive each).

Each session (one row) keeps the draft's KV cache of the verified prefix (step 0 at every committed
position, from the step's declared features output); a verify step's accepted path is appended lazily,
by the next drafting, whose last output predicts the next root's children (depth 1: their top-k). Depth
d + 1 expands the `beam` likeliest depth-d paths (product of draft probabilities) in one draft call, each
attending to the prefix cache and its own ancestors' keys. Every expanded path offers its top-k
children, scored by draft probability calibrated per depth against what the target accepts, so the
best-first builder keeps the likeliest nodes overall and merges them with other drafters'. Rows at once
(`FeatureSession.draft_rows`): a batch's sessions append and expand in the same calls, each row's cache
right-padded to the longest with the padding masked; a row alone runs the same code. Every token a
call hands the draft comes with the two tokens before it (committed, or its drafted ancestors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .base import Drafter, check_params
from .contract import DraftModel, DraftSession, TargetForward
from .heads import CandidateTable, HeadStats, calibrated
from .tree import DraftTree
from ..common.errors import InvalidParameterError
from ..ir.draft import FEATURE_KIND



@dataclass(frozen=True)
class Feature(Drafter):
    """top_k: candidates per expanded node; beam: paths expanded per depth; depth: the deepest level
    drafted (one draft call per level). The defaults propose more candidates than a 64-node tree
    holds (8 + 4 * 8 + 4 * 8), so the builder chooses among them; a deeper draft accepts a little more
    but costs a draft call per level (the tuning: docs/experiments.md, "Feature draft")."""

    top_k: int = 8
    beam: int = 4
    depth: int = 3

    def __post_init__(self):
        check_params("Feature", top_k=self.top_k, beam=self.beam, depth=self.depth)

    def start(self, prompt: Sequence[int], prefill: TargetForward, memory=None, draft: DraftModel | None = None,
              seed: int = 0):  # fmt: skip
        if draft is None or draft.spec.kind != FEATURE_KIND:
            found = "no draft graph" if draft is None else f"a {draft.spec.kind!r} draft graph"
            raise InvalidParameterError(
                f"the Feature drafter needs a feature draft in the pipeline (it has {found}): add rewrites.FeatureDraft()"
            )
        heads = draft.config.parallel_heads
        if heads and self.depth > heads:
            raise InvalidParameterError(f"Feature(depth={self.depth}) drafts deeper than this Chimera draft's {heads} "
                                        f"heads: choose depth <= {heads}")  # fmt: skip
        return FeatureSession(self, draft, prompt, prefill)


class FeatureSession(DraftSession):
    def __init__(self, config: Feature, draft: DraftModel, prompt: Sequence[int], prefill: TargetForward):
        self.config, self.draft = config, draft
        accuracy = draft.config.accuracy
        self.stats = HeadStats({(d, r): accuracy[d][r] for d in range(len(accuracy)) for r in range(len(accuracy[d]))})
        layer = draft.config
        features = prefill.hidden  # [P, H]: the draft's fused features of the prompt's tokens
        empty = features.new_zeros(1, layer.num_kv_heads, 0, layer.head_dim)
        self.keys, self.values = empty, empty  # [1, nkv, S, d]: step 0 at every committed position
        self.root = int(prefill.choices[-1])
        self.pending: _Pending | None = _Pending([*prompt[1:], self.root], features, _last_two(prompt[:1]))
        self.before_root = -1  # the committed token before the root (-1: none)
        self.state = self.logits = self.vocab = None  # [H], [D], [D]: the cache's last output
        self.table: dict[tuple[int, ...], list] | None = None  # drafted by draft_rows, not yet handed out

    def observe(self, tree: DraftTree, verified: TargetForward, path: Sequence[int], tokens: Sequence[int]) -> None:
        bonus = int(verified.choices[path[-1]])
        accepted = tree.tokens[list(path[1:])].tolist()
        self.pending = _Pending(accepted + [bonus], verified.hidden[list(path)], _last_two(tokens))
        self.root, self.table = bonus, None

    def candidates(self, tokens: Sequence[int]):
        if tokens[-1] != self.root:
            raise AssertionError("the feature session lost track of the root")  # the decode loop's contract
        if self.table is None:
            FeatureSession.draft_rows([self])
        table, self.table = self.table, None
        return CandidateTable(table, (self.root,), by_path=True)

    @classmethod
    @torch.no_grad()
    def draft_rows(cls, sessions: Sequence[FeatureSession]) -> None:
        """Each session's candidate table for its next tree, drafted for all of them at once (module
        docstring); their candidates() hand the tables out."""
        if len({id(s.draft) for s in sessions}) > 1:
            raise AssertionError("rows drafted at once share one draft graph")  # one program, one draft
        _append_rows([s for s in sessions if s.pending is not None])
        for session, table in zip(sessions, _expand_rows(sessions)):
            session.table = table

    def _ranked(self, logits: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
        """Each row of logits [N, D]: its top-k tokens and their draft probabilities."""
        top = logits.float().softmax(-1).topk(min(self.config.top_k, logits.shape[-1]), dim=-1)
        return self.vocab[top.indices].tolist(), top.values.tolist()


class _Pending(NamedTuple):
    """What the next drafting appends to a session's draft cache."""

    tokens: list[int]  # the committed tokens, each x[s+1] of a position s not yet in the cache
    features: torch.Tensor  # [n, H]: the target's states at those positions
    before: list[int]  # the two committed tokens before tokens[0] (-1: none)


def _last_two(tokens: Sequence[int]) -> list[int]:
    """The last two of `tokens`, -1 for each missing."""
    return ([-1, -1] + [int(t) for t in tokens[-2:]])[-2:]


def _padded_caches(sessions: Sequence[FeatureSession]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The sessions' caches right-padded to the longest: keys, values [R, nkv, S_max, d], and each one's length."""
    lengths = [s.keys.shape[2] for s in sessions]
    if len(sessions) == 1:
        return sessions[0].keys, sessions[0].values, lengths
    _, heads, _, dim = sessions[0].keys.shape
    keys = sessions[0].keys.new_zeros(len(sessions), heads, max(lengths), dim)
    values = torch.zeros_like(keys)
    for r, s in enumerate(sessions):
        keys[r, :, : lengths[r]], values[r, :, : lengths[r]] = s.keys[0], s.values[0]
    return keys, values, lengths


def _append_rows(sessions: Sequence[FeatureSession]) -> None:
    """Step 0 at each session's pending positions (its tokens and their features [n, H]), one draft call
    for all; each cache grows by its own n, and its last output predicts what follows its root."""
    if not sessions:
        return
    keys, values, lengths = _padded_caches(sessions)
    counts = [len(s.pending.tokens) for s in sessions]
    rows, cached, n = len(sessions), keys.shape[2], max(counts)
    device = keys.device
    mask = np.zeros((rows, n, cached + n), dtype=bool)
    tokens = np.zeros((rows, n), dtype=np.int64)
    previous = np.full((rows, n, 2), -1, dtype=np.int64)
    positions = np.zeros((rows, n), dtype=np.int64)
    features = keys.new_zeros(rows, n, sessions[0].pending.features.shape[-1])  # [R, n, H]
    for r, (s, length, count) in enumerate(zip(sessions, lengths, counts)):
        mask[r, :, :length] = True
        mask[r, :, cached : cached + n] = np.tril(np.ones((n, n), dtype=bool))
        sequence = np.array(s.pending.before + s.pending.tokens, dtype=np.int64)  # the two before, then the new ones
        tokens[r, :count] = sequence[2:]
        previous[r, :count] = np.stack((sequence[:count], sequence[1 : count + 1]), -1)
        positions[r] = np.arange(length, length + n)
        features[r, :count] = s.pending.features
        s.before_root = int(sequence[-2])
    states, logits, vocab, keys, values = sessions[0].draft(
        torch.from_numpy(tokens).to(device), features, torch.from_numpy(positions).to(device), keys, values,
        torch.from_numpy(mask).to(device), torch.zeros(rows, n, dtype=torch.long, device=device),
        torch.from_numpy(previous).to(device))  # fmt: skip
    for r, (s, length, count) in enumerate(zip(sessions, lengths, counts)):
        if rows == 1:  # nothing padded
            s.keys, s.values = keys, values
        else:
            kept = [*range(length), *range(cached, cached + count)]  # its own cache, then its own new positions
            s.keys, s.values = keys[r : r + 1, :, kept], values[r : r + 1, :, kept]
        s.state, s.logits, s.vocab, s.pending = states[r, count - 1], logits[r, count - 1], vocab, None


def _expand_rows(sessions: Sequence[FeatureSession]) -> list[dict[tuple[int, ...], list]]:
    """Every session's candidates per drafted path (root first), depth by depth, all rows in each draft
    call (module docstring)."""
    config = sessions[0].config
    keys, values, prefixes = _padded_caches(sessions)  # a row's root sits at position prefixes[r]
    device = keys.device
    rows = len(sessions)
    tables: list[dict] = [{} for _ in sessions]
    state_of: list[dict] = [{(s.root,): s.state} for s in sessions]  # a path's output state: its children read it
    key_of: list[dict] = [{} for _ in sessions]  # an expanded path's key index in `keys`
    scored: list[list] = []
    tokens, probs = sessions[0]._ranked(torch.stack([s.logits for s in sessions]))  # [R, D] rows
    for r, s in enumerate(sessions):
        tables[r][(s.root,)] = calibrated(s.stats, 0, tokens[r], probs[r])
        scored.append([((s.root, t), p) for t, p in zip(tokens[r], probs[r])])
    for depth in range(1, config.depth):
        frontiers = [sorted(row, key=lambda item: -item[1])[: config.beam] for row in scored]
        n = max(len(f) for f in frontiers)
        if n == 0:
            break
        cached = keys.shape[2]
        mask = np.zeros((rows, n, cached + n), dtype=bool)
        inputs = np.zeros((rows, n), dtype=np.int64)
        previous = np.full((rows, n, 2), -1, dtype=np.int64)
        positions = np.zeros((rows, n), dtype=np.int64)
        parents = keys.new_zeros(rows, n, sessions[0].state.shape[-1])  # [R, n, H]
        for r, frontier in enumerate(frontiers):
            mask[r, :, : prefixes[r]] = True
            mask[r, np.arange(n), cached + np.arange(n)] = True  # each its own key (padding too)
            positions[r] = prefixes[r] + depth - 1
            for i, (path, _) in enumerate(frontier):
                for j in range(2, len(path)):  # its ancestors' expansion keys
                    mask[r, i, key_of[r][path[:j]]] = True
                inputs[r, i] = path[-1]
                previous[r, i] = ((sessions[r].before_root,) + path)[-3:-1]
                parents[r, i] = state_of[r][path[:-1]]
        states, logits, _, keys, values = sessions[0].draft(
            torch.from_numpy(inputs).to(device), parents, torch.from_numpy(positions).to(device), keys, values,
            torch.from_numpy(mask).to(device), torch.full((rows, n), depth, dtype=torch.long, device=device),
            torch.from_numpy(previous).to(device))  # fmt: skip
        tokens, probs = sessions[0]._ranked(logits.flatten(0, 1))  # [R * n] rows
        scored = []
        for r, (s, frontier) in enumerate(zip(sessions, frontiers)):
            row = []
            for i, (path, score) in enumerate(frontier):
                row_tokens, row_probs = tokens[r * n + i], probs[r * n + i]
                state_of[r][path], key_of[r][path] = states[r, i], cached + i
                tables[r][path] = calibrated(s.stats, depth, row_tokens, row_probs)
                row += [((*path, t), score * p) for t, p in zip(row_tokens, row_probs)]
            scored.append(row)
    return tables
