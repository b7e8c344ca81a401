"""A KV-eviction export's runtime half on ONNX Runtime: its two graphs (rewrites.kv_eviction.export, written
beside the step by its export hook) run on ORT after each commit.

`OrtEviction` holds the state as torch tensors bound with IOBinding beside the ORT program's cache, so the
cache stays `budget` slots: memory falls on ORT as it does in PyTorch (an eviction holds a second copy of
the cache for the moment it runs: evict.onnx is functional). It opens and runs its sessions through the
program (`open_session`, `run_session`), so this rewrite imports nothing of the backends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from .export import state_names
from .runtime import Eviction


class OrtEviction(Eviction):
    """observe.onnx and evict.onnx on ORT sessions, over the ORT program's cache (its `keys`, `values`
    and the last step's `queries`) and the policy's state, all torch tensors on the program's device.
    The graphs are exported for one row: in a batch each row runs them on its own slices (copied to
    contiguous tensors for the binding, and the results copied back), with its own state row."""

    def __init__(self, program, policy):
        self.program = program  # backends.onnx.program.OrtProgram: keys, values [L, B, KV, budget, D], queries
        self.policy = policy  # the KVEviction pass
        self.device = program.device
        entry = program.manifest["eviction"]  # what the export hook wrote (rewrites.kv_eviction.export)
        self.observe_session = program.open_session(entry["observe"]) if entry["observe"] else None
        self.evict_session = program.open_session(entry["evict"])
        self.names = state_names(policy)
        dtypes = {"scores": torch.float32, "window": program.dtype}
        self.state = {name: torch.zeros(entry["state"][name], dtype=dtypes[name], device=self.device)
                      for name in self.names}  # fmt: skip  [L, rows, ...]: grown to the batch's rows
        self._row: int | None = None

    @contextlib.contextmanager
    def row(self, b: int) -> Iterator[None]:
        self._row = b
        try:
            yield
        finally:
            self._row = None

    def _rows(self) -> slice:
        """The batch rows the graphs act on now (all of a one-row cache, or the row inside `row`)."""
        rows = self.program.keys.shape[1]
        for name, tensor in self.state.items():  # a new batch of other rows: fresh state
            if tensor.shape[1] != rows:
                self.state[name] = tensor.new_zeros(tensor.shape[0], rows, *tensor.shape[2:])
        return slice(None) if rows == 1 or self._row is None else slice(self._row, self._row + 1)

    def observe(self, rows: torch.Tensor, first_slot: int, positions: torch.Tensor) -> None:
        if self.observe_session is None:
            return
        row = self._rows()
        state = {name: tensor[:, row].contiguous() for name, tensor in self.state.items()}
        inputs = {"queries": self.program.queries[:, row].index_select(3, rows).contiguous(),
                  "keys": self.program.keys[:, row].contiguous(), "first_slot": torch.tensor(first_slot, device=self.device),
                  "positions": positions, **state}  # fmt: skip
        outputs = {f"new_{name}": torch.empty_like(state[name]) for name in self.names}
        self.program.run_session(self.observe_session, inputs, outputs)
        for name in self.names:
            self.state[name][:, row] = outputs[f"new_{name}"]

    def evict(self) -> None:
        row = self._rows()
        keys, values = self.program.keys[:, row].contiguous(), self.program.values[:, row].contiguous()
        state = {name: tensor[:, row].contiguous() for name, tensor in self.state.items()}
        inputs = {"keys": keys, "values": values, **state}
        outputs = {"kept_keys": torch.empty_like(keys), "kept_values": torch.empty_like(values)}
        if self.policy.scored:
            outputs["kept_scores"] = torch.empty_like(state["scores"])
        self.program.run_session(self.evict_session, inputs, outputs)
        self.program.keys[:, row] = outputs["kept_keys"]  # in place: bindings (CUDA graphs) keep the cache's memory
        self.program.values[:, row] = outputs["kept_values"]
        if self.policy.scored:
            self.state["scores"][:, row] = outputs["kept_scores"]

    def keep_rows(self, keep: Sequence[int]) -> None:
        index = torch.tensor(list(keep), device=self.device)
        self.state = {name: tensor.index_select(1, index) for name, tensor in self.state.items()}

    def reset(self) -> None:
        for tensor in self.state.values():
            tensor.zero_()

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())
