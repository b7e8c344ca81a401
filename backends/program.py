"""A speculative program: the captured, rewritten and lowered decode step of one model, with its cache."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from specpass.backends import cost
from specpass.backends.compile import specpass_backend
from specpass.backends.kv import compact
from specpass.backends.options import CompileOptions
from specpass.ir import capture

COST_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class SpeculativeProgram:
    def __init__(self, model: nn.Module, options: CompileOptions):
        self.options = options
        captured = capture(model, cache_size=options.cache_size)
        self.step = specpass_backend(captured, [], options=options)
        self.arch = self.step.arch
        self.report = self.step.report
        gm = self.step.graph_module
        self.k_cache, self.v_cache = gm.k_cache, gm.v_cache
        self.device = self.k_cache.device
        self.cache_size = self.k_cache.shape[3]
        self.tree = "tree_mask" in self.step.input_names
        self.max_nodes = self.step.max_nodes
        self.drafter_memory = options.drafter.new_memory()
        self._cost: cost.CostCurve | None = None

    def forget(self) -> None:
        """Drop what the drafter learned in earlier generations (Token Recycling's successor table)."""
        self.drafter_memory = self.options.drafter.new_memory()

    @property
    def cost_curve(self) -> cost.CostCurve:
        """Measured once per program (a few dozen forwards)."""
        if self._cost is None:
            largest = min(self.max_nodes, self.cache_size)
            sizes = [n for n in COST_SIZES if n <= largest]
            if sizes[-1] != largest:
                sizes.append(largest)
            kv_len = min(max(256, 2 * largest), self.cache_size)
            self._cost = cost.measure(self.step, self.tree, self.device, sizes, kv_len=kv_len)
        return self._cost

    def forward(self, tokens, positions, tree_mask, start: int) -> torch.Tensor:
        """Run T tokens whose K/V go to slots [start, start + T); returns logits [T, V].

        tokens, positions: [T] int64; tree_mask: [T, T] ancestor mask (must be lower-triangular
        all-True, a chain, when the program has no TreeAttention).
        """
        t = tokens.shape[0]
        inputs = {"input_ids": tokens[None], "positions": positions[None], "kv_len": start + t}
        if self.tree:
            inputs["tree_mask"] = tree_mask[None]
            inputs["cache_slots"] = torch.arange(start, start + t, device=self.device)
        logits, _ = self.step(**inputs)
        return logits[0]

    def commit(self, start: int, path: list[int]) -> None:
        """Move the accepted path's K/V (tree node indices `path`) to slots start, start + 1, ..."""
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
