"""Draft heads: trained Medusa or Hydra heads added to the step as its draft graph.

Papers: Medusa, Hydra (Clover, Chimera, Hidden Transfer for the family). The step gains a draft graph
(`ir.draft`, kind "heads"; `heads.modules.HeadsStep`): the heads on final hidden states, then
`vocab_head` and, for Hydra, the model's own token embedding. Inputs hidden [N, H], tokens [N, K],
head [N]; outputs logits [N, D] over the draft vocabulary and its ids vocab [D]; config `HeadsConfig`.

Invariants. The verify graph is untouched (bit for bit, tested). The heads must be trained for this
model (fingerprint of its LM head), else the pass does not apply and names both identities. `vocab_head`
is the LM head itself for a whole vocabulary, else exactly its rows of the draft vocabulary (gathered
once, checked against the LM head), never a copy of the whole head (`verify`). Twice is refused.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
import torch.fx

from ..common.errors import GraphVerificationError, InvalidParameterError
from ..ir import arch_of
from ..ir.draft import HEADS_KIND, ROWS, DraftGraphSpec, DraftTensor, draft_graph, trace_draft
from ..ir.roles import Role
from ..passes.draft import DraftGraphPass
from ..passes.export import ExportHook

DRAFT_HEADS = "draft_heads"


@dataclass(frozen=True)
class DraftHeads(DraftGraphPass):
    """design: "medusa" or "hydra" (the heads' paper); heads: a `specpass train-heads` directory, or
    "default" for the heads shipped for the embedded default model. `kind` is design's name before
    0.2 (accepted with a DeprecationWarning until then)."""

    design: str = "medusa"
    heads: str = "default"
    kind: dataclasses.InitVar[str | None] = None

    ensures = frozenset({DRAFT_HEADS})

    def __post_init__(self, kind: str | None):
        from ..heads.modules import DESIGNS

        if kind is not None:
            warnings.warn("DraftHeads(kind=...) is DraftHeads(design=...) now; `kind` goes in 0.2", DeprecationWarning,
                          stacklevel=3)  # fmt: skip
            object.__setattr__(self, "design", kind)
        if self.design not in DESIGNS:
            raise InvalidParameterError(f"DraftHeads.design must be one of {DESIGNS}, got {self.design!r}")
        if not isinstance(self.heads, str) or not self.heads:
            raise InvalidParameterError(f"DraftHeads.heads must be a directory or 'default', got {self.heads!r}")

    def directory(self) -> str:
        from ..heads.io import shipped_heads

        return shipped_heads(self.design) if self.heads == "default" else self.heads

    def export_hook(self, gm: torch.fx.GraphModule, arch, dtype: torch.dtype) -> ExportHook:
        """Nothing beside the step: any draft graph (ir.draft) is exported as draft.onnx."""
        return ExportHook()

    def check_draft(self, gm: torch.fx.GraphModule) -> str | None:
        from ..heads.io import model_mismatch, read_config

        try:
            config = read_config(self.directory())
        except (InvalidParameterError, TypeError, ValueError) as exc:
            return str(exc)
        if config.design != self.design:
            return f"the heads in {self.directory()} are {config.design} heads, the pass asks for {self.design}"
        return model_mismatch("heads", self.directory(), config.model, config.hidden_size, config.vocab_size, gm)

    def build_draft(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, DraftGraphSpec, str]:
        from ..heads.io import load_heads
        from ..heads.modules import HeadsStep

        lm_head, embed_tokens = gm.get_submodule("lm_head"), gm.get_submodule("embed_tokens")
        heads, config = load_heads(self.directory(), lm_head)
        draft = trace_draft(HeadsStep(heads, lm_head, embed_tokens),
                            {"vocab_head": Role.LM_HEAD, "embed_tokens": Role.EMBED})  # fmt: skip
        arch = arch_of(gm)
        vocab = config.draft_vocab or arch.vocab_size
        spec = DraftGraphSpec(
            kind=HEADS_KIND,
            source=self.name,
            inputs=(
                DraftTensor("hidden", (ROWS, arch.hidden_size), "model"),
                DraftTensor("tokens", (ROWS, config.num_heads), "int64", bound=arch.vocab_size),
                DraftTensor("head", (ROWS,), "int64", bound=config.num_heads),
            ),
            outputs=(DraftTensor("logits", (ROWS, vocab), "model"), DraftTensor("vocab", (vocab,), "int64")),
            config=config,
        )
        return draft, spec, f"{config.num_heads} {config.design} heads"

    @classmethod
    def config_from_dict(cls, data: dict):
        from ..heads.modules import HeadsConfig

        return HeadsConfig.from_dict(data)

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """The draft graph reads the step's LM head itself (whole vocabulary) or exactly its rows of the
        draft vocabulary, never a copy of the whole head."""
        super().verify(gm)
        draft = draft_graph(gm)
        lm_head = gm.get_submodule("lm_head")
        vocab_head, vocab = draft.get_submodule("vocab_head"), draft.vocab
        rows = lm_head.weight.shape[0]
        whole = len(vocab) == rows and torch.equal(vocab, torch.arange(rows, device=vocab.device))
        if vocab_head is lm_head:
            if not whole:
                _fail("the draft graph reads the whole LM head but its vocabulary is not the whole vocabulary")
        elif whole:
            _fail("without a draft vocabulary the draft graph must share the step's LM head, not a copy")
        elif not torch.equal(vocab_head.weight, lm_head.weight[vocab]):
            _fail("the draft graph's vocabulary head is not the LM head's rows of its draft vocabulary")


def _fail(message: str) -> None:
    raise GraphVerificationError(f"DraftHeads: {message}")
