"""Programs the decode loop drives: a verify forward over a token tree, KV commit, a drafter and its memory.

`SpeculativeProgram` is the captured, rewritten and lowered PyTorch step of one model with its static
KV cache; `backends.onnx.program.OrtProgram` is the same step exported to ONNX and run on ONNX Runtime.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from . import cost
from ..compile import specpass_backend
from ..kernels.kernel_set import kernel_set
from .generation import check_batch_size
from .guard import ProgramGuard
from .invariance import InvarianceCheck, check_invariance
from .kv import compact, keep_rows
from ..lowering.registry import LOWERINGS
from ..options import CompileOptions, check_budget
from ...drafters import Drafter
from ...common.errors import InvalidParameterError
from ...passes import PassReport
from ...passes.runtime import RuntimeHooks
from ...ir import DraftGraphSpec, SlotLayout, capture, draft_spec
from ...ir.draft import DRAFT_STATES, STEP_OUTPUTS_META

COST_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # interpolated between: a step's cost is near linear in T
# Per process, by what they depend on (`step_signature`): a lowered step's kernels and shapes, not its
# weights' values, so programs that differ only in drafter or budget check and measure once.
_CHECKED: dict[tuple, InvarianceCheck] = {}  # the invariance check's result
_MEASURED_CURVES: dict[tuple, cost.CostCurve] = {}  # by signature, sizes and attended length


def step_signature(program: SpeculativeProgram) -> tuple:
    """What a lowered step's invariance and cost depend on: its lowering, code, tensors' names, shapes and
    dtypes, the rows its cache holds, the device and the thread count."""
    gm = getattr(program.step.run, "gm", program.step.graph_module)  # the lowered graph: its kernels
    tensors = tuple((name, tuple(t.shape), t.dtype) for name, t in [*gm.named_parameters(), *gm.named_buffers()])
    return program.step.run.lowering, gm.code, tensors, program.rows, str(program.device), torch.get_num_threads()


@dataclass(frozen=True)
class ProgramReport:
    """What building a program did: the passes, then the lowering, its kernels and the invariance check."""

    passes: PassReport
    lowering: str
    kernels: str
    invariance: InvarianceCheck | None  # None: not checked (no invariant kernels on the device)

    def __str__(self) -> str:
        checked = "not checked (no invariant kernels here)" if self.invariance is None else str(self.invariance)
        return f"{self.passes}\nlowering {self.lowering} ({self.kernels}): one function, {checked}"


@dataclass(frozen=True)
class LoweredDraft:
    """A lowered draft graph with its spec: what drafters see as `drafters.DraftModel`."""

    run: Callable[[dict], tuple]  # the lowered graph: run(inputs by name) -> outputs
    spec: DraftGraphSpec

    @property
    def config(self):
        """The draft graph's own config (heads: HeadsConfig)."""
        return self.spec.config

    def __call__(self, *args: torch.Tensor, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The spec's inputs, positionally in its order or by name; returns the spec's outputs."""
        inputs.update(zip(self.spec.input_names, args))
        return self.run(inputs)


class DecodeProgram(ABC):
    """A verify step with its KV cache, the drafter feeding it, and the device's measured cost curve.

    Subclasses set: device, cache_size (KV slots), max_nodes (largest tree), verifies_trees (False:
    draft chains only), eos_token_ids, vocab_size (token ids the embedding takes), rows (sequences
    its cache holds), hooks (the rewrites' runtime halves, passes.runtime.RuntimeHooks), and implement
    `forward`, `compact`, `keep_rows` and `kv_buffers`. Every call is over rows: one sequence is a batch
    of one (backends.runtime.decode). budget: "cost" (tree size from the measured cost curve, per step)
    or a fixed number of nodes.
    """

    device: torch.device
    cache_size: int
    max_nodes: int
    verifies_trees: bool
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def __init__(self, drafter: Drafter, budget: str | int = "cost"):
        check_budget(budget)
        self.drafter = drafter
        self.budget = budget  # "cost", or a fixed number of tree nodes per step
        self.drafter_memory = drafter.new_memory()
        self._cost: cost.CostCurve | None = None
        self.guard = ProgramGuard()  # one generation at a time (backends.runtime.guard)

    rows = 1  # sequences the program's cache holds (row b of a batch in cache row b)
    pad_token_id: int | None = None  # the model's pad token, when it has one (a batch's output padding)
    draft = None  # the draft graph (ir.draft) as a callable, when the pipeline has one
    hooks: RuntimeHooks = RuntimeHooks()  # the rewrites' runtime halves, in pipeline order

    @abstractmethod
    def forward(self, tokens: torch.Tensor, layout: SlotLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """One verify forward of B rows' steps: tokens [B, T] int64 (layout.pad_tokens) laid out by
        `layout` (row b in cache row b; each ancestor mask a chain's when the program does not verify
        trees); returns logits [B, T, V] and the states the drafters read, hidden [B, T, H] (the final
        normed states, or the step's declared output ir.draft.DRAFT_STATES: a feature draft's fused
        features), on the program's device (padding nodes' outputs are meaningless). Tokens and layout
        may be on the host (what the decode loop passes) or on that device."""

    def verify(self, tokens: torch.Tensor, layout: SlotLayout, precomputed: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, bool]:  # fmt: skip
        """`forward`, or a hook's run of it from states the drafters computed for every node
        (precomputed [B, T, H], RowsDrafting.precomputed: a self-draft's, rewrites.exit_resume); returns
        logits, hidden and whether a hook ran it."""
        if precomputed is not None:
            resumed = self.hooks.resumed_forward(layout, precomputed)
            if resumed is not None:
                return (*resumed, True)
        return (*self.forward(tokens, layout), False)

    def commit(self, layout: SlotLayout, paths: Sequence[Sequence[int]]) -> list[int]:
        """Keep each row's accepted path (node indices, root first) in consecutive slots of its own cache
        row, from its committed length on; the other rows' caches are not touched. Returns how many
        slots of each row hold committed tokens now (fewer after an eviction)."""
        paths = [list(path) for path in paths]
        self.compact(layout, paths)
        committed = [c + len(path) for c, path in zip(layout.committed, paths, strict=True)]
        return self.hooks.after_commit(layout, paths, committed)

    @abstractmethod
    def compact(self, layout: SlotLayout, paths: list[list[int]]) -> None:
        """Move each row's path's K/V into slots committed_b, committed_b + 1, ... of its cache row."""

    @abstractmethod
    def keep_rows(self, keep: Sequence[int], slots: int) -> None:
        """Move the cache rows `keep` (ascending) to rows 0, 1, ... (their first `slots` slots), the hooks'
        per-row state with them: what the next forwards of len(keep) rows read, once the other rows'
        sequences ended."""

    def measured_forward(self, tokens: torch.Tensor, layout: SlotLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward a cost curve times: tokens [T] laid out by `layout` (one row) in every row of the
        program; returns row 0's logits [T, V], hidden [T, H]."""
        logits, hidden = self.forward(tokens[None].expand(self.rows, -1), SlotLayout.of((layout,) * self.rows))
        return logits[0], hidden[0]

    @abstractmethod
    def kv_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V cache tensors as allocated now."""

    def cache_bytes(self) -> int:
        """Bytes of the tensors allocated for the KV cache and the eviction state, read from the tensors."""
        return sum(c.numel() * c.element_size() for c in self.kv_buffers()) + self.hooks.state_bytes()

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
        """The curve over `sizes`; with hooks that fix the measurement (every rank alike), the agreed one."""
        if not self.hooks.fixed_measurement:
            return cost.measure(self.measured_forward, self.device, sizes, kv_len=kv_len)
        curve = cost.measure(self.measured_forward, self.device, sizes, kv_len=kv_len, min_seconds=0.0)
        return cost.CostCurve(curve.sizes, self.hooks.agreed_seconds(curve.seconds))


class SpeculativeProgram(DecodeProgram):
    """The captured, rewritten and lowered step of `model` with its static KV cache.

    rows: how many sequences its cache holds. A program of several rows verifies every row's tree in
    one forward, commits each row's path in its own cache row and measures its cost curve on forwards
    of all its rows, T tokens each. Several rows run on the eager, oneDNN, inductor and CUDA-graph
    lowerings (the replayed graphs are bucketed by rows too, backends.lowering.cudagraphs), with every drafter
    (a cache-sharing draft graph drafts each row in its own cache row: rewrites.exit_resume), with KV
    eviction (each row its own budget and policy state) and with tensor parallelism; not with the
    GGUF kernels: refused with the reason.
    """

    def __init__(self, model: nn.Module, options: CompileOptions, rows: int = 1):
        super().__init__(options.drafter, options.budget)
        self.options = options
        self.rows = rows
        captured = capture(model, cache_size=options.cache_size, batch_size=rows)
        self.step = specpass_backend(captured, [], options=options)
        self.arch = self.step.arch
        self.eos_token_ids = self.arch.eos_token_ids
        self.vocab_size = self.arch.vocab_size
        self.pad_token_id = self.arch.pad_token_id
        gm = self.step.graph_module
        self.k_cache, self.v_cache = gm.k_cache, gm.v_cache
        self.device = self.k_cache.device
        slots = self.k_cache.shape[3]
        self.cache_size = min(slots, getattr(self.step.run, "max_attended", None) or slots)  # what the step attends over
        self.pipeline = self.step.pipeline
        self.verifies_trees = self.pipeline.verifies_trees()
        self.max_nodes = self.step.max_nodes
        if self.step.draft is not None:
            self.draft = LoweredDraft(self.step.draft.run_graph, draft_spec(gm))
        self.states_output = gm.meta.get(STEP_OUTPUTS_META, {}).get(DRAFT_STATES, 1)  # what the drafters read
        self.hooks = RuntimeHooks([hook for p in self.pipeline if (hook := p.runtime_hook(self.step)) is not None])
        self.max_nodes = min(self.max_nodes, self.hooks.max_step or self.max_nodes)  # no tree larger than a step takes
        if rows > 1:
            self._check_batchable()
        self.report = self._check_one_function()
        self.guard = ProgramGuard(model)  # and the weights it was built from, checked on every call

    def _check_batchable(self) -> None:
        """Refuse what a program of several rows does not run (see the class docstring)."""
        lowering = self.step.run.lowering
        reasons = []
        batched = {name for name, entry in LOWERINGS.items() if entry.batches}
        if lowering not in batched:
            reasons.append(f"the {lowering} lowering (use lowering='auto', or one of "
                           f"{', '.join(sorted(batched))})")  # fmt: skip
        reasons += [self.hooks.batch_refusal] if self.hooks.batch_refusal is not None else []
        if reasons:
            raise InvalidParameterError(f"batch size {self.rows} (more than one sequence) does not run with "
                                        f"{'; '.join(reasons)}; generate those one sequence at a time")  # fmt: skip

    def _check_one_function(self) -> ProgramReport:
        """Run the invariance check (backends.runtime.invariance) where the device has invariant kernels;
        refuse the program, with what differed, where it fails."""
        lowering = self.step.run.lowering
        kernels = kernel_set(self.device, self.k_cache.dtype)
        if kernels is None:
            return ProgramReport(self.step.report, lowering, f"no invariant kernels on {self.device.type} yet", None)
        key = step_signature(self)
        check = _CHECKED.get(key)
        if check is None:
            check = _CHECKED[key] = check_invariance(self)
            self.hooks.new_sequence()
        if not check.passed:
            raise InvalidParameterError(
                f"lowering {lowering!r} does not compute one function on this machine (a token's logits depend on "
                f"what else its step holds), so speculation would change the output: {check}"
            )
        return ProgramReport(self.step.report, lowering, kernels.name, check)

    def forward(self, tokens: torch.Tensor, layout: SlotLayout) -> tuple[torch.Tensor, torch.Tensor]:
        check_batch_size(self, layout.rows)
        outputs = self.step(tokens, layout)
        return outputs[0], outputs[self.states_output]  # [B, T, V], [B, T, H]

    def compact(self, layout: SlotLayout, paths: list[list[int]]) -> None:
        rows, src, dst = layout.moves(paths)
        if src:
            compact(self.k_cache, self.v_cache, *(torch.tensor(x, device=self.device) for x in (rows, src, dst)))

    def keep_rows(self, keep: Sequence[int], slots: int) -> None:
        keep_rows(self.k_cache, self.v_cache, keep, slots)
        self.hooks.keep_rows(keep)

    def measure_cost(self, sizes: Sequence[int], kv_len: int) -> cost.CostCurve:
        """Measured once per process for every program of the same step (`step_signature`), unless the
        hooks fix the measurement (every rank alike)."""
        if self.hooks.fixed_measurement:
            return super().measure_cost(sizes, kv_len)
        key = (step_signature(self), tuple(sizes), kv_len)
        if key not in _MEASURED_CURVES:
            _MEASURED_CURVES[key] = super().measure_cost(sizes, kv_len)
        return _MEASURED_CURVES[key]

    def kv_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache, self.v_cache


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BUILDING = threading.Lock()  # one thread builds or looks up programs at a time


def program_for(model: nn.Module, options: CompileOptions, rows: int = 1) -> SpeculativeProgram:
    """The program of (model, options) with a cache of `rows` sequences, built once and reused while
    the model lives and its weights stay the ones it was built from (backends.runtime.guard); after a weight
    change every program of the model is dropped and this one is built again."""
    with _BUILDING:
        programs = _PROGRAMS.setdefault(model, {})
        program = programs.get((options, rows))
        if program is not None and program.guard.stale() is not None:
            programs.clear()
            program = None
        if program is None:
            program = programs[options, rows] = SpeculativeProgram(model, options, rows)
        return program


def forget_programs(model: nn.Module) -> None:
    """Drop the programs built for `model` (program_for also drops them when the weights change)."""
    with _BUILDING:
        _PROGRAMS.pop(model, None)
