"""The eager lowering: a rewritten GraphModule run as it is (also the base the other lowerings wrap)."""

from __future__ import annotations

import torch
import torch.fx

from ...ir.layout import SlotLayout


class EagerStep:
    """Runs a GraphModule directly: the rewritten step itself (`eager`, the reference) or its oneDNN lowering.

    The `backends.lowering.registry.Step` contract: `step(input_ids [B, T], layout)` (an ir.layout.SlotLayout) returns the graph's outputs (logits [B, T, V], hidden [B, T, H],
    ...); `run_graph` takes the graph's inputs by name (a draft graph is called that way, with its
    DraftGraphSpec's inputs).
    """

    min_tokens = 1  # the fewest tokens a replayed bucket should hold (graph-replay lowerings pad up to it)
    min_rows = 1  # likewise the fewest rows, in a program whose cache holds several
    max_attended: int | None = None  # the longest attended length the step runs (None: the whole cache)

    def __init__(self, gm: torch.fx.GraphModule, lowering: str = "eager"):
        self.gm = gm
        self.lowering = lowering  # its name in backends.lowering.registry.LOWERINGS
        self.input_names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        self.device = next(iter([*gm.parameters(), *gm.buffers()]), torch.empty(0)).device

    @torch.no_grad()
    def run_graph(self, inputs: dict):
        return self.gm(**{name: inputs[name] for name in self.input_names})

    def __call__(self, input_ids: torch.Tensor, layout: SlotLayout):
        """input_ids [B, T] and layout on the host or on the step's device."""
        return self.run_graph(layout.to(self.device).step_inputs(input_ids.to(self.device)))
