"""KV-cache commit after tree verification: move the accepted path's entries into consecutive slots."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def compact(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, src: torch.Tensor,
            dst: torch.Tensor) -> None:  # fmt: skip
    """Copy slot src[i] to slot dst[i] of cache row rows[i] ([N] int64 each, as `ir.layout.SlotLayout.moves`
    lists an accepted path's moves), in every layer of both caches ([L, B, KV, S, D]); no recompute,
    entries of other rows are not touched. Sources are gathered before any slot is written."""
    for cache in (k_cache, v_cache):
        cache[:, rows, :, dst] = cache[:, rows, :, src]  # [N, L, KV, D] gathered, then written


def keep_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, keep: Sequence[int], slots: int) -> None:
    """Move cache rows `keep` (ascending) to rows 0, 1, ..., their first `slots` slots (rows already in
    place are not copied)."""
    moved = [(src, dst) for dst, src in enumerate(keep) if src != dst]
    if not moved:
        return
    src = torch.tensor([s for s, _ in moved], device=k_cache.device)
    dst = torch.tensor([d for _, d in moved], device=k_cache.device)
    for cache in (k_cache, v_cache):
        cache[:, dst, :, :slots] = cache[:, src, :, :slots]
