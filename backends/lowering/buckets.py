"""Shape buckets and padding for graph-replay lowerings (CUDA graphs in PyTorch and in ONNX Runtime).

A replayed graph has fixed shapes, so a step of T tokens over a cache runs in the graph of its
bucket: T rounds up to a power of two (`tree_bucket`), attended slots to a multiple of KV_BUCKET
(`kv_bucket`). A step is padded to its bucket by `ir.layout.SlotLayout.padded`: padded nodes see only
themselves and sit past the row's real tree, where no real node looks, so the real nodes' outputs are the
unpadded step's.
"""

from __future__ import annotations

KV_BUCKET = 256


def tree_bucket(size: int) -> int:
    """The smallest power of two >= size."""
    return 1 << (size - 1).bit_length()


def kv_bucket(slots: int, cache_size: int | None = None) -> int:
    """`slots` rounded up to a multiple of KV_BUCKET (capped at cache_size when given)."""
    rounded = -(-slots // KV_BUCKET) * KV_BUCKET
    return rounded if cache_size is None else min(cache_size, rounded)
