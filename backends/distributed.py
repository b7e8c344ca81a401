"""Keeping the ranks of a tensor-parallel program (rewrites.TensorParallel) in lockstep.

Every rank runs the same decode loop on the same logits, so its drafts and accepted paths are the
same; what differs between ranks is timing. Each decision taken from timings (the measured cost
curve, the tree size the cost budget picks) is rank 0's, sent to all, so every rank makes the same
sequence of collective calls. Accepted paths are compared across ranks at every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from specpass.errors import SpecpassError


def rank0_floats(values: Sequence[float]) -> tuple[float, ...]:
    """Rank 0's `values` on every rank (float64, so the timings are kept as measured)."""
    tensor = torch.tensor(list(values), dtype=torch.float64)
    dist.broadcast(tensor, src=0)
    return tuple(tensor.tolist())


def rank0_int(value: int) -> int:
    """Rank 0's `value` on every rank."""
    return int(rank0_floats([value])[0])


def check_same_paths(paths: Sequence[Sequence[int]]) -> None:
    """Raise if any rank accepted other paths this step (a broken lockstep: never expected). Ranks
    compare (tokens, hash of every row's node indices): an int tuple's hash is the same in every process."""
    mine = torch.tensor([sum(map(len, paths)), hash(tuple(tuple(p) for p in paths))], dtype=torch.long)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    if any(not torch.equal(g, mine) for g in gathered):
        raise SpecpassError(f"tensor-parallel ranks accepted different paths (length, hash): {[g.tolist() for g in gathered]}")
