"""Sparse attention during decoding: a layer attends to `tokens` chosen cache slots instead of all.

Papers: TidalDecode (position-persistent sparse attention), TokenSelect (per-head soft voting). A
selecting layer inserts `ir.ops.select_slots` (each query's own slot, then its highest-scoring
visible slots); a sparse layer's attention becomes `ir.ops.selected_attention` over the latest
selection. Slot indices are the same in every layer, so one selection serves the layers after it.

| pass | layers | selects by | paper |
| --- | --- | --- | --- |
| `TidalDecode` | full up to the first selecting layer; the selecting layers attend fully and choose; the others attend to the latest choice | each query head's logits | TidalDecode |
| `TokenSelect` | every layer chooses for itself, then attends sparsely | the sum over heads of each head's softmax (one choice per token) | TokenSelect |

Every token of every step follows the same rule, prompt included (the papers prefill densely): a
token's selection and attention are a function of its own query and the slots it sees, so any split
of the input into steps, and speculation, give the same output as one token a step. The cache keeps
every token (memory unchanged); what falls is the attention's reads and work in the sparse layers.
With `tokens` at least the context, the output is the full model's. Lossy and opt-in.
Refused: a second sparse-attention pass, sliding-window, soft-capped or sink attention, a sharded step.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.fx

from ..common.errors import GraphVerificationError, InvalidParameterError
from ..ir import arch_of, query
from ..ir.ops import select_slots, selected_attention
from ..ir.roles import Role, annotate, info
from ..passes.base import CAPTURED, Pass, PassResult
from ..passes.export import ExportHook
from .tree_attention import TREE_ATTENTION

SPARSE_ATTENTION = "sparse_attention"


def _check_tokens(owner: str, tokens: object) -> None:
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise InvalidParameterError(f"{owner}.tokens must be an int >= 1, got {tokens!r}")


@dataclass(frozen=True)
class SparseAttention(Pass):
    """Base of the sparse-attention passes (module docstring). tokens: the slots a query attends to in
    a sparse layer, its own included."""

    tokens: int = 256

    requires = frozenset({CAPTURED, TREE_ATTENTION})
    ensures = frozenset({SPARSE_ATTENTION})
    changes_output = "sparse attention: some layers attend to a chosen subset of the cache, so the output may differ"

    vote: ClassVar[bool]  # one choice per token (TokenSelect) or per query head (TidalDecode)
    selecting_layers_attend_fully: ClassVar[bool]

    def __post_init__(self):
        _check_tokens(self.name, self.tokens)

    @abstractmethod
    def selecting_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers that choose slots, ascending (raises InvalidParameterError where none fit)."""

    def export_hook(self, gm: torch.fx.GraphModule, arch, dtype: torch.dtype) -> ExportHook:
        """Nothing beside the step: selection and attention are ops inside it."""
        return ExportHook()

    def check(self, gm: torch.fx.GraphModule) -> str | None:
        graph = gm.graph
        attention = query.attention_ops(graph)
        if any(op.target is selected_attention for op in attention):
            return "the step already attends sparsely"
        other = {op.target for op in attention} - {query.SDPA}
        if other:
            return "the model's attention has sinks or soft-capped logits, which the sparse attention op does not compute"
        window = arch_of(gm).smallest_window
        if window is not None:
            return f"the model has sliding-window layers (window {window}): they already restrict what a query sees"
        if query.is_sharded(graph):
            return "the step is sharded over processes (TensorParallel): a choice would see only this process's heads"
        if query.shared_write_slots(graph) is None:
            return "the cache writes do not share one slot index (a query's own slot is read from it)"
        try:
            self.selecting_layers(arch_of(gm).num_layers)
        except InvalidParameterError as exc:
            return str(exc)
        return None

    def rewrite(self, gm: torch.fx.GraphModule) -> PassResult:
        graph = gm.graph
        num_layers = arch_of(gm).num_layers
        selecting = set(self.selecting_layers(num_layers))
        own = query.shared_write_slots(graph)  # [B, T]: each token's slot
        selection, sparse = None, []
        for layer, attention in enumerate(query.attention_ops(graph)):
            q, k, v = attention.args[:3]
            mask, scale = attention.kwargs["attn_mask"], attention.kwargs["scale"]
            if layer in selecting:
                with graph.inserting_before(attention):
                    selection = graph.call_function(select_slots, (q, k, mask, scale, self.tokens, own, self.vote))
                annotate(selection, Role.ATTENTION, layer)
                if self.selecting_layers_attend_fully:
                    continue
            if selection is None:
                continue
            with graph.inserting_before(attention):
                new = graph.call_function(selected_attention, (q, k, v),
                                          {"attn_mask": mask, "scale": scale, "selected": selection})  # fmt: skip
            annotate(new, Role.ATTENTION, layer)
            attention.replace_all_uses_with(new)
            graph.erase_node(attention)
            sparse.append(layer)
        graph.lint()
        gm.recompile()
        summary = (f"{len(selecting)} selecting layer(s) {sorted(selecting)}; {len(sparse)} of {num_layers} layers "
                   f"attend to {self.tokens} slots")  # fmt: skip
        return PassResult(gm, True, summary)

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """Each layer's attention is full or sparse as the pass decided; a sparse one reads the selection
        of its own layer or the latest layer before it that selects, with this pass's token count."""
        num_layers = arch_of(gm).num_layers
        selecting = self.selecting_layers(num_layers)
        for layer, attention in enumerate(query.attention_ops(gm.graph)):
            chosen = [s for s in selecting if s <= layer]
            if not chosen or (layer in selecting and self.selecting_layers_attend_fully):
                if attention.target is selected_attention:
                    raise GraphVerificationError(f"{self.name}: layer {layer} attends sparsely, expected fully")
                continue
            selection = attention.kwargs.get("selected") if attention.target is selected_attention else None
            if selection is None or selection.target is not select_slots:
                raise GraphVerificationError(f"{self.name}: layer {layer} does not attend to a selection")
            if info(selection).layer != chosen[-1] or selection.args[4] != self.tokens or selection.args[6] != self.vote:
                raise GraphVerificationError(
                    f"{self.name}: layer {layer} reads the selection of layer {info(selection).layer}, "
                    f"expected layer {chosen[-1]}'s of {self.tokens} slots"
                )


