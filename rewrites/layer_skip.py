"""Layer skip: the step with the layers in `skip` left out as a draft model, sharing its KV cache
(self-speculation; papers: SWIFT, Draft & Verify, Unified Layer Skipping).

Side graphs of rewrites.EarlyExit's form (ir.split), so drafters.SelfDraft drives either: the draft graph
is the whole step without the skipped layers (a skipped layer's readers read the stream after the last
kept layer before it) and returns `exit_hidden`, the stream before the first skipped layer s; the resume
graph is EarlyExit's at s. Layers below s run once per token and write the step's own K/V; the kept
layers above s write approximate K/V, which the resumed verify overwrites.

Invariants. The verify graph is untouched; draft then resume equals it (tested). Refused: an empty set,
layer 0, a layer past the model's, a laddered step, a second draft graph. A draft call costs about
(L - |skip|) / L of a step, so which set pays is measured (docs/experiments.md, "Self-speculation").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx

from ..common.errors import InvalidParameterError
from ..ir import arch_of
from ..ir.draft import DraftGraphSpec
from ..ir.split import skip_graph
from .early_exit import ResumingDraftPass, resumable_spec, verify_draft_and_resume
from .ladder_residual import laddered_layers
from .tree_attention import TREE_ATTENTION

LAYER_SKIP = "layer_skip"


@dataclass(frozen=True, init=False)
class LayerSkip(ResumingDraftPass):
    """skip: the layers the draft leaves out (stored sorted, without repeats)."""

    skip: tuple[int, ...]

    requires = frozenset({TREE_ATTENTION})
    ensures = frozenset({LAYER_SKIP})

    def __init__(self, skip: Iterable[int] = ()):
        layers = tuple(skip) if isinstance(skip, Iterable) and not isinstance(skip, (str, bytes)) else None
        if layers is None or any(not isinstance(k, int) or isinstance(k, bool) or k < 0 for k in layers):
            raise InvalidParameterError(f"LayerSkip.skip must be layer indices (ints >= 0), got {skip!r}")
        object.__setattr__(self, "skip", tuple(sorted(set(layers))))

    @classmethod
    def span(cls, first: int, count: int) -> LayerSkip:
        """Skip `count` consecutive layers from `first` (`specpass.research.skip_search` finds sets that agree more)."""
        return cls(range(first, first + count))

    def check_draft(self, gm: torch.fx.GraphModule) -> str | None:
        layers = arch_of(gm).num_layers
        if not self.skip:
            return "the skip set is empty: the draft would be the model itself"
        if self.skip[0] == 0:
            return "the skip set names layer 0: the draft would reuse no layer's K/V (skip later layers)"
        if self.skip[-1] >= layers:
            return f"the skip set names layer {self.skip[-1]} but the model has {layers} layers"
        if laddered_layers(gm.graph, layers):
            return "the step is laddered (LadderResidual): a ladder crosses the layers the draft leaves out"
        return None

    def build_draft(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, DraftGraphSpec, str]:
        layers = arch_of(gm).num_layers
        draft = skip_graph(gm, frozenset(self.skip), layers)
        spec = resumable_spec(gm, draft, self.name, self.skip[0])  # SelfDraft drives it as an early exit's
        return draft, spec, (f"the step without layers {_ranges(self.skip)} ({layers - len(self.skip)} of {layers} "
                             f"layers), sharing the KV cache; verified from layer {self.skip[0]}")  # fmt: skip

    @property
    def resume_layer(self) -> int:
        """The first skipped layer: the verify step resumes there."""
        return self.skip[0]

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """The draft graph runs no skipped layer, the resume graph no layer below the first skipped
        one, and both still take the verify step's inputs."""
        super().verify(gm)
        verify_draft_and_resume(gm, self.name, lambda layer: layer in self.skip, f"a layer of {self.skip}",
                                self.skip[0])  # fmt: skip


def _ranges(layers: tuple[int, ...]) -> str:
    """(3, 4, 5, 9) -> '3-5, 9'."""
    spans: list[list[int]] = []
    for layer in layers:
        if spans and spans[-1][1] == layer - 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)

