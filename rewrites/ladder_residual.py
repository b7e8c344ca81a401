"""Ladder residual: each sub-layer of the chosen layers reads the residual stream from two sub-layers back.

Paper: Ladder Residual (Zhang et al., 2025). Number the sub-layers k (layer i: attention 2i, MLP 2i + 1)
and let s_k be the residual stream after sub-layer k's output is added. A laddered sub-layer computes
s_k = s_{k-1} + f_k(s_{k-2}) instead of s_k = s_{k-1} + f_k(s_{k-1}), so under tensor parallelism the
all-reduce of sub-layer k - 1 overlaps sub-layer k's compute. The rewrite only redirects which stream a
sub-layer's first nodes read: no node is added or removed; the residual adds and the final norm's input
are unchanged.

Invariants. Layers outside the chosen set compute what they did (`verify`). The model's function changes
(docs/experiments.md, "Ladder residual"), so the pass is opt-in and a pipeline holding it says so.
Refused: an already laddered graph, a step with an early-exit resume graph. No layers: no change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..common.errors import GraphVerificationError, InvalidParameterError
from ..ir import arch_of
from ..ir.draft import resume_graph
from ..ir.query import residual_adds
from ..ir.roles import info
from ..passes.base import Pass, PassResult
from ..passes.export import ExportHook

LADDER_RESIDUAL = "ladder_residual"


def _stream_input(add: torch.fx.Node) -> torch.fx.Node:
    """The residual stream a residual add extends (its first operand: `h + f(h)`)."""
    return add.args[0]


def _readers(stream: torch.fx.Node, layer: int, residual_add: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes of `layer` that read `stream` as a sub-layer input (every user in the layer but its residual add)."""
    return [u for u in stream.users if info(u).layer == layer and u is not residual_add]


def laddered_layers(graph: torch.fx.Graph, num_layers: int) -> tuple[int, ...]:
    """Layers whose MLP reads the layer's input rather than the stream after its attention."""
    laddered = []
    for layer in range(num_layers):
        adds = residual_adds(graph, layer)
        if len(adds) == 2 and not _readers(adds[0], layer, adds[1]):
            laddered.append(layer)
    return tuple(laddered)


@dataclass(frozen=True)
class LadderResidual(Pass):
    """layers: the layers to ladder, as indices (negative ones count from the top: (-2, -1) is the top
    two); () is the identity."""

    layers: tuple[int, ...] = ()

    ensures = frozenset({LADDER_RESIDUAL})
    changes_output = "LadderResidual rewires residual inputs: a different model unless it was trained laddered"

    def __post_init__(self):
        layers = tuple(self.layers) if isinstance(self.layers, (list, tuple)) else self.layers
        if not isinstance(layers, tuple) or any(not isinstance(i, int) or isinstance(i, bool) for i in layers):
            raise InvalidParameterError(f"LadderResidual.layers must be a tuple of layer indices, got {self.layers!r}")
        object.__setattr__(self, "layers", layers)  # JSON gives a list

    @classmethod
    def top(cls, count: int) -> LadderResidual:
        """The top `count` layers laddered."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InvalidParameterError(f"the number of laddered layers must be an int >= 0, got {count!r}")
        return cls(tuple(range(-count, 0)))

    def resolved(self, num_layers: int) -> tuple[int, ...]:
        """The chosen layers as indices in [0, num_layers), ascending (raises on a bad index)."""
        bad = [i for i in self.layers if not -num_layers <= i < num_layers]
        if bad:
            raise InvalidParameterError(f"LadderResidual: layer(s) {bad} outside the model's {num_layers} layers")
        chosen = sorted(i % num_layers for i in self.layers)
        if len(set(chosen)) != len(chosen):
            raise InvalidParameterError(f"LadderResidual: a layer is named twice in {self.layers}")
        return tuple(chosen)

    def export_hook(self, gm: torch.fx.GraphModule, arch, dtype: torch.dtype) -> ExportHook:
        """Nothing beside the step: the ladder rewires streams inside the step, not its inputs or outputs."""
        return ExportHook()

    def check(self, gm: torch.fx.GraphModule) -> str | None:
        num_layers = arch_of(gm).num_layers
        try:
            chosen = self.resolved(num_layers)
        except InvalidParameterError as exc:
            return str(exc)
        already = laddered_layers(gm.graph, num_layers)
        if already:
            return f"the graph is already laddered (layers {list(already)})"
        if resume_graph(gm) is not None:
            return "the step has an early-exit resume graph cut at a layer boundary, which a ladder crosses"
        for layer in chosen:
            adds = residual_adds(gm.graph, layer)
            if len(adds) != 2:
                return f"layer {layer} has {len(adds)} residual adds, not the two (attention, MLP) a ladder rewires"
        return None

    def rewrite(self, gm: torch.fx.GraphModule) -> PassResult:
        graph = gm.graph
        chosen = self.resolved(arch_of(gm).num_layers)
        for layer in chosen:
            attention_add, mlp_add = residual_adds(graph, layer)
            layer_input = _stream_input(attention_add)  # s_{2i-1}
            attention_readers = _readers(layer_input, layer, attention_add)
            mlp_readers = _readers(attention_add, layer, mlp_add)
            if layer > 0:  # the attention reads s_{2i-2}: layer i-1's stream before its MLP output
                before_mlp = residual_adds(graph, layer - 1)[0]
                for reader in attention_readers:
                    reader.replace_input_with(layer_input, before_mlp)
            for reader in mlp_readers:  # the MLP reads the layer's input
                reader.replace_input_with(attention_add, layer_input)
        graph.lint()
        summary = f"laddered layers {list(chosen)}; the model's function changes" if chosen else "no layers chosen"
        return PassResult(gm, modified=bool(chosen), summary=summary)

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """Exactly the chosen layers are laddered (their MLP reads the layer's input), and a layer's
        attention reads layer i-1's stream before its MLP output iff layer i > 0 is laddered."""
        graph = gm.graph
        num_layers = arch_of(gm).num_layers
        chosen = self.resolved(num_layers)
        found = laddered_layers(graph, num_layers)
        if found != chosen:
            raise GraphVerificationError(f"LadderResidual: layers {list(found)} are laddered, expected {list(chosen)}")
        for layer in range(1, num_layers):
            adds, before = residual_adds(graph, layer), residual_adds(graph, layer - 1)
            if len(adds) != 2 or len(before) != 2:
                continue  # a block a ladder cannot rewire: `check` refused it if it was chosen
            reads_before_mlp = bool(_readers(before[0], layer, adds[0]))
            if reads_before_mlp != (layer in chosen):
                raise GraphVerificationError(
                    f"LadderResidual: layer {layer}'s attention {'does not read' if layer in chosen else 'reads'} "
                    f"layer {layer - 1}'s stream before its MLP output"
                )
