"""The KV-cache slot layout of one verify step: the one definition every cache user reads.

A step verifies T tokens over a committed prefix: slots [0, committed) are the prefix, seen by every token;
token i writes slot committed + i and sees slot committed + j iff ancestors[i, j]; its rotary position is
evicted + committed + depth(i); kv_len = committed + T. After verification the accepted path moves into
slots committed, committed + 1, ... (`moves`). `evicted` counts committed tokens no longer cached
(rewrites.kv_eviction): keys keep their original positions, so slots and positions part ways. The layout
is built on the host (`SlotLayout`), so no backend reads a length back from the device. In a graph it has
two encodings, both here: `cache_slots` + `tree_mask` for the static-cache step (`slot_visibility`; row
b's committed length is `cache_slots[b, 0]`), and `past_mask` = `prefix_mask` + `tree_mask` for the
functional step of the export (`past_and_tree_visibility`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class SlotLayout:
    """Where one step's tokens live in the KV cache (see the module docstring)."""

    committed: int  # slots [0, committed) hold the committed prefix
    ancestors: torch.Tensor  # [T, T] bool: ancestors[i, j] iff j is i or an ancestor of i
    evicted: int = 0  # committed tokens evicted from the cache: the root's position is evicted + committed

    def __post_init__(self):
        if self.committed < 0 or self.evicted < 0:
            raise ValueError(f"committed and evicted counts must be >= 0, got {self.committed}, {self.evicted}")
        if self.ancestors.dim() != 2 or self.ancestors.shape[0] != self.ancestors.shape[1] or self.size < 1:
            raise ValueError(f"ancestors must be a non-empty square [T, T] mask, got {tuple(self.ancestors.shape)}")
        _check_order(self.ancestors)

    @classmethod
    def chain(cls, committed: int, size: int, device: torch.device | str = "cpu", evicted: int = 0) -> SlotLayout:
        """T tokens in a row (a prompt, or a draft chain): token i's ancestors are tokens 0..i-1."""
        return cls(committed, torch.ones(size, size, dtype=torch.bool, device=device).tril(), evicted)

    @property
    def size(self) -> int:
        """T: the number of tokens the step verifies."""
        return self.ancestors.shape[0]

    @property
    def kv_len(self) -> int:
        """Slots the step attends over: the committed prefix and the step's own write slots."""
        return self.committed + self.size

    @property
    def device(self) -> torch.device:
        return self.ancestors.device

    def to(self, device: torch.device | str) -> SlotLayout:
        """The same layout with its mask on `device` (itself when already there)."""
        if self.ancestors.device == torch.device(device):
            return self
        return dataclasses.replace(self, ancestors=self.ancestors.to(device))

    def write_slots(self) -> torch.Tensor:
        """[T] int64: the slot each token's K/V is written to."""
        return torch.arange(self.committed, self.kv_len, device=self.device)

    def positions(self) -> torch.Tensor:
        """[T] int64: rotary positions, evicted + committed length + depth in the tree."""
        return self.evicted + self.committed + self.ancestors.sum(-1) - 1

    def step_inputs(self, input_ids: torch.Tensor) -> dict:
        """The static-cache step's inputs for `input_ids` [B, T], every row laid out here (RowsLayout)."""
        return RowsLayout.of((self,) * input_ids.shape[0]).step_inputs(input_ids)

    def prefix_mask(self, slots: int) -> torch.Tensor:
        """[T, slots] bool: which of a cache buffer's `slots` slots each token sees as committed prefix."""
        return (torch.arange(slots, device=self.device) < self.committed).expand(self.size, slots)

    def moves(self, path: Sequence[int]) -> tuple[list[int], list[int]]:
        """(source slots, destination slots) that compact the accepted `path` (node indices, root first)
        into slots committed, committed + 1, ...; nodes already in place are left out."""
        moved = [(self.committed + node, self.committed + i) for i, node in enumerate(path) if node != i]
        return [s for s, _ in moved], [d for _, d in moved]


