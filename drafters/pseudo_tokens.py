"""Hidden Transfer's candidates for the tree: the pseudo tokens' distributions (rewrites.HiddenTransfer).

After every verify step the session keeps the last accepted token's stream entering layer k (the step's
declared output); for the next tree it calls the draft graph once, as a step over K tokens in a chain
after the committed prefix (the root's slot first), its `exit_hidden` that stream repeated K times.
Pseudo token j's logits propose depth j: its top-k are the candidates under every node of depth j - 1
(as Medusa's heads: the pseudo states do not read the drafted tokens), scored by their probability
calibrated per depth against what the target accepts. The draft graph shares the step's cache, so a
batch's rows draft one after another, each in its own cache row (the decode loop's drafting_row). When
the K slots after the prefix would pass the cache's end, the step drafts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import Drafter, check_params
from .contract import DraftModel, DraftSession, TargetForward
from .heads import CandidateTable, HeadStats, calibrated
from .tree import DraftTree
from ..common.errors import InvalidParameterError
from ..ir.draft import HIDDEN_TRANSFER_KIND
from ..ir.layout import SlotLayout
from ..ir.split import EXIT_HIDDEN


@dataclass(frozen=True)
class PseudoTokens(Drafter):
    """top_k: candidates per pseudo token (each proposes one depth of the tree)."""

    top_k: int = 8

    def __post_init__(self):
        check_params("PseudoTokens", top_k=self.top_k)

    def start(self, prompt: Sequence[int], prefill: TargetForward, memory=None, draft: DraftModel | None = None,
              seed: int = 0):  # fmt: skip
        if draft is None or draft.spec.kind != HIDDEN_TRANSFER_KIND:
            found = "no draft graph" if draft is None else f"a {draft.spec.kind!r} draft graph"
            raise InvalidParameterError(f"the PseudoTokens drafter needs a hidden transfer in the pipeline (it has "
                                        f"{found}): add rewrites.HiddenTransfer(DIR)")  # fmt: skip
        return PseudoTokensSession(self, draft, prefill.hidden[-1])


class PseudoTokensSession(DraftSession):
    def __init__(self, config: PseudoTokens, draft: DraftModel, source: torch.Tensor):
        self.config, self.draft = config, draft
        transfer = draft.config  # heads.hidden_transfer.HiddenTransferConfig
        self.pseudo_tokens = transfer.pseudo_tokens
        accuracy = transfer.accuracy
        self.stats = HeadStats({(d, r): accuracy[d][r] for d in range(len(accuracy)) for r in range(len(accuracy[d]))})
        self.source = source  # [H]: the stream entering layer k at the last accepted token (the root's parent)
        self.cache_slots = transfer.cache_size

    def observe(self, tree: DraftTree, verified: TargetForward, path: Sequence[int], tokens: Sequence[int]) -> None:
        self.source = verified.hidden[path[-1]]

    @torch.no_grad()
    def candidates(self, tokens: Sequence[int]):
        committed, k = len(tokens) - 1, self.pseudo_tokens  # every token but the root is in the cache
        table: dict[tuple[int, ...], list] = {}
        if committed + k <= self.cache_slots:
            layout = SlotLayout.chain(committed, k, self.source.device)  # the root's slot, then the K - 1 after it
            inputs = layout.step_inputs(torch.zeros(1, k, dtype=torch.long, device=self.source.device))
            del inputs["input_ids"]  # the draft graph reads the transferred states instead
            logits = self.draft(**inputs, **{EXIT_HIDDEN: self.source.expand(1, k, -1)})[0][0]  # [K, V]
            top = logits.float().softmax(-1).topk(self.config.top_k, dim=-1)
            for d, (row_tokens, row_probs) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
                table[(d,)] = calibrated(self.stats, d, row_tokens, row_probs)
        return CandidateTable(table, (0,), by_path=False)
