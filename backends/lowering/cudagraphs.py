"""CUDA-graph lowering: one captured graph per (rows, tree-size, attended-length) bucket, replayed per step.

Inputs are copied into static buffers padded to the bucket (`ir.layout.SlotLayout.padded`): padded
nodes see only themselves and write past their row's real tree, padded rows write cache rows no live
sequence uses, padded key columns are masked, so the real nodes' logits equal the eager step's. T rounds
up to a power of two, the attended length to a multiple of KV_BUCKET (backends.lowering.buckets), the rows
to a power of two capped at the cache's rows (a batch whose rows finish one by one replays at most
log2(B) + 1 row buckets). Buckets come from the host-built layout: nothing is read back from the device.
Host work is the floor of a replayed step, so host-side inputs are padded on the host and reach the
device as one copy per input; device-side inputs are padded on the device.
"""

from __future__ import annotations

import torch

from .buckets import kv_bucket, tree_bucket
from ...ir.layout import SlotLayout


def capture(run, static: dict, pool) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """(graph, its outputs): `run(static)` captured in the memory pool `pool` (None: a new one; graphs
    of one owner share the first one's `graph.pool()`), after two warm-up runs on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run(static)
    return graph, outputs


class CudaGraphStep:
    """Replays `eager` (an EagerStep: the FX step, or the inductor-compiled one) in CUDA graphs."""

    def __init__(self, eager, max_nodes: int, cache_size: int):
        self.eager = eager
        self.lowering = "cudagraphs" if eager.lowering == "eager" else eager.lowering
        self.device = eager.device
        self.input_names = eager.input_names
        self.max_nodes = max_nodes
        self.cache_size = cache_size
        self.cache_rows = eager.gm.k_cache.shape[1]  # [L, rows, KV, S, D]: sequences the cache holds
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}
        self.pool = None

    def _bucket(self, layout: SlotLayout) -> tuple[int, int, int] | None:
        """(rows, tokens, attended slots) of the graph that replays `layout`, None to run it eagerly."""
        tb = max(tree_bucket(layout.size), self.eager.min_tokens)
        committed = max(layout.committed)
        if tb > max(tree_bucket(self.max_nodes), self.eager.min_tokens) or committed + tb > self.cache_size:
            return None
        rb = min(max(tree_bucket(len(layout.committed)), self.eager.min_rows), self.cache_rows)
        return rb, tb, kv_bucket(committed + tb, self.cache_size)

    def _capture(self, static: dict):
        """Captured with `static` already holding this step's real (padded) inputs, so the warm-up runs
        write exactly the K/V the real step writes and never clobber the live cache."""
        graph, outputs = capture(self.eager.run_graph, static, self.pool)
        self.pool = graph.pool()
        return graph, outputs

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, layout: SlotLayout):
        bucket = self._bucket(layout)
        if bucket is None:  # a prompt, or too close to the end of the cache to pad: run eagerly
            return self.eager(input_ids, layout)
        rb, tb, sb = bucket
        padded = layout.padded(tb, rb).step_inputs(input_ids)
        inputs = {name: value for name, value in padded.items() if name in self.input_names}
        inputs["kv_len"] = sb  # the bucket's attended length: slots past the tree are hidden by the mask
        if bucket in self.graphs:
            graph, static, outputs = self.graphs[bucket]
            for name, value in inputs.items():
                if name != "kv_len":
                    static[name].copy_(value, non_blocking=True)  # host inputs: pageable, so copied before return
        else:
            static = {name: v.to(self.device, copy=True) if isinstance(v, torch.Tensor) else v
                      for name, v in inputs.items()}  # fmt: skip
            graph, outputs = self._capture(static)
            self.graphs[bucket] = graph, static, outputs
        graph.replay()
        return tuple(o[: layout.rows, : layout.size] for o in outputs)
