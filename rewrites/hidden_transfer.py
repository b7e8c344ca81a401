"""Hidden Transfer: pseudo hidden states of the next K positions, transferred from the stream entering layer
k and decoded through the step's own layers [k, L) (paper: Wu et al. 2024, "Parallel Decoding via Hidden
Transfer for Lossless Large Language Model Acceleration"; the trained maps: heads.hidden_transfer).

The verify graph gains one declared output (ir.draft.add_step_output), DRAFT_STATES [B, T, H]: the
residual stream entering layer k, where the step computes it; its other outputs stay bit for bit. The
draft graph is cut from the step (ir.split's resume cut at k, sharing its modules and KV cache) with the
trained transfer in front: it is called as a step over K tokens in a chain after the committed prefix,
its `exit_hidden` input the last accepted token's DRAFT_STATES row repeated K times, and returns the
LM head's logits [1, K, V]: pseudo token j's draft of the token after it (drafters.PseudoTokens). It
writes layers [k, L)'s K/V in the K slots after the prefix, which the next verify step overwrites for
every node it places there and never reads elsewhere (the layout masks them), so it changes no output.

The paper decodes the pseudo states in the same forward as the verification; here they run as one
call after it, because the state they are transferred from is the last accepted token's, known only
once the step has verified (docs/design.md, "Hidden Transfer"). Refused, graph unchanged: a transfer
trained for another model or layer count, a laddered step, a second draft graph. Not exported to ONNX
(no export hook: the draft graph shares the step's cache, as the self-drafts' do).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx

from ..common.errors import GraphVerificationError, InvalidParameterError, SpecpassError
from ..ir import arch_of, info
from ..ir.draft import (DRAFT_STATES, HIDDEN_TRANSFER_KIND, DraftGraphSpec, DraftTensor, add_step_output, draft_graph,
                        draft_spec, step_output)  # fmt: skip
from ..ir.roles import Role, annotate
from ..ir.split import EXIT_HIDDEN, layer_output
from ..ir.split import resume_graph as cut_resume_graph
from ..passes.draft import DraftGraphPass
from .ladder_residual import laddered_layers
from .tree_attention import TREE_ATTENTION

HIDDEN_TRANSFER = "hidden_transfer"
TRANSFER_MODULE = "hidden_transfer"  # the draft graph's submodule: the trained maps


@dataclass(frozen=True)
class HiddenTransfer(DraftGraphPass):
    """transfer: a `specpass train-heads --kind hidden-transfer` directory."""

    transfer: str

    requires = frozenset({TREE_ATTENTION})
    ensures = frozenset({HIDDEN_TRANSFER})

    def __post_init__(self):
        if not isinstance(self.transfer, str) or not self.transfer:
            raise InvalidParameterError(f"HiddenTransfer.transfer must be a directory, got {self.transfer!r}")

    def check_draft(self, gm: torch.fx.GraphModule) -> str | None:
        from ..heads.hidden_transfer import read_transfer_config
        from ..heads.io import model_mismatch

        try:
            config = read_transfer_config(self.transfer)
        except SpecpassError as exc:
            return str(exc)
        mismatch = model_mismatch("hidden transfer", self.transfer, config.model, config.hidden_size,
                                  config.vocab_size, gm)  # fmt: skip
        if mismatch is not None:
            return mismatch
        layers = arch_of(gm).num_layers
        if config.num_layers != layers:
            return (f"the transfer in {self.transfer} was trained for a {config.num_layers}-layer model, this one has "
                    f"{layers}")  # fmt: skip
        if laddered_layers(gm.graph, layers):
            return ("the step is laddered (LadderResidual): a ladder crosses the layer boundary the pseudo states "
                    "enter at")  # fmt: skip
        return None

    def build_draft(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, DraftGraphSpec, str]:
        from ..heads.hidden_transfer import load_transfer

        transfer = load_transfer(self.transfer, gm.get_submodule("lm_head"))
        config = transfer.config
        draft = cut_resume_graph(gm, config.layer)  # layers [k, L), final norm, LM head from `exit_hidden`
        graph = draft.graph
        source = next(n for n in graph.nodes if n.op == "placeholder" and n.target == EXIT_HIDDEN)
        draft.add_submodule(TRANSFER_MODULE, transfer)
        with graph.inserting_after(source):
            pseudo = annotate(graph.call_module(TRANSFER_MODULE, (source,)), Role.DRAFT)  # [1, K, H]
        source.replace_all_uses_with(pseudo, delete_user_cb=lambda user: user is not pseudo)
        output = next(n for n in graph.nodes if n.op == "output")
        output.args = ((output.args[0][0],),)  # the logits only
        graph.eliminate_dead_code()
        graph.lint()
        draft.delete_all_unused_submodules()
        draft.recompile()
        add_step_output(gm, layer_output(gm.graph, config.layer - 1), DRAFT_STATES)
        arch = arch_of(gm)
        spec = DraftGraphSpec(
            kind=HIDDEN_TRANSFER_KIND,
            source=self.name,
            inputs=tuple(DraftTensor(n.target, (), "step") for n in graph.nodes if n.op == "placeholder"),
            outputs=(DraftTensor("logits", (1, "T", arch.vocab_size), "model"),),
            config=dataclasses.replace(config, cache_size=gm.k_cache.shape[3]),
            shares_cache=True,
        )
        summary = (f"{config.pseudo_tokens} pseudo tokens transferred into layer {config.layer}, decoded through "
                   f"layers {config.layer}-{arch.num_layers - 1} + the LM head, sharing the KV cache")  # fmt: skip
        return draft, spec, summary

    def runtime_hook(self, step):
        """The draft graph drafts in one cache row at a time (rewrites.exit_resume)."""
        from .exit_resume import CacheRowDrafting

        return CacheRowDrafting(step)

    @classmethod
    def config_from_dict(cls, data: dict):
        from ..heads.hidden_transfer import HiddenTransferConfig

        return HiddenTransferConfig(**dict(data, accuracy=tuple(tuple(row) for row in data.get("accuracy", ()))))

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """The step outputs the stream entering layer k; the draft graph runs only layers >= k, starts
        from the transfer of its `exit_hidden` input and takes the verify step's other inputs."""
        super().verify(gm)
        layer = draft_spec(gm).config.layer
        if step_output(gm, DRAFT_STATES) is not layer_output(gm.graph, layer - 1):
            _fail(f"the step's {DRAFT_STATES!r} output is not the stream entering layer {layer}")
        draft = draft_graph(gm)
        if any(info(n).layer is not None and info(n).layer < layer for n in draft.graph.nodes):
            _fail(f"the draft graph runs a layer < {layer}")
        source = next((n for n in draft.graph.nodes if n.op == "placeholder" and n.target == EXIT_HIDDEN), None)
        users = list(source.users) if source is not None else []
        if len(users) != 1 or users[0].op != "call_module" or users[0].target != TRANSFER_MODULE:
            _fail(f"the draft graph's {EXIT_HIDDEN!r} input does not go through the transfer alone")
        step_inputs = [EXIT_HIDDEN if n.target == "input_ids" else n.target
                       for n in gm.graph.nodes if n.op == "placeholder"]  # fmt: skip
        if [n.target for n in draft.graph.nodes if n.op == "placeholder"] != step_inputs:
            _fail(f"the draft graph's inputs are no longer the verify step's (a pass after {self.name} changed it)")


def _fail(message: str) -> None:
    raise GraphVerificationError(f"HiddenTransfer: {message}")
