"""Tensor parallelism's runtime half: keeping the ranks of a sharded program (rewrites.TensorParallel)
in lockstep.

Every rank runs the same decode loop on the same logits, so its drafts and accepted paths are the
same; what differs between ranks is timing. Each decision taken from timings (the measured cost
curve, the tree size the cost budget picks) is rank 0's, sent to all, so every rank makes the same
sequence of collective calls. Accepted paths (every row's) are compared across ranks at every commit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..common.errors import SpecpassError
from ..ir.layout import SlotLayout
from ..passes.runtime import RuntimeHook


def rank0_floats(values: Sequence[float]) -> tuple[float, ...]:
    """Rank 0's `values` on every rank (float64, so the timings are kept as measured)."""
    tensor = torch.tensor(list(values), dtype=torch.float64)
    dist.broadcast(tensor, src=0)
    return tuple(tensor.tolist())


def check_same_paths(paths: Sequence[Sequence[int]]) -> None:
    """Raise if any rank accepted other paths this step (a broken lockstep: never expected). Ranks
    compare (tokens, hash of every row's node indices): an int tuple's hash is the same in every process."""
    mine = torch.tensor([sum(map(len, paths)), hash(tuple(tuple(p) for p in paths))], dtype=torch.long)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    if any(not torch.equal(g, mine) for g in gathered):
        raise SpecpassError(f"tensor-parallel ranks accepted different paths (length, hash): {[g.tolist() for g in gathered]}")


class Lockstep(RuntimeHook):
    """Rank 0's tree sizes and cost curve on every rank; every commit's paths compared across ranks."""

    fixed_measurement = True  # a timing-based stop would make ranks run different numbers of forwards

    def agreed_size(self, size: int) -> int:
        return int(rank0_floats([size])[0])

    def agreed_choice(self, choice: bool) -> bool:
        return bool(rank0_floats([float(choice)])[0])

    def agreed_seconds(self, seconds: tuple[float, ...]) -> tuple[float, ...]:
        return rank0_floats(seconds)

    def after_commit(self, layout: SlotLayout, paths: Sequence[Sequence[int]], committed: list[int]) -> list[int]:
        check_same_paths(paths)
        return committed
