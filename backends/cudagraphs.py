"""CUDA-graph lowering: one captured graph per (tree-size, attended-length) bucket, replayed per step.

Inputs are copied into static buffers padded to the bucket: padded tree nodes see only themselves and
write their K/V into slots past the real tree (never read: the mask hides them), and padded key
columns are hidden by the mask, so the real nodes' logits equal the eager step's.
"""

from __future__ import annotations

import torch

KV_BUCKET = 256


def _round_up_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class CudaGraphStep:
    kind = "cudagraphs"

    def __init__(self, eager, max_nodes: int, cache_size: int):
        self.eager = eager
        self.input_names = eager.input_names
        self.tree = "tree_mask" in self.input_names
        self.max_nodes = max_nodes
        self.cache_size = cache_size
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}
        self.pool = None

    def _bucket(self, t: int, kv_len: int, start: int) -> tuple[int, int] | None:
        tb = _round_up_pow2(t)
        sb = min(self.cache_size, -(-max(kv_len, start + tb) // KV_BUCKET) * KV_BUCKET)
        if tb > _round_up_pow2(self.max_nodes) or start + tb > self.cache_size or kv_len > sb:
            return None
        return tb, sb

    def _static_inputs(self, tb: int, device: torch.device, batch: int) -> dict:
        static = {
            "input_ids": torch.zeros(batch, tb, dtype=torch.long, device=device),
            "positions": torch.zeros(batch, tb, dtype=torch.long, device=device),
        }
        if self.tree:
            static["tree_mask"] = torch.eye(tb, dtype=torch.bool, device=device).expand(batch, tb, tb).contiguous()
            static["cache_slots"] = torch.arange(tb, device=device)
        return static

    def _capture(self, static: dict, sb: int):
        """Warm up and capture with `static` already holding this step's real (padded) inputs, so the
        warm-up runs write exactly the K/V the real step writes and never clobber the live cache."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.eager(kv_len=sb, **static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.eager(kv_len=sb, **static)
        self.pool = graph.pool()
        return graph, static, outputs

    @torch.no_grad()
    def __call__(self, *, input_ids, positions, kv_len, tree_mask=None, cache_slots=None):
        batch, t = input_ids.shape
        start = int(cache_slots[0]) if cache_slots is not None else int(positions[0, 0])
        bucket = self._bucket(t, kv_len, start)
        if bucket is None:  # too close to the end of the cache to pad: run eagerly
            return self.eager(
                input_ids=input_ids, positions=positions, kv_len=kv_len, tree_mask=tree_mask, cache_slots=cache_slots
            )
        tb, sb = bucket
        if bucket in self.graphs:
            graph, static, outputs = self.graphs[bucket]
            self._fill(static, tb, input_ids, positions, tree_mask, cache_slots)
        else:
            static = self._static_inputs(tb, input_ids.device, batch)
            self._fill(static, tb, input_ids, positions, tree_mask, cache_slots)
            self.graphs[bucket] = graph, static, outputs = self._capture(static, sb)
        graph.replay()
        t = input_ids.shape[1]
        return tuple(o[:, :t] for o in outputs)

    def _fill(self, static: dict, tb: int, input_ids, positions, tree_mask, cache_slots) -> None:
        t = input_ids.shape[1]
        static["input_ids"][:, :t].copy_(input_ids)
        static["input_ids"][:, t:].zero_()
        static["positions"][:, :t].copy_(positions)
        static["positions"][:, t:].copy_(positions[:, -1:] + torch.arange(1, tb - t + 1, device=positions.device))
        if self.tree:
            pad = torch.eye(tb, dtype=torch.bool, device=input_ids.device)
            pad[:t, :t] = tree_mask[0]
            static["tree_mask"].copy_(pad.expand_as(static["tree_mask"]))
            static["cache_slots"][:t].copy_(cache_slots)
            static["cache_slots"][t:].copy_(cache_slots[-1] + torch.arange(1, tb - t + 1, device=cache_slots.device))
