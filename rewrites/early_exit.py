"""Early exit: the step's own first k layers as a draft model, sharing its KV cache (self-speculation).

Papers: LayerSkip, Draft & Verify, Kangaroo, SWIFT (DEL, SpecEE for the adaptive side). Two side graphs
are cut from the verify graph after layer k - 1 (ir.split), sharing its modules and cache: the draft
graph (kind "early-exit", called as a step: layers [0, k) and an exit head; it returns the exit's logits
and `exit_hidden` and writes layers [0, k)'s K/V in the token's own slot) and the resume graph (layers
[k, L) from `exit_hidden`), so a chain the draft ran is verified without running its lower layers again.
The exit head is the model's final norm and LM head, or a trained exit adapter (heads.exit_adapter).

Invariants. The verify graph is untouched; draft then resume equals it bit for bit, outputs and cache
writes (tested for every family); neither graph holds the other's layers (`verify`). After TreeAttention,
no pass after it. Refused: k outside [1, L), a second draft graph, an adapter for another model or layer.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx

from ..common.errors import GraphVerificationError, InvalidParameterError
from ..ir import arch_of, info
from ..ir.draft import EARLY_EXIT_KIND, DraftGraphSpec, DraftTensor, draft_graph, resume_graph
from ..ir.roles import Role, annotate
from ..ir.split import EXIT_HIDDEN, exit_graph
from ..ir.split import resume_graph as cut_resume_graph
from ..passes.draft import DraftGraphPass
from .ladder_residual import laddered_layers
from .tree_attention import TREE_ATTENTION

EARLY_EXIT = "early_exit"
SHIPPED_ADAPTER = "exit_adapter"  # the shipped adapter's name (heads.io.shipped_heads)
ADAPTER_MODULE = "exit_adapter"  # the draft graph's submodule holding the adapter
TOKENS = "T"  # the step's token dimension in the spec


@dataclass(frozen=True)
class EarlyExitConfig:
    """The draft graph's config: where it exits, of how many layers, over how many cache slots."""

    layer: int  # the draft runs layers [0, layer)
    num_layers: int
    cache_size: int
    agreement: float = 0.0  # an exit adapter's held-out top-1 agreement with the model (0: not known)


