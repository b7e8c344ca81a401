"""A KV-eviction step's policy on ONNX: its two graphs exported beside the step, run on ORT after each commit.

    observe.onnx  inputs   queries     [L, B, H, n, D]   the accepted tokens' queries (rows of the step's
                                                         `queries` output, backends.kv_io)
                           keys        [L, B, KV, S, D]  the cache after the commit (S = the budget)
                           first_slot  [] int64          the accepted tokens are in slots first_slot ..
                           positions   [n] int64         their rotary positions (Keyformer's noise)
                           scores      [L, B, KV, S]     float32 per-slot scores (score-based policies)
                           window      [L, B, H, W, D]   the last W tokens' queries (SnapKV)
                  outputs  new_scores, new_window (those the policy has; none: no observe.onnx)
    evict.onnx    inputs   keys, values [L, B, KV, S, D], scores, window (those the policy has)
                  outputs  kept_keys, kept_values, kept_scores: the kept slots first, in sequence order

Both graphs are `rewrites.kv_eviction.ops.observed` / `evicted`, the functions the PyTorch
lowering's in-place eviction graphs run, so a policy keeps the same slots on ORT as in PyTorch up to
float rounding. The runtime (`OrtEviction`) holds the cache and the state as torch tensors bound with
IOBinding, so the cache stays `budget` slots: memory falls on ORT as it does in PyTorch (an
eviction holds a second copy of the cache for the moment it runs: evict.onnx is functional).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from specpass.backends.ort import TOLERANCE, ort_session, run_bound
from specpass.errors import ExportError
from specpass.rewrites.kv_eviction import KVEviction
from specpass.rewrites.kv_eviction.ops import evicted, observed
from specpass.rewrites.kv_eviction.runtime import Eviction

OBSERVE_FILE, EVICT_FILE = "observe.onnx", "evict.onnx"


class _Observe(nn.Module):
    def __init__(self, policy: KVEviction, scales: tuple[float, ...]):
        super().__init__()
        self.policy, self.scales = policy, scales

    def forward(self, queries, keys, first_slot, positions, scores=None, window=None):
        state = observed(self.policy, self.scales, queries, keys, scores, window, first_slot, positions)
        return tuple(t for t in state if t is not None)


class _Evict(nn.Module):
    def __init__(self, policy: KVEviction, scales: tuple[float, ...]):
        super().__init__()
        self.policy, self.scales = policy, scales
        self.register_buffer("protected", policy.protected(policy.budget), persistent=False)  # [budget] bool

    def forward(self, keys, values, scores=None, window=None):
        return tuple(t for t in evicted(self.policy, self.scales, self.protected, keys, values, scores, window)
                     if t is not None)  # fmt: skip


def state_names(policy: KVEviction) -> tuple[str, ...]:
    """The policy's state tensors, in the graphs' input and output order."""
    return ("scores",) * policy.scored + ("window",) * policy.window_queries


def _state_shapes(policy: KVEviction, layers: int, heads: int, kv_heads: int, dim: int) -> dict[str, tuple]:
    shapes = {"scores": (layers, 1, kv_heads, policy.budget)}
    if policy.window_queries:
        shapes["window"] = (layers, 1, heads, policy.window, dim)
    return {name: shapes[name] for name in state_names(policy)}


def _samples(policy: KVEviction, shapes: dict, kv: tuple, dtype: torch.dtype, n: int) -> tuple[dict, dict]:
    """Sample inputs of both graphs: n tokens accepted into the last n slots of a full cache (the
    exporter traces these, the check runs them); a random cache and random scores, so no two slots tie."""
    gen = torch.Generator().manual_seed(0)
    layers, _, heads, dim = shapes["queries"]
    budget = policy.budget
    keys, values = (torch.randn(kv, generator=gen).to(dtype) for _ in range(2))
    state = {"scores": torch.rand(shapes["scores"], generator=gen)} if policy.scored else {}
    if policy.window_queries:
        state["window"] = torch.randn(shapes["window"], generator=gen).to(dtype)
    observe = {"queries": torch.randn(layers, 1, heads, n, dim, generator=gen).to(dtype), "keys": keys,
               "first_slot": torch.tensor(budget - n), "positions": torch.arange(budget - n, budget) + 7, **state}
    return observe, {"keys": keys, "values": values, **state}


def export_eviction(policy: KVEviction, scales: tuple[float, ...], arch, dtype: torch.dtype, out_dir: str,
                    check: bool, quiet) -> dict:  # fmt: skip
    """Write observe.onnx and evict.onnx for `policy`; returns the manifest entry (files, state
    shapes, the ORT/PyTorch check)."""
    kv = (arch.num_layers, 1, arch.num_kv_heads, policy.budget, arch.head_dim)
    shapes = {"queries": (arch.num_layers, 1, arch.num_heads, arch.head_dim),
              **_state_shapes(policy, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim)}  # fmt: skip
    observe_inputs, evict_inputs = _samples(policy, shapes, kv, dtype, n=min(3, policy.chunk))
    names = state_names(policy)
    n = torch.export.Dim("n", min=1, max=policy.chunk)
    observe_dynamic = {"queries": {3: n}, "keys": None, "first_slot": None, "positions": {0: n}}
    evict_outputs = tuple(f"kept_{name}" for name in ("keys", "values", *names[: policy.scored]))
    graphs = {EVICT_FILE: (_Evict(policy, scales), evict_inputs, None, evict_outputs)}
    if names:  # a position-only policy (SinksWindow) keeps no state: nothing to observe
        observe_outputs = tuple(f"new_{name}" for name in names)
        graphs[OBSERVE_FILE] = (_Observe(policy, scales), observe_inputs, observe_dynamic | dict.fromkeys(names),
                                observe_outputs)  # fmt: skip
    entry = {"observe": OBSERVE_FILE if names else None, "evict": EVICT_FILE,
             "state": {k: list(v) for k, v in shapes.items() if k in names}}  # fmt: skip
    diffs = {}
    for file, (module, inputs, dynamic, outputs) in graphs.items():
        path = os.path.join(out_dir, file)
        try:
            with quiet():
                program = torch.onnx.export(module, (), kwargs=inputs, dynamo=True, dynamic_shapes=dynamic,
                                            input_names=list(inputs), output_names=list(outputs), optimize=False)  # fmt: skip
        except Exception as exc:
            raise ExportError(f"torch.onnx.export of {file} failed: {type(exc).__name__}: {str(exc)[:600]}") from exc
        program.save(path)
        if check:
            diffs[file] = _check(path, module, inputs, outputs, dtype)
    if check:
        entry["check_max_abs_diff"] = diffs
    return entry


def _check(path: str, module: nn.Module, inputs: dict, outputs: tuple[str, ...], dtype: torch.dtype) -> float:
    """onnx.checker, then ORT against PyTorch on the sample inputs; returns the largest difference."""
    import onnx

    onnx.checker.check_model(path, full_check=True)
    with torch.no_grad():
        expected = module(**inputs)
    got = ort_session(path, torch.device("cpu")).run(None, {k: v.numpy() for k, v in inputs.items()})
    worst = max(float((torch.from_numpy(g).float() - e.float()).abs().max()) for g, e in zip(got, expected))
    if not worst <= TOLERANCE[dtype]:
        raise ExportError(f"{os.path.basename(path)} on ORT differs from PyTorch by {worst:.3g} (> {TOLERANCE[dtype]})")
    return worst


class OrtEviction(Eviction):
    """observe.onnx and evict.onnx on ORT sessions, over the ORT program's cache (its `keys`, `values`
    and the last step's `queries`) and the policy's state, all torch tensors on the program's device.
    The graphs are exported for one row: in a batch each row runs them on its own slices (copied to
    contiguous tensors for the binding, and the results copied back), with its own state row."""

    def __init__(self, program, directory: str, entry: dict, policy: KVEviction):
        self.program = program  # backends.onnxrt.OrtProgram: keys, values [L, B, KV, budget, D], queries
        self.policy = policy
        self.device = program.device
        observe = entry["observe"]
        self.observe_session = ort_session(os.path.join(directory, observe), self.device) if observe else None
        self.evict_session = ort_session(os.path.join(directory, entry["evict"]), self.device)
        self.names = state_names(policy)
        dtypes = {"scores": torch.float32, "window": program.dtype}
        self.state = {name: torch.zeros(entry["state"][name], dtype=dtypes[name], device=self.device)
                      for name in self.names}  # fmt: skip  [L, rows, ...]: grown to the batch's rows
        self._row: int | None = None

    @contextlib.contextmanager
    def row(self, b: int) -> Iterator[None]:
        self._row = b
        try:
            yield
        finally:
            self._row = None

    def _rows(self) -> slice:
        """The batch rows the graphs act on now (all of a one-row cache, or the row inside `row`)."""
        rows = self.program.keys.shape[1]
        for name, tensor in self.state.items():  # a new batch of other rows: fresh state
            if tensor.shape[1] != rows:
                self.state[name] = tensor.new_zeros(tensor.shape[0], rows, *tensor.shape[2:])
        return slice(None) if rows == 1 or self._row is None else slice(self._row, self._row + 1)

    def observe(self, rows: torch.Tensor, first_slot: int, positions: torch.Tensor) -> None:
        if self.observe_session is None:
            return
        row = self._rows()
        state = {name: tensor[:, row].contiguous() for name, tensor in self.state.items()}
        inputs = {"queries": self.program.queries[:, row].index_select(3, rows).contiguous(),
                  "keys": self.program.keys[:, row].contiguous(), "first_slot": torch.tensor(first_slot, device=self.device),
                  "positions": positions, **state}  # fmt: skip
        outputs = {f"new_{name}": torch.empty_like(state[name]) for name in self.names}
        run_bound(self.observe_session, self.device, inputs, outputs)
        for name in self.names:
            self.state[name][:, row] = outputs[f"new_{name}"]

    def evict(self) -> None:
        row = self._rows()
        keys, values = self.program.keys[:, row].contiguous(), self.program.values[:, row].contiguous()
        state = {name: tensor[:, row].contiguous() for name, tensor in self.state.items()}
        inputs = {"keys": keys, "values": values, **state}
        outputs = {"kept_keys": torch.empty_like(keys), "kept_values": torch.empty_like(values)}
        if self.policy.scored:
            outputs["kept_scores"] = torch.empty_like(state["scores"])
        run_bound(self.evict_session, self.device, inputs, outputs)
        self.program.keys[:, row] = outputs["kept_keys"]  # in place: bindings (CUDA graphs) keep the cache's memory
        self.program.values[:, row] = outputs["kept_values"]
        if self.policy.scored:
            self.state["scores"][:, row] = outputs["kept_scores"]

    def keep_rows(self, keep: Sequence[int]) -> None:
        index = torch.tensor(list(keep), device=self.device)
        self.state = {name: tensor.index_select(1, index) for name, tensor in self.state.items()}

    def reset(self) -> None:
        for tensor in self.state.values():
            tensor.zero_()

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())
