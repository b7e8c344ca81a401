"""A draft graph by rows (ir.draft) in CUDA graphs: one captured graph per bucket of its named sizes.

The spec names the sizes that vary between calls (ROWS "N", a feature draft's "T" and "S"; an axis "S+T"
is their sum); each rounds up to a power of two (`tree_bucket`), so a program replays a few graphs per
size, never one per call. Inputs are zero-padded (False for a mask): an axis of one name holds its real
entries first, a summed axis each part at the start of its own padded block. Real entries never read
padded ones (rows are independent; a padded key's mask entries are False). `cut_outputs` cuts each output
back to the real sizes into new tensors (the next replay overwrites the captured ones). The padding is
tested on the CPU (tests/test_draft_buckets.py); the capture and replay need a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import itertools

import torch

from .buckets import tree_bucket
from .cudagraphs import capture
from ...ir.draft import ROWS, DraftGraphSpec


def named_sizes(spec: DraftGraphSpec, inputs: dict) -> dict[str, int]:
    """{name: size} of the spec's named dimensions, read from the inputs' shapes."""
    sizes: dict[str, int] = {}
    for tensor in spec.inputs:
        for axis, name in tensor.named_dims().items():
            size = inputs[tensor.name].shape[axis]
            if sizes.setdefault(name, size) != size:
                raise ValueError(f"draft input {tensor.name!r} has {name} = {size}, another input {sizes[name]}")
    return sizes


def bucket_of(sizes: dict[str, int]) -> dict[str, int]:
    return {name: tree_bucket(size) for name, size in sizes.items()}


def _pieces(dim: int | str, sizes: dict[str, int], buckets: dict[str, int]) -> list[tuple[int, int, int]]:
    """(start in the real tensor, start in the padded one, length) of each part of one axis."""
    if isinstance(dim, int):
        return [(0, 0, dim)]
    pieces, real, padded = [], 0, 0
    for part in dim.split("+"):
        pieces.append((real, padded, sizes[part]))
        real, padded = real + sizes[part], padded + buckets[part]
    return pieces


def pad_inputs(spec: DraftGraphSpec, inputs: dict, buckets: dict[str, int], sizes: dict[str, int]) -> dict:
    """The inputs zero-padded to `buckets` (module docstring), on each input's own device."""
    padded = {}
    for tensor in spec.inputs:
        value = inputs[tensor.name]
        out = value.new_zeros(tensor.concrete_shape(buckets.get(ROWS, 0), buckets))
        for parts in itertools.product(*(_pieces(d, sizes, buckets) for d in tensor.shape)):
            out[tuple(slice(p, p + n) for _, p, n in parts)] = value[tuple(slice(r, r + n) for r, _, n in parts)]
        padded[tensor.name] = out
    return padded


def cut_outputs(spec: DraftGraphSpec, outputs: tuple, buckets: dict[str, int], sizes: dict[str, int]) -> tuple:
    """The outputs of a padded call cut back to the real sizes, as new tensors."""
    cut = []
    for tensor, value in zip(spec.outputs, outputs):
        copied = False
        for axis, dim in enumerate(tensor.shape):
            pieces = _pieces(dim, sizes, buckets)
            if len(pieces) > 1:  # a summed axis: its parts joined, into a new tensor
                value, copied = torch.cat([value.narrow(axis, p, n) for _, p, n in pieces], axis), True
            else:
                value = value.narrow(axis, 0, pieces[0][2])
        cut.append(value if copied else value.clone())
    return tuple(cut)


def call_in_buckets(spec: DraftGraphSpec, inputs: dict, run_bucket) -> tuple:
    """`run_bucket(bucket, padded inputs)` (a bucket: its sorted (name, size) pairs) on the inputs padded
    to their bucket, its outputs cut back to the real sizes."""
    sizes = named_sizes(spec, inputs)
    buckets = bucket_of(sizes)
    outputs = run_bucket(tuple(sorted(buckets.items())), pad_inputs(spec, inputs, buckets, sizes))
    return cut_outputs(spec, outputs, buckets, sizes)


class CudaGraphDraft:
    """Runs `eager` (the lowered draft graph, an EagerStep) in CUDA graphs, one per bucket; called like it
    (`run_graph(inputs by name)`). Only for draft graphs called by rows (not `shares_cache`)."""

    def __init__(self, eager, spec: DraftGraphSpec):
        if spec.shares_cache:
            raise ValueError("a cache-sharing draft graph runs as a step, not by rows")
        self.eager, self.spec = eager, spec
        self.gm, self.device, self.input_names = eager.gm, eager.device, eager.input_names
        self.lowering = "cudagraphs"
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict, tuple]] = {}
        self.pool = None

    @torch.no_grad()
    def run_graph(self, inputs: dict) -> tuple:
        return call_in_buckets(self.spec, inputs, self._replay)

    def _replay(self, bucket: tuple, padded: dict) -> tuple:
        """The captured outputs of `bucket`'s graph replayed on `padded`, capturing it first if new."""
        if bucket in self.graphs:
            graph, static, outputs = self.graphs[bucket]
            for name, value in padded.items():
                static[name].copy_(value, non_blocking=True)
        else:
            static = {name: value.to(self.device, copy=True) for name, value in padded.items()}
            graph, outputs = capture(self.eager.run_graph, static, self.pool)
            self.pool = graph.pool()
            self.graphs[bucket] = graph, static, outputs
        graph.replay()
        return outputs
