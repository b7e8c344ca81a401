"""Feature-draft candidates for the tree (EAGLE-2's dynamic tree over an EAGLE-3 style draft layer,
rewrites.FeatureDraft).

The verify step returns, for every token it ran, the draft's fused features of it (the step's declared
`features` output, which the program hands the drafters as `hidden`). The session keeps the draft's
own KV cache of the verified prefix: step 0 of the draft at every committed position s, reading its
features and the embedding of x[s+1] (heads.feature_draft). After each verify step it appends the
accepted path (one draft call), whose last output predicts the children of the next root.

Drafting a tree (`candidates`): depth 1 is the top-k of that prediction. Depth d + 1 expands the `beam`
likeliest depth-d paths (by the product of their draft probabilities, EAGLE-2) in one draft call: each
path's last token at position P + d - 1 (P: the root's position), reading its parent's output state
and attending to the prefix cache and to its own ancestors' keys (a tree mask over the draft's
cache). Every expanded path contributes its top-k children as candidates, scored by their draft
probability calibrated per depth against what the target accepts (`stats.ProbabilityCalibration`),
so the best-first builder keeps the likeliest nodes overall (EAGLE-2's reranking) and merges them
with other drafters' proposals in one tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpass.drafters.base import Drafter, DraftModel, DraftSession, TargetForward, check_params
from specpass.drafters.heads import HeadStats, CandidateTable
from specpass.drafters.tree import DraftTree
from specpass.errors import InvalidParameterError

FEATURE_KIND = "feature"  # the draft-graph kind it drives (rewrites.FeatureDraft)


@dataclass(frozen=True)
class Feature(Drafter):
    """top_k: candidates per expanded node; beam: paths expanded per depth; depth: the deepest level
    drafted (one draft call per level). The defaults propose more candidates than a 64-node tree
    holds, so the builder chooses among them."""

    top_k: int = 8
    beam: int = 8
    depth: int = 6

    def __post_init__(self):
        check_params("Feature", top_k=self.top_k, beam=self.beam, depth=self.depth)

    def start(self, prompt: Sequence[int], prefill: TargetForward, memory=None, draft: DraftModel | None = None,
              seed: int = 0):  # fmt: skip
        if draft is None or draft.spec.kind != FEATURE_KIND:
            found = "no draft graph" if draft is None else f"a {draft.spec.kind!r} draft graph"
            raise InvalidParameterError(
                f"the Feature drafter needs a feature draft in the pipeline (it has {found}): add rewrites.FeatureDraft()"
            )
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
        self._append([*prompt[1:], self.root], features)

    def _append(self, next_tokens: Sequence[int], features: torch.Tensor) -> None:
        """Step 0 at the next len(next_tokens) positions: their features [n, H], each with the token after
        it; the last one's output predicts what follows the root."""
        n, cached = len(next_tokens), self.keys.shape[2]
        device = features.device
        mask = torch.ones(1, n, cached + n, dtype=torch.bool, device=device)
        mask[0, :, cached:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        tokens = torch.tensor([list(next_tokens)], device=device)  # [1, n]
        positions = torch.arange(cached, cached + n, device=device)[None]  # [1, n]
        with torch.no_grad():
            states, logits, vocab, self.keys, self.values = self.draft(tokens, features[None], positions, self.keys,
                                                                       self.values, mask)  # fmt: skip
        self.state, self.logits, self.vocab = states[0, -1], logits[0, -1], vocab  # [H], [D], [D]

    def observe(self, tree: DraftTree, verified: TargetForward, path: Sequence[int], tokens: Sequence[int]) -> None:
        bonus = int(verified.choices[path[-1]])
        self._append([tree.tokens[i] for i in path[1:]] + [bonus], verified.hidden[list(path)])
        self.root = bonus

    def candidates(self, tokens: Sequence[int]):
        if tokens[-1] != self.root:
            raise AssertionError("the feature session lost track of the root")  # the decode loop's contract
        return CandidateTable(self._expand(), (self.root,), by_path=True)

    def _ranked(self, logits: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
        """Each row of logits [N, D]: its top-k tokens and their draft probabilities."""
        top = logits.float().softmax(-1).topk(min(self.config.top_k, logits.shape[-1]), dim=-1)
        return self.vocab[top.indices].tolist(), top.values.tolist()

    def _scored(self, depth: int, tokens: list[int], probs: list[float]) -> list[tuple]:
        return [(t, self.stats.calibration(depth, p), (depth, r, p), None)
                for r, (t, p) in enumerate(zip(tokens, probs))]  # fmt: skip

    @torch.no_grad()
    def _expand(self) -> dict[tuple[int, ...], list]:
        """Candidates per drafted path (root first), depth by depth (module docstring)."""
        table: dict[tuple[int, ...], list] = {}
        tokens, probs = self._ranked(self.logits[None])
        table[(self.root,)] = self._scored(0, tokens[0], probs[0])
        prefix = self.keys.shape[2]  # the root's position: the draft cache holds positions [0, prefix)
        device = self.keys.device
        keys, values = self.keys, self.values
        state_of = {(self.root,): self.state}  # a path's output state: what its children's expansion reads
        key_of: dict[tuple[int, ...], int] = {}  # an expanded path's key index in `keys`
        scored = [((self.root, t), p) for t, p in zip(tokens[0], probs[0])]
        for depth in range(1, self.config.depth):
            frontier = sorted(scored, key=lambda item: -item[1])[: self.config.beam]
            if not frontier:
                break
            paths = [path for path, _ in frontier]
            cached, n = keys.shape[2], len(paths)
            mask = torch.zeros(1, n, cached + n, dtype=torch.bool, device=device)
            mask[0, :, :prefix] = True
            for i, path in enumerate(paths):  # its ancestors' expansion keys, and its own
                for j in range(2, len(path)):
                    mask[0, i, key_of[path[:j]]] = True
                mask[0, i, cached + i] = True
            inputs = torch.tensor([[path[-1] for path in paths]], device=device)  # [1, n]
            parents = torch.stack([state_of[path[:-1]] for path in paths])[None]  # [1, n, H]
            positions = torch.full((1, n), prefix + depth - 1, device=device)
            states, logits, _, keys, values = self.draft(inputs, parents, positions, keys, values, mask)
            tokens, probs = self._ranked(logits[0])
            scored = []
            for i, ((path, score), row_tokens, row_probs) in enumerate(zip(frontier, tokens, probs)):
                state_of[path], key_of[path] = states[0, i], cached + i
                table[path] = self._scored(depth, row_tokens, row_probs)
                scored += [((*path, t), score * p) for t, p in zip(row_tokens, row_probs)]
        return table
