"""Programs the decode loop drives: a verify forward over a token tree, KV commit, a drafter and its memory.

`SpeculativeProgram` is the captured, rewritten and lowered PyTorch step of one model with its static
KV cache; `backends.onnxrt.OrtProgram` is the same step exported to ONNX and run on ONNX Runtime.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specpass.backends import cost
from specpass.backends.compile import specpass_backend
from specpass.backends.kv import compact
from specpass.backends.options import CompileOptions, check_budget
from specpass.backends.per_size import FastestPerSize
from specpass.drafters import Drafter
from specpass.heads.modules import HeadsConfig
from specpass.ir import capture
from specpass.rewrites.draft_heads import DRAFT_META

COST_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
PREFILL_SIZES = (4, 16, 64)  # measured beside the tree sizes when a lowering is chosen per size


@dataclass(frozen=True)
class LoweredDraft:
    """A lowered draft graph with its heads' config: what drafters see as `DraftModel`."""

    run: Callable  # called with the draft graph's inputs as keywords
    config: HeadsConfig

    def __call__(
        self, hidden: torch.Tensor, tokens: torch.Tensor, head: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run(hidden=hidden, tokens=tokens, head=head)  # logits [N, D], vocab [D]


class DecodeProgram(ABC):
    """A verify step with its KV cache, the drafter feeding it, and the device's measured cost curve.

    Subclasses set: device, cache_size (KV slots), max_nodes (largest tree), tree (False: chains only),
    eos_token_ids, vocab_size (token ids the embedding takes), and implement `forward` and `commit`.
    budget: "cost" (tree size from the measured cost curve, per step) or a fixed number of nodes.
    """

    device: torch.device
    cache_size: int
    max_nodes: int
    tree: bool
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def __init__(self, drafter: Drafter, budget: str | int = "cost"):
        check_budget(budget)
        self.drafter = drafter
        self.budget = budget  # "cost", or a fixed number of tree nodes per step
        self.drafter_memory = drafter.new_memory()
        self._cost: cost.CostCurve | None = None

    draft = None  # the draft graph (rewrites.DraftHeads) as a callable, when the pipeline has one

    @abstractmethod
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run T tokens whose K/V go to slots [start, start + T); returns logits [T, V], hidden [T, H].

        tokens, positions: [T] int64; tree_mask: [T, T] ancestor mask (lower-triangular all-True, a
        chain, when the program has no TreeAttention). Slots [0, start) are the committed prefix.
        """

    @abstractmethod
    def commit(self, start: int, path: Sequence[int]) -> None:
        """Keep the K/V of tree nodes `path` (root first) in slots start, start + 1, ..."""

    def forget(self) -> None:
        """Drop what the drafter learned in earlier generations (Token Recycling's successor table)."""
        self.drafter_memory = self.drafter.new_memory()

    @property
    def cost_curve(self) -> cost.CostCurve:
        """Verify latency for T = 1 .. max_nodes, measured once per program (a few dozen forwards)."""
        if self._cost is None:
            largest = min(self.max_nodes, self.cache_size)
            sizes = [n for n in COST_SIZES if n <= largest]
            if sizes[-1] != largest:
                sizes.append(largest)
            kv_len = min(max(256, 2 * largest), self.cache_size)
            self._cost = self.measure_cost(sizes, kv_len)
        return self._cost

    def measure_cost(self, sizes: Sequence[int], kv_len: int) -> cost.CostCurve:
        return cost.measure(self.forward, self.device, sizes, kv_len=kv_len)


class SpeculativeProgram(DecodeProgram):
    def __init__(self, model: nn.Module, options: CompileOptions):
        super().__init__(options.drafter, options.budget)
        self.options = options
        captured = capture(model, cache_size=options.cache_size)
        self.step = specpass_backend(captured, [], options=options)
        self.arch = self.step.arch
        self.eos_token_ids = self.arch.eos_token_ids
        self.vocab_size = self.arch.vocab_size
        self.report = self.step.report
        gm = self.step.graph_module
        self.k_cache, self.v_cache = gm.k_cache, gm.v_cache
        self.device = self.k_cache.device
        self.cache_size = self.k_cache.shape[3]
        self.tree = "tree_mask" in self.step.input_names
        self.max_nodes = self.step.max_nodes
        if self.step.draft is not None:
            self.draft = LoweredDraft(self.step.draft, gm.meta[DRAFT_META])

    def forward(self, tokens, positions, tree_mask, start: int) -> torch.Tensor:
        t = tokens.shape[0]
        inputs = {"input_ids": tokens[None], "positions": positions[None], "kv_len": start + t}
        if self.tree:
            inputs["tree_mask"] = tree_mask[None]
            inputs["cache_slots"] = torch.arange(start, start + t, device=self.device)
        logits, hidden = self.step(**inputs)[:2]
        return logits[0], hidden[0]

    def measure_cost(self, sizes: Sequence[int], kv_len: int) -> cost.CostCurve:
        """With several lowerings (`auto` on a CPU): each one's curve, then each tree size runs on the
        fastest, and the program's curve is their lower envelope. The lowerings' curves also cover a few
        sizes past the largest tree, so the prefill (T = prompt length) runs on the kernel that wins at
        large T."""
        run = self.step.run
        if not isinstance(run, FastestPerSize):
            return super().measure_cost(sizes, kv_len)
        measured = sorted(set(sizes) | {n for n in PREFILL_SIZES if n <= kv_len})
        curves = {}
        for kind in run.kinds:
            with run.pinned(kind):
                curves[kind] = super().measure_cost(measured, kv_len)
        return run.choose(curves).subset(sizes)

    def commit(self, start: int, path: Sequence[int]) -> None:
        moved = [(start + node, start + i) for i, node in enumerate(path) if node != i]
        if moved:
            src = torch.tensor([s for s, _ in moved], device=self.device)
            dst = torch.tensor([d for _, d in moved], device=self.device)
            compact(self.k_cache, self.v_cache, src, dst)


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def program_for(model: nn.Module, options: CompileOptions) -> SpeculativeProgram:
    """The program of (model, options), built once and reused while the model lives."""
    programs = _PROGRAMS.setdefault(model, {})
    if options not in programs:
        programs[options] = SpeculativeProgram(model, options)
    return programs[options]
