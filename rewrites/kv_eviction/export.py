"""A KV-eviction step's export hook: its policy's two graphs, to run beside the exported step.

observe.onnx: inputs queries [L, B, H, n, D] (the accepted tokens' rows of the step's `queries` output),
keys [L, B, KV, S, D] (the cache after the commit, S = the budget), first_slot [] and positions [n]
int64, and the state the policy has (scores [L, B, KV, S] float32; window [L, B, H, W, D] for SnapKV);
outputs new_scores / new_window (a policy without state has no observe.onnx). evict.onnx: keys, values
and the state -> kept_keys, kept_values, kept_scores, the kept slots first, in sequence order. Both are
`ops.observed` / `ops.evicted`, the functions the PyTorch eviction graphs run, so ORT keeps the same
slots up to float rounding. They are exported for one row; a runtime runs them on each row's slices
(rewrites.kv_eviction.onnx_runtime.OrtEviction). The manifest entry "eviction" names the files and state shapes.
"""

from __future__ import annotations

import torch
from torch import nn

from ...passes.export import ExportGraph, ExportHook
from .ops import evicted, observed

OBSERVE_FILE, EVICT_FILE = "observe.onnx", "evict.onnx"
MANIFEST_KEY = "eviction"


class _Observe(nn.Module):
    def __init__(self, policy, scales: tuple[float, ...]):
        super().__init__()
        self.policy, self.scales = policy, scales

    def forward(self, queries, keys, first_slot, positions, scores=None, window=None):
        state = observed(self.policy, self.scales, queries, keys, scores, window, first_slot, positions)
        return tuple(t for t in state if t is not None)


class _Evict(nn.Module):
    def __init__(self, policy, scales: tuple[float, ...]):
        super().__init__()
        self.policy, self.scales = policy, scales
        self.register_buffer("protected", policy.protected(policy.budget), persistent=False)  # [budget] bool

    def forward(self, keys, values, scores=None, window=None):
        return tuple(t for t in evicted(self.policy, self.scales, self.protected, keys, values, scores, window)
                     if t is not None)  # fmt: skip


def state_names(policy) -> tuple[str, ...]:
    """The state tensors of `policy` (the KVEviction pass, rewrites.kv_eviction.base), in the graphs'
    input and output order."""
    return ("scores",) * policy.scored + ("window",) * policy.window_queries


def _state_shapes(policy, layers: int, heads: int, kv_heads: int, dim: int) -> dict[str, tuple]:
    shapes = {"scores": (layers, 1, kv_heads, policy.budget)}
    if policy.window_queries:
        shapes["window"] = (layers, 1, heads, policy.window, dim)
    return {name: shapes[name] for name in state_names(policy)}


def _samples(policy, shapes: dict, kv: tuple, dtype: torch.dtype, n: int) -> tuple[dict, dict]:
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


def eviction_export(policy, scales: tuple[float, ...], arch, dtype: torch.dtype) -> ExportHook:
    """The hook of `policy` on a step of `arch` (ir.ArchSpec) whose attention scales are `scales`."""
    kv = (arch.num_layers, 1, arch.num_kv_heads, policy.budget, arch.head_dim)
    shapes = {"queries": (arch.num_layers, 1, arch.num_heads, arch.head_dim),
              **_state_shapes(policy, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim)}  # fmt: skip
    observe_inputs, evict_inputs = _samples(policy, shapes, kv, dtype, n=min(3, policy.chunk))
    names = state_names(policy)
    evict_outputs = tuple(f"kept_{name}" for name in ("keys", "values", *names[: policy.scored]))
    graphs = [ExportGraph(EVICT_FILE, _Evict(policy, scales), evict_inputs, evict_outputs)]
    if names:  # a position-only policy (SinksWindow) keeps no state: nothing to observe
        n = torch.export.Dim("n", min=1, max=policy.chunk)
        dynamic = {"queries": {3: n}, "keys": None, "first_slot": None, "positions": {0: n}} | dict.fromkeys(names)
        graphs.append(ExportGraph(OBSERVE_FILE, _Observe(policy, scales), observe_inputs,
                                  tuple(f"new_{name}" for name in names), dynamic))  # fmt: skip
    entry = {"observe": OBSERVE_FILE if names else None, "evict": EVICT_FILE,
             "state": {k: list(v) for k, v in shapes.items() if k in names}}  # fmt: skip
    return ExportHook(MANIFEST_KEY, tuple(graphs), entry)
