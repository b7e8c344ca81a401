"""Which layers a LayerSkip draft should leave out: a training-free search (SWIFT-style).

A candidate skip set is scored by teacher-forced agreement: run the captured step with those layers
left out (ir.split.skip_graph) over a token sequence as one chain, and count the positions where its
next-token argmax equals the full step's. Agreement is what a greedy self-draft's acceptance rests on
(a chain of depth d is accepted token by token while it agrees), and one forward per candidate
measures it over hundreds of positions.

Search. Sets grow one layer at a time (greedy, as SWIFT's layer-set optimisation does within a
budget of work): at each size, every layer not yet in the set is tried and the one whose omission
keeps agreement highest joins. That is `num_layers` forwards per size, so a search to size n costs
about n * L forwards of the sequence. Layer 0 is never a candidate (LayerSkip refuses it: the verify
resumes from the first skipped layer and needs a layer below it).

The sequence should be text the model will continue (its own greedy continuations are best: their
tokens are what a draft must agree with); the result's agreement per size says what each size buys,
and the draft's cost, about (L - size) / L of a step, says what it costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..common.errors import InvalidParameterError
from ..ir import SlotLayout, arch_of, capture
from ..ir.split import skip_graph


@dataclass(frozen=True)
class SkipSearch:
    """The search's result: for each size n (1, 2, ...), the set chosen and its agreement."""

    sets: tuple[tuple[int, ...], ...]  # sets[n - 1]: the n layers left out, sorted
    agreement: tuple[float, ...]  # agreement[n - 1]: its next-token agreement with the full step
    positions: int  # positions scored per candidate
    forwards: int  # forwards the search ran

    def best(self, min_agreement: float) -> tuple[int, ...]:
        """The largest set whose agreement is at least `min_agreement` (empty when none is)."""
        kept = [s for s, a in zip(self.sets, self.agreement) if a >= min_agreement]
        return kept[-1] if kept else ()


@torch.no_grad()
def search_skip_sets(model: nn.Module, input_ids: torch.Tensor, max_size: int) -> SkipSearch:
    """Greedy search of skip sets of 1..max_size layers for `model` over `input_ids` [1, P] (module
    docstring). The model is captured here (float32 on a CPU is fine: agreement does not need speed)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 2:
        raise InvalidParameterError("input_ids must be one sequence [1, P] of at least 2 tokens")
    step = capture(model, cache_size=input_ids.shape[1])
    layers = arch_of(step).num_layers
    if not isinstance(max_size, int) or isinstance(max_size, bool) or not 1 <= max_size < layers - 1:
        raise InvalidParameterError(f"max_size must be an int in [1, {layers - 2}] for a {layers}-layer model, "
                                    f"got {max_size!r}")  # fmt: skip
    names = {n.target for n in step.graph.nodes if n.op == "placeholder"}  # a chain step's: no tree inputs
    inputs = {k: v for k, v in SlotLayout.chain(0, input_ids.shape[1]).step_inputs(input_ids).items() if k in names}
    target = step(**inputs)[0][0].argmax(-1)  # [P]: the full step's next tokens

    def agreement(skip: frozenset[int]) -> float:
        logits = skip_graph(step, skip, layers)(**inputs)[0][0]  # [P, V]
        return float((logits.argmax(-1) == target).float().mean())

    chosen: frozenset[int] = frozenset()
    sets, scores, forwards = [], [], 1
    for _ in range(max_size):
        scored = {layer: agreement(chosen | {layer}) for layer in range(1, layers) if layer not in chosen}
        forwards += len(scored)
        layer = max(scored, key=lambda k: (scored[k], k))  # ties: the higher layer (more reused, a shorter resume)
        chosen = chosen | {layer}
        sets.append(tuple(sorted(chosen)))
        scores.append(round(scored[layer], 4))
    return SkipSearch(tuple(sets), tuple(scores), input_ids.shape[1], forwards)
