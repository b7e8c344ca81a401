"""The KV-cache slot layout of one verify step, for every row: the one definition every cache user reads.

In a row, T tokens (a draft tree, a chain, or a prompt) go over a committed prefix: slots [0, committed)
hold the prefix, which every token sees; token i writes slot committed + i and sees slot committed + j
iff ancestors[i, j]; its rotary position is evicted + committed + depth(i) (evicted: committed tokens
no longer cached, rewrites.kv_eviction). After verification the accepted path moves into slots
committed, committed + 1, ... (`moves`). Built on the host once per step; inside a graph it is the
static-cache step's `cache_slots` + `tree_mask` (`slot_visibility`) or the functional step's
`past_mask` + `tree_mask` (`past_and_tree_visibility`, backends.onnx.kv_io).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class SlotLayout:
    """Where one step's tokens live in the KV cache, for each of its B rows (see the module docstring).

    Row b is sequence b in cache row b: committed[b] slots of committed prefix, sizes[b] real nodes
    whose ancestor mask is ancestors[b, :sizes[b], :sizes[b]], evicted[b] evicted tokens. Every row is
    padded to the same T: padding node k of a row (k >= its size) sees only itself, sits at the row's
    next slot (committed_b + k, past its committed prefix: never read, overwritten by a later step)
    and takes the position it would have there; its outputs are ignored. kv_len is the longest row's
    committed + T; in row b the slots past committed_b + T are hidden by its mask. Every row needs
    committed_b + T <= the cache's slots (the caller sizes T by the rows' room). One sequence is one row.
    """

    committed: tuple[int, ...]
    ancestors: torch.Tensor  # [B, T, T] bool; a padding node's row and column: itself only
    sizes: tuple[int, ...]
    evicted: tuple[int, ...]

    def __post_init__(self):
        batch = len(self.committed)
        if not batch or self.ancestors.dim() != 3 or self.ancestors.shape[0] != batch or len(self.sizes) != batch \
                or len(self.evicted) != batch:  # fmt: skip
            raise ValueError("a slot layout needs at least one row, with one committed, size and evicted count each "
                             f"and an ancestor mask [B, T, T]; got {batch} rows, mask {tuple(self.ancestors.shape)}")
        if self.ancestors.shape[1] != self.ancestors.shape[2] or not 1 <= min(self.sizes) <= max(self.sizes) <= self.size:
            raise ValueError(f"each row needs 1 to T nodes of a square mask, got sizes {self.sizes} and mask "
                             f"{tuple(self.ancestors.shape)}")  # fmt: skip
        if min(self.committed) < 0 or min(self.evicted) < 0:
            raise ValueError(f"committed and evicted counts must be >= 0, got {self.committed}, {self.evicted}")
        _check_order(self.ancestors)

    @classmethod
    def tree(cls, committed: int, ancestors: torch.Tensor, evicted: int = 0) -> SlotLayout:
        """One row: a tree of T nodes (ancestors [T, T]) over `committed` slots."""
        if ancestors.dim() != 2:
            raise ValueError(f"a tree's ancestor mask is [T, T], got {tuple(ancestors.shape)}")
        return cls((committed,), ancestors[None], (ancestors.shape[0],), (evicted,))

    @classmethod
    def chain(cls, committed: int, size: int, device: torch.device | str = "cpu", evicted: int = 0) -> SlotLayout:
        """One row of T tokens in a row (a prompt, or a draft chain): token i's ancestors are tokens 0..i-1."""
        return cls.tree(committed, torch.ones(size, size, dtype=torch.bool, device=device).tril(), evicted)

    @classmethod
    def of(cls, layouts: Sequence[SlotLayout]) -> SlotLayout:
        """The rows of `layouts`, in order, padded to one T (padding nodes as in the class docstring)."""
        if not layouts:
            raise ValueError("a slot layout needs at least one row")
        t = max(layout.size for layout in layouts)
        eye = torch.eye(t, dtype=torch.bool, device=layouts[0].device)
        masks = [layout.ancestors if layout.size == t else padded_masks(layout.ancestors, eye) for layout in layouts]
        return cls(sum((l.committed for l in layouts), ()), torch.cat(masks), sum((l.sizes for l in layouts), ()),
                   sum((l.evicted for l in layouts), ()))  # fmt: skip

    def row(self, b: int) -> SlotLayout:
        """Row b alone (its unpadded mask)."""
        n = self.sizes[b]
        return SlotLayout((self.committed[b],), self.ancestors[b : b + 1, :n, :n], (n,), (self.evicted[b],))

    @property
    def rows(self) -> int:
        """B."""
        return len(self.committed)

    @property
    def size(self) -> int:
        """T: tokens per row in the forward (the largest row's, the others padded)."""
        return self.ancestors.shape[1]

    @property
    def kv_len(self) -> int:
        """Slots the step attends over: the longest committed prefix and the step's own write slots."""
        return max(self.committed) + self.size

    @property
    def device(self) -> torch.device:
        return self.ancestors.device

    def to(self, device: torch.device | str) -> SlotLayout:
        """The same layout with its mask on `device` (itself when already there)."""
        if self.ancestors.device == torch.device(device):
            return self
        return dataclasses.replace(self, ancestors=self.ancestors.to(device))

    def positions(self) -> torch.Tensor:
        """[B, T] int64: rotary positions, evicted + committed + depth in the tree (padding node k: next + k)."""
        start = torch.tensor([c + e for c, e in zip(self.committed, self.evicted)], device=self.device)  # [B]
        k = torch.arange(self.size, device=self.device)  # [T]
        real = k[None, :] < torch.tensor(self.sizes, device=self.device)[:, None]  # [B, T]
        return start[:, None] + torch.where(real, self.ancestors.sum(-1) - 1, k[None, :])

    def pad_tokens(self, tokens: Sequence[torch.Tensor]) -> torch.Tensor:
        """[B, T] int64: each row's tokens [T_b], zeros after them."""
        ids = torch.zeros(self.rows, self.size, dtype=torch.long, device=tokens[0].device)
        for b, row_tokens in enumerate(tokens):
            ids[b, : row_tokens.shape[0]] = row_tokens
        return ids

    def padded(self, size: int, batch: int) -> SlotLayout:
        """This step padded to `size` tokens a row and `batch` rows (a graph-replay bucket,
        backends.lowering.buckets): padding nodes as in the class docstring, and a padding row is `size`
        nodes each seeing only itself in slots 0 .. size - 1 of its cache row, a row no live sequence
        uses (the loop keeps its live rows first, DecodeProgram.keep_rows)."""
        if size < self.size or batch < self.rows:
            raise ValueError(f"cannot pad a step of {self.rows} rows x {self.size} tokens to {batch} x {size}")
        if (size, batch) == (self.size, self.rows):
            return self
        ancestors = torch.eye(size, dtype=torch.bool, device=self.device).repeat(batch, 1, 1)  # [batch, size, size]
        ancestors[: self.rows, : self.size, : self.size] = self.ancestors
        pad = (0,) * (batch - self.rows)
        return SlotLayout(self.committed + pad, ancestors, self.sizes + (1,) * len(pad), self.evicted + pad)

    def step_inputs(self, input_ids: torch.Tensor) -> dict:
        """The static-cache step's inputs for `input_ids` [B', T'] (each row's tokens), zeros past them up to
        the layout's [B, T] (a `padded` layout's padding nodes and rows)."""
        if tuple(input_ids.shape) != (self.rows, self.size):
            ids = torch.zeros(self.rows, self.size, dtype=input_ids.dtype, device=input_ids.device)
            ids[: input_ids.shape[0], : input_ids.shape[1]] = input_ids
            input_ids = ids
        k = torch.arange(self.size, device=self.device)  # [T]
        slots = torch.tensor(self.committed, device=self.device)[:, None] + k[None, :]  # [B, T]
        return {"input_ids": input_ids, "positions": self.positions(), "kv_len": self.kv_len,
                "tree_mask": self.ancestors, "cache_slots": slots}  # fmt: skip

    def past_mask(self, slots: int) -> torch.Tensor:
        """[B, T, slots] bool: which of a cache buffer's `slots` slots each token sees as committed prefix
        (the functional step's `past_mask`, backends.onnx.kv_io)."""
        committed = torch.tensor(self.committed, device=self.device)  # [B]
        prefix = torch.arange(slots, device=self.device)[None, :] < committed[:, None]  # [B, slots]
        return prefix[:, None, :].expand(self.rows, self.size, slots)

    def moves(self, paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[int]]:
        """(rows, source slots, destination slots) that compact each row's accepted path (node indices,
        root first) into slots committed_b, committed_b + 1, ...; nodes already in place are left out."""
        rows, sources, destinations = [], [], []
        for b, (committed, path) in enumerate(zip(self.committed, paths, strict=True)):
            for i, node in enumerate(path):
                if node != i:
                    rows.append(b)
                    sources.append(committed + node)
                    destinations.append(committed + i)
        return rows, sources, destinations


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


def past_and_tree_slots(past_mask: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """Each step token's own slot in the functional encoding: [B, T, S], [B, T, T] -> [B, T] int64, S + t."""
    tokens = tree_mask.shape[-1]
    own = torch.arange(tokens, device=tree_mask.device) + past_mask.shape[-1]  # [T]
    return own[None, :].expand(tree_mask.shape[0], tokens)


def _check_order(ancestors: torch.Tensor) -> None:
    """Ancestors precede their descendants (each mask lower-triangular): a node's visible slots, in slot
    order, are then the committed prefix and its ancestors by depth, the order in which attention sums
    them (backends.kernels.attention) for the same token decoded alone."""
    if ancestors.triu(1).any():
        raise ValueError("a node's ancestors must precede it in the layout (an ancestor mask above its diagonal)")


def padded_masks(ancestors: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """[B, T, T]: rows' ancestor masks [B, T_b, T_b] in the top-left corner of `eye` [T, T] (padding nodes see
    only themselves)."""
    mask = eye.repeat(ancestors.shape[0], 1, 1)
    mask[:, : ancestors.shape[1], : ancestors.shape[1]] = ancestors
    return mask