class ResumingDraftPass(DraftGraphPass):
    """A self-draft whose verify step resumes at `resume_layer` from the states the draft left there
    (the early exit and the layer skip)."""

    @property
    @abstractmethod
    def resume_layer(self) -> int:
        """The first layer the verify step runs after the draft's states."""

    def build_resume(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return cut_resume_graph(gm, self.resume_layer)

    def runtime_hook(self, step):
        """The verify step resumes from the draft's states (rewrites.exit_resume)."""
        from .exit_resume import ExitResume

        return ExitResume(step)

    @classmethod
    def config_from_dict(cls, data: dict) -> EarlyExitConfig:
        return EarlyExitConfig(**data)


@dataclass(frozen=True)
class EarlyExit(ResumingDraftPass):
    """layer: the draft runs the step's layers [0, layer), then exits through the step's final norm + LM
    head, or with `adapter` (a `specpass train-heads --kind exit-adapter` directory, or "default" for
    the one shipped for the embedded default model) through that trained exit adapter."""

    layer: int = 8
    adapter: str | None = None

    requires = frozenset({TREE_ATTENTION})
    ensures = frozenset({EARLY_EXIT})

    def __post_init__(self):
        if not isinstance(self.layer, int) or isinstance(self.layer, bool) or self.layer < 1:
            raise InvalidParameterError(f"EarlyExit.layer must be a positive int, got {self.layer!r}")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise InvalidParameterError(f"EarlyExit.adapter must be a directory, 'default' or None, got {self.adapter!r}")

    def adapter_directory(self) -> str | None:
        from ..heads.io import shipped_heads

        return shipped_heads(SHIPPED_ADAPTER) if self.adapter == "default" else self.adapter

    def check_draft(self, gm: torch.fx.GraphModule) -> str | None:
        layers = arch_of(gm).num_layers
        if self.layer >= layers:
            return f"an exit after layer {self.layer} leaves none of the model's {layers} layers to verify with"
        if laddered_layers(gm.graph, layers):
            return "the step is laddered (LadderResidual): a ladder crosses the layer boundary the exit cuts at"
        return None if self.adapter is None else self._check_adapter(gm)

    def _check_adapter(self, gm: torch.fx.GraphModule) -> str | None:
        from ..heads.exit_adapter import read_exit_adapter_config
        from ..heads.io import model_mismatch

        directory = self.adapter_directory()
        try:
            config = read_exit_adapter_config(directory)
        except InvalidParameterError as exc:
            return str(exc)
        if config.layer != self.layer:
            return (f"the exit adapter in {directory} reads the stream after layer {config.layer}, not {self.layer}: "
                    f"use EarlyExit({config.layer}, adapter=...)")  # fmt: skip
        return model_mismatch("exit adapter", directory, config.model, config.hidden_size, config.vocab_size, gm)

    def build_draft(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, DraftGraphSpec, str]:
        from ..heads.exit_adapter import load_exit_adapter

        draft = exit_graph(gm, self.layer, arch_of(gm).num_layers)
        if self.adapter is None:
            spec = resumable_spec(gm, draft, self.name, self.layer)
            return draft, spec, f"layers 0-{self.layer - 1} + the model's final norm and LM head, sharing the KV cache"
        adapter = load_exit_adapter(self.adapter_directory(), gm.get_submodule("lm_head"))
        draft = exit_through_adapter(draft, adapter)
        spec = resumable_spec(gm, draft, self.name, self.layer, adapter.config.draft_vocab, adapter.config.agreement)
        summary = (f"layers 0-{self.layer - 1} + a trained exit adapter ({adapter.config.blocks} MLP block, "
                   f"{adapter.config.draft_vocab}-token head), sharing the KV cache")  # fmt: skip
        return draft, spec, summary

    @property
    def resume_layer(self) -> int:
        return self.layer

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """The draft graph runs only layers < k, the resume graph only layers >= k, and both still take
        the verify step's inputs (the resume graph `exit_hidden` in place of `input_ids`)."""
        super().verify(gm)
        left_out = f"a layer >= {self.layer}"
        verify_draft_and_resume(gm, self.name, lambda layer: layer >= self.layer, left_out, self.layer)
        draft = draft_graph(gm)
        exits_through_adapter = any(n.op == "call_module" and n.target == ADAPTER_MODULE for n in draft.graph.nodes)
        if exits_through_adapter != (self.adapter is not None):
            raise GraphVerificationError(f"{self.name}: the draft graph {'does not exit' if self.adapter else 'exits'} "
                                         "through an exit adapter")  # fmt: skip
        if self.adapter is not None and any(info(n).role in (Role.LM_HEAD, Role.NORM) and info(n).layer is None
                                            for n in draft.graph.nodes):  # fmt: skip
            raise GraphVerificationError(f"{self.name}: the adapter's draft graph still runs the step's final norm "
                                         "or LM head")  # fmt: skip


def exit_through_adapter(draft: torch.fx.GraphModule, adapter: torch.nn.Module) -> torch.fx.GraphModule:
    """The exit graph `draft` with `adapter` (heads.exit_adapter) in place of its final norm and LM head:
    outputs (the adapter's logits [B, T, D], exit_hidden [B, T, H], vocab [D]); the step's final norm
    and LM head, read by nothing any more, leave the graph."""
    graph = draft.graph
    output = next(n for n in graph.nodes if n.op == "output")
    exit_hidden = output.args[0][1]
    draft.add_submodule(ADAPTER_MODULE, adapter)
    with graph.inserting_before(output):
        logits = annotate(graph.call_module(ADAPTER_MODULE, (exit_hidden,)), Role.DRAFT)
        vocab = annotate(graph.get_attr(f"{ADAPTER_MODULE}.vocab"), Role.DRAFT)
    output.args = ((logits, exit_hidden, vocab),)
    graph.eliminate_dead_code()
    graph.lint()
    draft.delete_all_unused_submodules()
    draft.recompile()
    return draft


def resumable_spec(gm: torch.fx.GraphModule, draft: torch.fx.GraphModule, source: str, layer: int,
                   draft_vocab: int = 0, agreement: float = 0.0) -> DraftGraphSpec:  # fmt: skip
    """The spec of a draft graph called as a step and verified by resuming at `layer` (EarlyExit,
    LayerSkip): it takes the step's own inputs and returns the draft's logits and `exit_hidden`, the
    stream the resume graph starts from, and with a draft vocabulary of `draft_vocab` tokens (an exit
    adapter's) the logits are over those and their ids `vocab` come third; `agreement`: the exit
    head's measured agreement, the drafter's prior; drafters.SelfDraft drives every graph of this kind."""
    arch = arch_of(gm)
    outputs = (DraftTensor("logits", (1, TOKENS, draft_vocab or arch.vocab_size), "model"),
               DraftTensor(EXIT_HIDDEN, (1, TOKENS, arch.hidden_size), "model"))  # fmt: skip
    if draft_vocab:
        outputs += (DraftTensor("vocab", (draft_vocab,), "int64"),)
    return DraftGraphSpec(
        kind=EARLY_EXIT_KIND,
        source=source,
        inputs=tuple(DraftTensor(n.target, (), "step") for n in draft.graph.nodes if n.op == "placeholder"),
        outputs=outputs,
        config=EarlyExitConfig(layer, arch.num_layers, gm.k_cache.shape[3], agreement),
        shares_cache=True,
    )


def verify_draft_and_resume(gm: torch.fx.GraphModule, owner: str, left_out: Callable[[int], bool], left_out_text: str,
                            resume_from: int) -> None:  # fmt: skip
    """The invariants of a draft graph verified by resuming (EarlyExit, LayerSkip): the step has its
    resume graph; the draft graph runs no layer that `left_out` names (`left_out_text` says which in
    the error); the resume graph runs no layer below `resume_from`; both still take the verify step's
    inputs (the resume graph `exit_hidden` in place of `input_ids`), which a later pass would break."""

    def fail(message: str) -> None:
        raise GraphVerificationError(f"{owner}: {message}")

    draft, resume = draft_graph(gm), resume_graph(gm)
    if resume is None:
        fail("the step lost its resume graph")
    if any(info(n).layer is not None and left_out(info(n).layer) for n in draft.graph.nodes):
        fail(f"the draft graph runs {left_out_text}")
    if any(info(n).layer is not None and info(n).layer < resume_from for n in resume.graph.nodes):
        fail(f"the resume graph runs a layer < {resume_from}")
    step_inputs = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    if [n.target for n in draft.graph.nodes if n.op == "placeholder"] != step_inputs:
        fail(f"the draft graph's inputs are no longer the verify step's (a pass after {owner} changed it)")
    resumed = [EXIT_HIDDEN if name == "input_ids" else name for name in step_inputs]
    if [n.target for n in resume.graph.nodes if n.op == "placeholder"] != resumed:
        fail(f"the resume graph's inputs are no longer the verify step's (a pass after {owner} changed it)")
