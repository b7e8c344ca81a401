"""Draft heads: trained Medusa or Hydra heads added to the step as its draft graph.

Papers: Medusa, Hydra (and Clover, Chimera, Hidden Transfer for the family); see ../shared/seeds.

Rewrite. The step module gains a second FX graph, `draft` (`heads.modules.DraftStep`): the heads on
final hidden states, then `vocab_head` and, for Hydra, the model's own token embedding. `vocab_head`
is the model's LM head itself (a shared call_module node, never copied weights) or, for heads with a
draft vocabulary, its rows of that vocabulary (gathered once when the pass runs: D x H derived
values, not trained; the verifier checks them against the LM head). Every draft node is annotated
(role draft, or lm_head / embed for those two modules). The decode loop runs the draft graph on the
hidden state of the last accepted token, after each verify step, to propose the next tree; the
verify graph's hidden output is what feeds it.

Invariants. The verify graph is not touched, so its outputs are bit for bit what they were before
the pass (tested). The heads must have been trained for this model (fingerprint of its LM head):
anything else is a mismatch, reported with both identities, and the graph is left unchanged.
Applying the pass twice is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx
from torch import nn

from specpass.errors import InvalidParameterError
from specpass.ir import arch_of
from specpass.ir.roles import DRAFT_MODULE, META_KEY, NodeInfo, Role
from specpass.passes.base import Pass, PassResult

DRAFT_HEADS = "draft_heads"
DRAFT_META = "specpass_draft"  # gm.meta key: the HeadsConfig of the draft graph


@dataclass(frozen=True)
class DraftHeads(Pass):
    """kind: "medusa" or "hydra"; heads: a `specpass train-heads` directory, or "default" for the heads
    shipped for the embedded default model."""

    kind: str = "medusa"
    heads: str = "default"

    ensures = frozenset({DRAFT_HEADS})

    def __post_init__(self):
        from specpass.heads.modules import KINDS

        if self.kind not in KINDS:
            raise InvalidParameterError(f"DraftHeads.kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.heads, str) or not self.heads:
            raise InvalidParameterError(f"DraftHeads.heads must be a directory or 'default', got {self.heads!r}")

    def directory(self) -> str:
        from specpass.heads.io import shipped_heads

        return shipped_heads(self.kind) if self.heads == "default" else self.heads

    def check(self, gm: torch.fx.GraphModule) -> str | None:
        from specpass.heads.io import model_fingerprint, read_config

        if hasattr(gm, DRAFT_MODULE):
            return "the step already has a draft graph (DraftHeads applied twice?)"
        try:
            config = read_config(self.directory())
        except (InvalidParameterError, TypeError, ValueError) as exc:
            return str(exc)
        if config.kind != self.kind:
            return f"the heads in {self.directory()} are {config.kind} heads, the pass asks for {self.kind}"
        arch = arch_of(gm)
        if (config.hidden_size, config.vocab_size) != (arch.hidden_size, arch.vocab_size):
            return (
                f"heads of hidden size {config.hidden_size} and vocabulary {config.vocab_size} do not fit a model "
                f"of hidden size {arch.hidden_size} and vocabulary {arch.vocab_size}"
            )
        identity = model_fingerprint(gm.get_submodule("lm_head"))
        if config.model != identity:
            return f"the heads in {self.directory()} were trained for model {config.model}, this model is {identity}"
        return None

    def rewrite(self, gm: torch.fx.GraphModule) -> PassResult:
        from specpass.heads.io import load_heads

        heads, config = load_heads(self.directory(), gm.get_submodule("lm_head"))
        draft = trace_draft_step(heads, gm.get_submodule("lm_head"), gm.get_submodule("embed_tokens"))
        gm.add_submodule(DRAFT_MODULE, draft)
        gm.meta[DRAFT_META] = config
        return PassResult(
            gm, True, f"added a draft graph: {config.num_heads} {config.kind} heads ({len(draft.graph.nodes)} nodes)"
        )


def trace_draft_step(heads: nn.Module, lm_head: nn.Module, embed_tokens: nn.Module) -> torch.fx.GraphModule:
    """The annotated FX graph of DraftStep(heads, lm_head, embed_tokens) (modules shared, not copied)."""
    from specpass.heads.modules import DraftStep

    step = DraftStep(heads, lm_head, embed_tokens)
    graph = torch.fx.Tracer().trace(step)
    draft = torch.fx.GraphModule(step, graph, class_name="DraftGraph")
    for node in draft.graph.nodes:
        role = Role.DRAFT
        if node.op == "placeholder":
            role = Role.INPUT
        elif node.op == "output":
            role = Role.OUTPUT
        elif node.op == "call_module" and node.target in ("vocab_head", "embed_tokens"):
            role = Role.LM_HEAD if node.target == "vocab_head" else Role.EMBED
        node.meta[META_KEY] = NodeInfo(role)
    return draft
