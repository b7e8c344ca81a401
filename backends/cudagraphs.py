"""CUDA-graph lowering: one captured graph per (tree-size, attended-length) bucket, replayed per step.

Inputs are copied into static buffers padded to the bucket (`backends.buckets.pad_step`): padded
tree nodes see only themselves and write their K/V into slots past the real tree (never read), and
padded key columns are hidden by the mask, so the real nodes' logits equal the eager step's. Buckets
come from the step's slot layout, built on the host: nothing is read back from the device.

Host work is the floor of a replayed step (an H100 replays SmolLM2-135M's inductor step in 1.7 ms):
given host-side token ids and layout (what the decode loop passes), the padding runs on the host
and reaches the device as one copy per input; device-side inputs are padded on the device.
"""

from __future__ import annotations

import torch

from specpass.backends.buckets import kv_bucket, pad_step, tree_bucket
from specpass.ir.layout import SlotLayout


class CudaGraphStep:
    """Replays `eager` (an EagerStep: the FX step, or the inductor-compiled one) in CUDA graphs."""

    def __init__(self, eager, max_nodes: int, cache_size: int):
        self.eager = eager
        self.kind = "cudagraphs" if eager.kind == "eager" else eager.kind
        self.device = eager.device
        self.input_names = eager.input_names
        self.max_nodes = max_nodes
        self.cache_size = cache_size
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}
        self.pool = None

    def _bucket(self, layout: SlotLayout) -> tuple[int, int] | None:
        tb = max(tree_bucket(layout.size), self.eager.min_tokens)
        sb = kv_bucket(layout.committed + tb, self.cache_size)
        if tb > max(tree_bucket(self.max_nodes), self.eager.min_tokens) or layout.committed + tb > self.cache_size:
            return None
        return tb, sb

    def _capture(self, static: dict):
        """Warm up and capture with `static` already holding this step's real (padded) inputs, so the
        warm-up runs write exactly the K/V the real step writes and never clobber the live cache."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.eager.run_graph(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.eager.run_graph(static)
        self.pool = graph.pool()
        return graph, outputs

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, layout: SlotLayout):
        bucket = self._bucket(layout)
        if bucket is None:  # a prompt, or too close to the end of the cache to pad: run eagerly
            return self.eager(input_ids, layout)
        tb, sb = bucket
        ids, positions, padded = pad_step(input_ids, layout, tb)
        inputs = {name: value for name, value in padded.step_inputs(ids).items() if name in self.input_names}
        inputs["positions"] = positions
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
        t = layout.size
        return tuple(o[:, :t] for o in outputs)
