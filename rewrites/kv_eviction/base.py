"""KV-cache eviction as a graph rewrite: the pass every policy (policies.py) shares.

Papers: StreamingLLM (sinks), H2O, A2SF, TOVA, SnapKV, Keyformer, TRIM-KV, EMS. The cache holds at most `budget` tokens
per layer and KV head (the K/V buffers are cut to `budget` slots); when the committed tokens fill it, the
policy keeps `kept = budget - chunk` and the next `chunk` tokens fill the freed slots. Evicting in chunks
puts evictions at fixed token counts, so any split of the input into steps gives the same cache and
speculation changes nothing of its own. Keys keep their original rotary positions, so evicting a token
is exactly hiding it from attention. Scores come from committed tokens only.

Rewrite: cut the caches, add the policy's state buffers, record each layer's queries
(`ops.record_queries`; a gated policy, TrimKV: its gates' log retention of each token, `ops.record_retention`)
and add the side graphs `kv_observe` / `kv_evict` (ops.py), run after each commit.
Refused: a second eviction pass, sliding-window or soft-capped attention, an early-exit step, a sharded step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.fx

from ...common.errors import GraphVerificationError, InvalidParameterError
from ...ir import arch_of, model_parts, query
from ...ir.draft import resume_graph
from ...ir.ops import selected_attention, sink_attention
from ...ir.roles import Role, annotate, info
from ...passes.base import CAPTURED, Pass, PassResult
from . import ops
from ..tree_attention import TREE_ATTENTION

KV_EVICTION = "kv_eviction"
EVICTION_META = "specpass_eviction"  # gm.meta key holding the eviction pass that rewrote the step


def attention_scales(gm: torch.fx.GraphModule) -> tuple[float, ...]:
    """Each layer's softmax scale: the eviction graphs score with the attention's own."""
    return tuple(layer.attention.scale for layer in model_parts(gm).layers)


def check_int(owner: str, name: str, value: object, low: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidParameterError(f"{owner}.{name} must be an int >= {low}, got {value!r}")


GATES_MODULE = "retention_gates"


def _record_retention(gm: torch.fx.GraphModule, gates: torch.nn.Module) -> None:
    """Each layer's query projection reads its input through `ops.record_retention`, which stores the
    gates' log retention of the step's tokens (the gates become the step's submodule)."""
    gm.add_submodule(GATES_MODULE, gates)
    graph = gm.graph
    store = None
    projections = [n for n in graph.nodes if n.op == "call_module" and info(n).role in (Role.Q, Role.QKV)]
    for node in projections:
        layer, x = info(node).layer, node.args[0]
        with graph.inserting_before(node):
            store = store or annotate(graph.get_attr(ops.RETENTION), Role.EVICTION)
            retention = annotate(graph.call_module(GATES_MODULE, (layer, x)), Role.EVICTION, layer)
            recorded = annotate(graph.call_function(ops.record_retention, (store, layer, x, retention)), Role.EVICTION, layer)
        node.args = (recorded, *node.args[1:])


@dataclass(frozen=True)
class KVEviction(Pass):
    """Base of the eviction policies (module docstring). budget: cache slots per layer and KV head;
    chunk: slots freed per eviction (the largest step the cache takes: trees and prompt pieces)."""

    budget: int
    chunk: int = 32

    requires = frozenset({CAPTURED, TREE_ATTENTION})
    ensures = frozenset({KV_EVICTION})
    changes_output = "KV eviction: output may differ from the full-cache model's (attention sees only the kept tokens)"

    scored: ClassVar[bool] = True  # keeps per-slot scores updated by every accepted token
    window_queries: ClassVar[bool] = False  # keeps the queries of the last `window` tokens (SnapKV)
    gumbel: ClassVar[bool] = False  # Gumbel noise on the scoring logits (Keyformer)
    gated: ClassVar[bool] = False  # tokens scored by learned gates at creation, ranked with their age (TrimKV)
    merges: ClassVar[bool] = False  # the slots not kept merge into their nearest kept slot (EMS)

    def __post_init__(self):
        check_int(self.name, "budget", self.budget, low=2)
        check_int(self.name, "chunk", self.chunk)
        if self.chunk >= self.budget:
            raise InvalidParameterError(f"{self.name}: chunk ({self.chunk}) must be below the budget ({self.budget})")
        if self.protected_count() > self.kept:
            raise InvalidParameterError(
                f"{self.name}: {self.protected_count()} protected slots do not fit the {self.kept} slots kept "
                f"(budget {self.budget} - chunk {self.chunk})"
            )

    @property
    def kept(self) -> int:
        """Tokens left in every layer's cache after an eviction."""
        return self.budget - self.chunk

    def protected_count(self) -> int:
        """How many slots the policy always keeps (sinks, a recent window)."""
        return int(self.protected(self.budget).sum())

    def protected(self, slots: int) -> torch.Tensor:
        """[slots] bool: slots kept whatever their score, when all `slots` are full."""
        return torch.zeros(slots, dtype=torch.bool)

    def update(self, scores: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """New scores [B, KV, S] from the old and the accepted tokens' attention [B, KV, n, S]."""
        raise NotImplementedError

    def priority(self, scores: torch.Tensor | None, slot_positions: torch.Tensor | None = None,
                 local: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """What is kept first [L, B, KV, S], from the scores [L, B, KV, S] (a gated policy's with its
        slot positions) or the observation window's attention `local` (SnapKV); ranks per KV head
        unless overridden."""
        return scores if scores is not None else local

    def pool(self, attention: torch.Tensor) -> torch.Tensor:
        """The observation window's attention [B, KV, S] smoothed over neighbouring slots (SnapKV pools)."""
        return attention

    def gates(self) -> torch.nn.Module | None:
        """A gated policy's gate module: gates(layer, x [B, T, hidden]) -> log retention [B, T, KV]."""
        return None

    def check(self, gm: torch.fx.GraphModule) -> str | None:
        if EVICTION_META in gm.meta:
            return f"the step already evicts ({type(gm.meta[EVICTION_META]).__name__})"
        other = {op.target for op in query.attention_ops(gm.graph)} - {query.SDPA, selected_attention}
        if other:
            return ("the model's attention has sinks: the eviction scores would need the sink's share"
                    if sink_attention in other else
                    "the model soft-caps its attention logits: the eviction scores would need the cap")  # fmt: skip
        arch = arch_of(gm)
        if arch.smallest_window is not None:
            window = arch.smallest_window
            return f"the model has sliding-window layers (window {window}): eviction would need the window's own rule"
        if resume_graph(gm) is not None:
            return "the step has an early-exit draft graph, which records queries one token at a time"
        if query.is_sharded(gm.graph):
            return "the step is sharded over processes (TensorParallel)"
        return None

    def rewrite(self, gm: torch.fx.GraphModule) -> PassResult:
        layers, batch, kv, _, dim = gm.k_cache.shape
        arch = arch_of(gm)
        device, dtype = gm.k_cache.device, gm.k_cache.dtype
        buffers = {}
        for name in ("k_cache", "v_cache"):  # [L, B, KV, budget, D]: memory falls to the budget
            buffers[name] = torch.zeros(layers, batch, kv, self.budget, dim, device=device, dtype=dtype)
        if self.scored:
            buffers[ops.SCORES] = torch.zeros(layers, batch, kv, self.budget, device=device)
        rows = 1 << (self.chunk - 1).bit_length()  # a graph-replay lowering pads a step to a power of two
        if self.gated:  # the tokens' log retention is recorded, not their queries
            buffers[ops.RETENTION] = torch.zeros(layers, batch, kv, rows, device=device)
            buffers[ops.SLOT_POSITIONS] = torch.zeros(layers, batch, kv, self.budget, device=device)
        else:
            buffers[ops.QUERIES] = torch.zeros(layers, batch, arch.num_heads, rows, dim, device=device, dtype=dtype)
        if self.window_queries:
            buffers[ops.WINDOW_QUERIES] = torch.zeros(layers, batch, arch.num_heads, self.window, dim,
                                                      device=device, dtype=dtype)  # fmt: skip
        for name, buffer in buffers.items():
            gm.register_buffer(name, buffer, persistent=False)
        graph = gm.graph
        if self.gated:
            _record_retention(gm, self.gates())
        store = None
        for layer, attention in enumerate(query.attention_ops(graph) if not self.gated else ()):
            if store is None:
                with graph.inserting_before(attention):
                    store = annotate(graph.get_attr(ops.QUERIES), Role.EVICTION)
            with graph.inserting_before(attention):
                recorded = graph.call_function(ops.record_queries, (store, layer, attention.args[0]))
                annotate(recorded, Role.EVICTION, layer)
            attention.args = (recorded, *attention.args[1:])
        scales = attention_scales(gm)
        state = {name: buffers[name] for name in buffers if name not in ("k_cache", "v_cache")}
        shared = {"k_cache": buffers["k_cache"], "v_cache": buffers["v_cache"], **state}
        gm.add_submodule(ops.OBSERVE_MODULE, ops.trace(ops.Observe(self, shared, scales)))
        gm.add_submodule(ops.EVICT_MODULE, ops.trace(ops.Evict(self, shared, scales)))
        gm.meta[EVICTION_META] = self
        state_bytes = sum(b.numel() * b.element_size() for b in state.values())
        recorded = "log retention" if self.gated else "queries"
        summary = (f"cache cut to {self.budget} slots, {self.kept} kept per eviction; {recorded} recorded in "
                   f"{layers} layers; policy state {state_bytes / 2**20:.2f} MiB")  # fmt: skip
        return PassResult(gm, True, summary)

    def runtime_hook(self, step):
        """The policy's graphs run after each commit (rewrites.kv_eviction.runtime.GraphEviction)."""
        from .runtime import GraphEviction

        return GraphEviction(step.graph_module, step.graph_module.meta[EVICTION_META])

    def onnx_runtime_hook(self, program):
        """The exported policy graphs run on ORT after each commit (rewrites.kv_eviction.onnx_runtime)."""
        from .onnx_runtime import OrtEviction

        return OrtEviction(program, self)

    def export_hook(self, gm: torch.fx.GraphModule, arch, dtype: torch.dtype):
        """The policy's graphs beside the exported step (rewrites.kv_eviction.export)."""
        from .export import eviction_export

        return eviction_export(gm.meta[EVICTION_META], attention_scales(gm), arch, dtype)

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """The cache is `budget` slots; every layer's attention reads its queries through the
        recording op; both eviction graphs are there and read the step's own buffers."""
        if gm.k_cache.shape[3] != self.budget or gm.v_cache.shape[3] != self.budget:
            raise GraphVerificationError(f"{self.name}: the cache has {gm.k_cache.shape[3]} slots, not {self.budget}")
        if self.gated:
            layers = sorted(n.args[1] for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.record_retention)
            if layers != list(range(arch_of(gm).num_layers)):
                raise GraphVerificationError(f"{self.name}: the layers recording their tokens' retention are {layers}")
        for layer, attention in enumerate(query.attention_ops(gm.graph) if not self.gated else ()):
            q = attention.args[0]
            if q.op != "call_function" or q.target is not ops.record_queries or q.args[1] != layer:
                raise GraphVerificationError(f"{self.name}: layer {layer}'s attention does not record its queries")
        for name in (ops.OBSERVE_MODULE, ops.EVICT_MODULE):
            side = getattr(gm, name, None)
            if side is None:
                raise GraphVerificationError(f"{self.name}: the step lost its {name} graph")
            for buffer, tensor in side.named_buffers():
                if buffer != "protected" and getattr(gm, buffer, None) is not tensor:
                    raise GraphVerificationError(f"{self.name}: {name}'s {buffer} is not the step's own buffer")
