"""The runtime-hook protocol: a rewrite's runtime half, what the decode loop does around the step it made.

A pass whose rewritten step needs more than forward-and-commit provides a `RuntimeHook`: KV eviction
frees slots after each commit, tensor parallelism keeps every process's decisions equal, a self-draft
resumes the verify step above its exit. A program (backends.runtime.program, backends.onnx.program)
composes its pipeline's hooks in pipeline order (`RuntimeHooks`), so neither the program nor the loop
asks which rewrites ran. Every method has the neutral default. It lives here, below rewrites/ and
backends/, so a rewrite's runtime half sits beside its rewrite without a rewrites -> backends import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from ..ir.layout import SlotLayout


class LoweredGraph(Protocol):
    """A lowered graph of a step (backends.lowering): its module and a call by input name."""

    gm: torch.fx.GraphModule

    def run_graph(self, inputs: dict) -> tuple[torch.Tensor, ...]: ...


class LoweredStep(Protocol):
    """What a PyTorch program's hooks may read of its lowered step (backends.compile.CompiledStep)."""

    graph_module: torch.fx.GraphModule  # the rewritten step, owner of the KV cache buffers
    draft: LoweredGraph | None  # the lowered draft graph (ir.draft), when the pipeline has one
    resume: LoweredGraph | None  # the lowered resume graph (ir.split), with a cache-sharing draft graph
    lowering: str  # the lowering's name (backends.lowering.registry.LOWERINGS)

    def lower_side(self, gm: torch.fx.GraphModule) -> LoweredGraph:
        """`gm`, a graph over the step's tensors, lowered as the step's side graphs are."""


class RuntimeHook:
    """What a rewritten step asks of the decode loop (module docstring)."""

    max_step: int | None = None  # the most tokens one forward may take (prompts are fed in pieces); None: no limit
    fixed_cache: int | None = None  # the KV slots a sequence's cache has, fixed by the rewrite (an eviction budget)
    batch_refusal: str | None = None  # why a program with this hook cannot run several rows; None: it can
    fixed_measurement = False  # the cost curve is measured by a fixed number of forwards (every process alike)

    def new_sequence(self) -> None:
        """A batch's first forward is next: drop per-sequence state."""

    def resumed_forward(self, layout: SlotLayout, precomputed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The verify forward run from states the drafters computed for every node of every row
        (precomputed [B, T, H]: a self-draft's states below its exit): logits [B, T, V], hidden [B, T, H],
        as the step's forward gives them; None: this hook cannot, the step's own forward runs."""
        return None

    def prefill_forward(self, tokens: torch.Tensor, layout: SlotLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A forward of prompt tokens [B, T] (a chain per row, backends.runtime.decode.feed) run by this
        hook: logits [B, T, V], hidden [B, T, H] as the step's forward gives them; None: the step's own
        forward runs (a prefill-pruning rewrite's prefill graph, rewrites.lazy_llm)."""
        return None

    def after_commit(self, layout: SlotLayout, paths: Sequence[Sequence[int]], committed: list[int]) -> list[int]:
        """After each row's accepted path was compacted into its cache row: each row's committed slots
        now (`committed` as the program or an earlier hook left them; an eviction returns fewer)."""
        return committed

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Rows `keep` (ascending) of this hook's per-row state move to rows 0, 1, ... as the cache's do
        when the other rows' sequences ended."""

    def drafting_row(self, row: int) -> contextlib.AbstractContextManager:
        """Inside the block, a draft graph that shares the step's cache drafts for cache row `row`."""
        return contextlib.nullcontext()

    def agreed_size(self, size: int) -> int:
        """The tree size every process verifies this step, from this process's choice."""
        return size

    def agreed_choice(self, choice: bool) -> bool:
        """Whether every process drafts this step (backends.runtime.gate), from this process's choice."""
        return choice

    def agreed_seconds(self, seconds: tuple[float, ...]) -> tuple[float, ...]:
        """The cost curve's timings every process adopts, from this process's measurement."""
        return seconds

    def state_bytes(self) -> int:
        """Bytes of the tensors this hook keeps beside the KV cache (an eviction policy's scores)."""
        return 0


class RuntimeHooks(RuntimeHook):
    """A program's hooks in pipeline order, composed into one: each question is asked of every hook."""

    def __init__(self, hooks: Sequence[RuntimeHook] = ()):
        self.hooks = tuple(hooks)
        limits = [hook.max_step for hook in self.hooks if hook.max_step is not None]
        self.max_step = min(limits) if limits else None
        refusals = [hook.batch_refusal for hook in self.hooks if hook.batch_refusal is not None]
        self.batch_refusal = "; ".join(refusals) if refusals else None
        self.fixed_measurement = any(hook.fixed_measurement for hook in self.hooks)

    def __iter__(self) -> Iterator[RuntimeHook]:
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks)

    def new_sequence(self) -> None:
        for hook in self.hooks:
            hook.new_sequence()

    def resumed_forward(self, layout, precomputed):
        return next((out for hook in self.hooks if (out := hook.resumed_forward(layout, precomputed)) is not None),
                    None)  # fmt: skip

    def prefill_forward(self, tokens, layout):
        return next((out for hook in self.hooks if (out := hook.prefill_forward(tokens, layout)) is not None), None)

    def after_commit(self, layout, paths, committed):
        return self._chain(lambda hook, value: hook.after_commit(layout, paths, value), committed)

    def keep_rows(self, keep) -> None:
        for hook in self.hooks:
            hook.keep_rows(keep)

    @contextlib.contextmanager
    def drafting_row(self, row: int) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.drafting_row(row))
            yield

    def agreed_size(self, size: int) -> int:
        return self._chain(lambda hook, value: hook.agreed_size(value), size)

    def agreed_choice(self, choice: bool) -> bool:
        return self._chain(lambda hook, value: hook.agreed_choice(value), choice)

    def agreed_seconds(self, seconds):
        return self._chain(lambda hook, value: hook.agreed_seconds(value), seconds)

    def state_bytes(self) -> int:
        return sum(hook.state_bytes() for hook in self.hooks)

    def _chain(self, ask: Callable, value):
        for hook in self.hooks:
            value = ask(hook, value)
        return value