@dataclass(frozen=True)
class TidalDecode(SparseAttention):
    """TidalDecode: full attention up to the first selecting layer; each selecting layer attends
    fully and chooses, per query head, the `tokens` slots of highest logits; every other layer after
    it attends to the latest choice. selecting: the choosing layers (negative ones count from the top);
    None is the paper's: the third layer and the one 13/32 of the way up (13 of Llama-3-8B's 32)."""

    selecting: tuple[int, ...] | None = None

    vote = False
    selecting_layers_attend_fully = True

    def __post_init__(self):
        super().__post_init__()
        chosen = self.selecting
        if chosen is not None:
            chosen = tuple(chosen) if isinstance(chosen, (list, tuple)) else chosen
            if not isinstance(chosen, tuple) or not chosen or any(
                    not isinstance(i, int) or isinstance(i, bool) for i in chosen):  # fmt: skip
                raise InvalidParameterError(f"TidalDecode.selecting must be a non-empty tuple of layers, got {self.selecting!r}")
            object.__setattr__(self, "selecting", chosen)  # JSON gives a list

    def selecting_layers(self, num_layers: int) -> tuple[int, ...]:
        chosen = (2, round(13 * num_layers / 32)) if self.selecting is None else self.selecting
        bad = [i for i in chosen if not -num_layers <= i < num_layers]
        if bad:
            raise InvalidParameterError(f"TidalDecode: selecting layer(s) {bad} outside the model's {num_layers} layers")
        layers = sorted({i % num_layers for i in chosen})
        if layers[0] >= num_layers - 1:
            raise InvalidParameterError(
                f"TidalDecode: no layer is left to attend sparsely after layer {layers[0]} of {num_layers}"
            )
        return tuple(layers)


@dataclass(frozen=True)
class TokenSelect(SparseAttention):
    """TokenSelect: every layer chooses the `tokens` slots its heads attend to by soft voting (each
    head's softmax over the visible slots, summed over heads: one choice per token), then attends to
    them. The paper's selection cache (reusing a choice while queries stay alike) is not built."""

    vote = True
    selecting_layers_attend_fully = False

    def selecting_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(range(num_layers))
