"""Shape buckets and padding for graph-replay lowerings (CUDA graphs in PyTorch and in ONNX Runtime).

A replayed graph has fixed shapes, so a step of T tokens over a cache runs in the graph of its
bucket: T rounds up to a power of two (`tree_bucket`), attended slots to a multiple of KV_BUCKET
(`kv_bucket`). `pad_step` pads a step to its tree bucket: padded nodes are token 0, see only
themselves among the step's tokens (identity rows and columns of the ancestor mask), and padded node
k sits at position committed + k, its own write slot, so that a chain step (which writes each token
at its position) also writes them right after the real tree, where no real node looks. So the real
nodes' outputs are the unpadded step's, and the padded nodes' are discarded.
"""

from __future__ import annotations

import dataclasses

import torch

from ...ir.layout import SlotLayout, padded_mask

KV_BUCKET = 256


def tree_bucket(size: int) -> int:
    """The smallest power of two >= size."""
    return 1 << (size - 1).bit_length()


def kv_bucket(slots: int, cache_size: int | None = None) -> int:
    """`slots` rounded up to a multiple of KV_BUCKET (capped at cache_size when given)."""
    rounded = -(-slots // KV_BUCKET) * KV_BUCKET
    return rounded if cache_size is None else min(cache_size, rounded)


def pad_step(input_ids: torch.Tensor, layout: SlotLayout, size: int) -> tuple[torch.Tensor, torch.Tensor, SlotLayout]:
    """(input_ids [B, size], positions [B, size], the padded layout) for a step of input_ids [B, T]
    laid out by `layout`."""
    batch, t = input_ids.shape
    if size < t:
        raise ValueError(f"cannot pad a step of {t} tokens to {size}")
    ids = torch.zeros(batch, size, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :t] = input_ids
    ancestors = padded_mask(layout.ancestors, torch.eye(size, dtype=torch.bool, device=layout.device))
    padded = dataclasses.replace(layout, ancestors=ancestors)
    positions = padded.write_slots() + layout.evicted  # padded node k: evicted + committed + k
    positions[:t] = layout.positions()
    return ids, positions[None].expand(batch, -1), padded
