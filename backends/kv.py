"""KV-cache commit after tree verification: move the accepted path's entries into consecutive slots."""

from __future__ import annotations

import torch


def compact(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy slots `src` to slots `dst` in every layer of both caches ([L, B, KV, S, D]); no recompute.

    src and dst are [N] int64 with dst sorted ascending and dst[i] <= src[i] (entries only move down),
    as produced by an accepted tree path; sources are gathered before any slot is written.
    """
    if src.numel() == 0:
        return
    k_cache.index_copy_(3, dst, k_cache.index_select(3, src))
    v_cache.index_copy_(3, dst, v_cache.index_select(3, src))