def slot_visibility(tree_mask: torch.Tensor, cache_slots: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The static-cache encoding: [B, T, T] ancestor masks + [B, T] write slots -> [B, 1, T, S]
    attention mask over S = kv_len slots. In row b, slots below cache_slots[b, 0] (the row's committed
    length) are its prefix, seen by every token of the row; the row's own step slots are seen through
    its ancestor mask; every other slot is hidden."""
    batch, t = tree_mask.shape[0], tree_mask.shape[1]
    key_slots = torch.arange(kv_len, device=cache_slots.device)  # [S]
    prefix = key_slots[None, :] < cache_slots[:, :1]  # [B, S]
    # materialised before the scatter: inductor (torch 2.13, CPU) mis-compiles a scatter into an expanded base
    visible = prefix[:, None, :].expand(batch, t, kv_len).contiguous()  # [B, T, S]
    columns = cache_slots[:, None, :].expand(batch, t, t)  # [B, T, T]: row b's node j sits in slot cache_slots[b, j]
    visible = visible.scatter(2, columns, tree_mask)  # the step's columns come from the ancestor masks
    return visible.unsqueeze(1)  # [B, 1, T, S]


def past_and_tree_visibility(past_mask: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """The functional encoding (KV as inputs): [B, T, S] prefix mask + [B, T, T] ancestor mask ->
    [B, 1, T, S + T] attention mask over the past slots followed by the step's own tokens."""
    return torch.cat((past_mask, tree_mask), dim=-1).unsqueeze(1)


@dataclass(frozen=True, eq=False)
class RowsLayout:
    """One step of several sequences in one forward: row b is laid out in its own cache row as a
    `SlotLayout` of committed[b] slots, sizes[b] nodes and evicted[b] evicted tokens, its ancestor mask
    ancestors[b, :sizes[b], :sizes[b]]; every row is padded to the same T.

    Padding node k of a row (k >= the row's size) sees only itself, sits at the row's next slot
    (committed_b + k, past its committed prefix: never read, overwritten by a later step) and takes
    the position it would have there; its outputs are ignored. kv_len is the longest row's
    committed + T; in row b the slots past committed_b + T are hidden by its mask. Every row needs
    committed_b + T <= the cache's slots (the caller sizes T by the rows' room).
    """

    committed: tuple[int, ...]
    ancestors: torch.Tensor  # [B, T, T] bool; a padding node's row and column: itself only
    sizes: tuple[int, ...]
    evicted: tuple[int, ...]

    def __post_init__(self):
        batch = len(self.committed)
        if not batch or self.ancestors.shape[0] != batch or len(self.sizes) != batch or len(self.evicted) != batch:
            raise ValueError("a rows layout needs at least one row, with one committed, size and evicted count each")
        _check_order(self.ancestors)

    @classmethod
    def of(cls, rows: Sequence[SlotLayout]) -> RowsLayout:
        """Per-row layouts padded into one (padding nodes as in the class docstring)."""
        if not rows:
            raise ValueError("a rows layout needs at least one row")
        t = max(row.size for row in rows)
        eye = torch.eye(t, dtype=torch.bool, device=rows[0].device)
        ancestors = torch.stack([row.ancestors if row.size == t else padded_mask(row.ancestors, eye) for row in rows])
        return cls(tuple(r.committed for r in rows), ancestors, tuple(r.size for r in rows), tuple(r.evicted for r in rows))

    @property
    def rows(self) -> tuple[SlotLayout, ...]:
        """Each row's own layout (its unpadded mask)."""
        return tuple(SlotLayout(c, self.ancestors[b, :n, :n], e)
                     for b, (c, n, e) in enumerate(zip(self.committed, self.sizes, self.evicted)))  # fmt: skip

    @property
    def size(self) -> int:
        """T: tokens per row in the forward (the largest row's, the others padded)."""
        return self.ancestors.shape[1]

    @property
    def kv_len(self) -> int:
        return max(self.committed) + self.size

    @property
    def device(self) -> torch.device:
        return self.ancestors.device

    def to(self, device: torch.device | str) -> RowsLayout:
        if self.ancestors.device == torch.device(device):
            return self
        return dataclasses.replace(self, ancestors=self.ancestors.to(device))

    def pad_tokens(self, tokens: Sequence[torch.Tensor]) -> torch.Tensor:
        """[B, T] int64: each row's tokens [T_b], zeros after them."""
        ids = torch.zeros(len(self.committed), self.size, dtype=torch.long, device=tokens[0].device)
        for b, row_tokens in enumerate(tokens):
            ids[b, : row_tokens.shape[0]] = row_tokens
        return ids

    def step_inputs(self, input_ids: torch.Tensor, size: int | None = None, batch: int | None = None) -> dict:
        """The static-cache step's inputs for `input_ids` [B, T] (each row's tokens, padded), padded
        further to `size` tokens a row and `batch` rows when given (a graph-replay bucket,
        backends.lowering.cudagraphs): padding nodes as in the class docstring, and a padding row b >= B is
        `size` nodes each seeing only itself in slots 0 .. size - 1 of cache row b, a row no live
        sequence uses (the loop keeps its live rows first, DecodeProgram.keep_rows)."""
        live, t = len(self.committed), self.size if size is None else size
        batch = live if batch is None else batch
        if t < self.size or batch < live:
            raise ValueError(f"cannot pad a step of {live} rows x {self.size} tokens to {batch} x {t}")
        device = self.device
        if tuple(input_ids.shape) != (batch, t):
            ids = torch.zeros(batch, t, dtype=input_ids.dtype, device=input_ids.device)
            ids[:live, : input_ids.shape[1]] = input_ids
            input_ids = ids
        ancestors = self.ancestors
        if tuple(ancestors.shape) != (batch, t, t):
            ancestors = torch.eye(t, dtype=torch.bool, device=device).repeat(batch, 1, 1)  # [B, T, T]
            ancestors[:live, : self.size, : self.size] = self.ancestors
        pad = (0,) * (batch - live)  # a padding row: committed 0, no real node
        committed = torch.tensor(self.committed + pad, device=device)  # [B]
        start = committed + torch.tensor(self.evicted + pad, device=device)  # [B]
        real = torch.tensor(self.sizes + pad, device=device)  # [B]
        k = torch.arange(t, device=device)  # [T]
        depth = ancestors.sum(-1) - 1  # [B, T]
        positions = start[:, None] + torch.where(k[None, :] < real[:, None], depth, k[None, :])  # padding node k: next + k
        slots = committed[:, None] + k[None, :]  # [B, T]
        return {"input_ids": input_ids, "positions": positions, "kv_len": max(self.committed) + t,
                "tree_mask": ancestors, "cache_slots": slots}  # fmt: skip

    def moves(self, paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[int]]:
        """(rows, source slots, destination slots) compacting each row's accepted path (SlotLayout.moves)."""
        rows, sources, destinations = [], [], []
        for b, (committed, path) in enumerate(zip(self.committed, paths, strict=True)):
            for i, node in enumerate(path):
                if node != i:
                    rows.append(b)
                    sources.append(committed + node)
                    destinations.append(committed + i)
        return rows, sources, destinations


def _check_order(ancestors: torch.Tensor) -> None:
    """Ancestors precede their descendants (each mask lower-triangular): a node's visible slots, in slot
    order, are then the committed prefix and its ancestors by depth, the order in which attention sums
    them (backends.kernels.attention) for the same token decoded alone."""
    if ancestors.triu(1).any():
        raise ValueError("a node's ancestors must precede it in the layout (an ancestor mask above its diagonal)")


def padded_mask(ancestors: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """[T, T]: a row's ancestor mask [T_b, T_b] in the top-left corner of `eye` (padding nodes see themselves)."""
    mask = eye.clone()
    mask[: ancestors.shape[0], : ancestors.shape[0]] = ancestors
    return mask
