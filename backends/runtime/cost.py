"""The device's measured cost curve: seconds per target forward as a function of the tree size T.

On a GPU verifying 64 tokens costs about as much as one; on a 2-core CPU it costs several times
more. The decode loop cuts each drafted tree to the size that maximises expected tokens per second.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ...ir.layout import SlotLayout


@dataclass(frozen=True)
class CostCurve:
    sizes: tuple[int, ...]  # ascending, starting at 1
    seconds: tuple[float, ...]

    def latency(self, size: int) -> float:
        """Piecewise-linear interpolation (linear extrapolation past the last measured size; constant
        when only one size was measured)."""
        i = bisect.bisect_left(self.sizes, size)
        if i < len(self.sizes) and self.sizes[i] == size:
            return self.seconds[i]
        if len(self.sizes) == 1:
            return self.seconds[0]
        i = min(max(i, 1), len(self.sizes) - 1)
        x0, x1, y0, y1 = self.sizes[i - 1], self.sizes[i], self.seconds[i - 1], self.seconds[i]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)

    def best_size(self, expected_tokens: Sequence[float], overhead: float = 0.0) -> int:
        """Tree size n maximising expected_tokens[n - 1] / (latency(n) + overhead).

        overhead: seconds per step outside the target forward (drafting, acceptance, bookkeeping).
        The decode loop asks this every step for up to 64 sizes: the latencies come from a table
        interpolated once per curve (`latencies`).
        """
        latencies = self.latencies(len(expected_tokens))
        rates = [e / (t + overhead) for e, t in zip(expected_tokens, latencies)]
        return 1 + max(range(len(rates)), key=rates.__getitem__)

    def latencies(self, up_to: int) -> list[float]:
        """[latency(1), ..., latency(up_to)], interpolated once and kept (the curve is immutable)."""
        table = self.__dict__.get("_table", [])
        if len(table) < up_to:
            table = [self.latency(n) for n in range(1, up_to + 1)]
            object.__setattr__(self, "_table", table)  # a cache beside the frozen fields
        return table[:up_to]

    @classmethod
    def lower_envelope(cls, curves: Iterable[CostCurve]) -> CostCurve:
        """The fastest of several curves measured at the same sizes, size by size."""
        curves = list(curves)
        sizes = curves[0].sizes
        if any(c.sizes != sizes for c in curves):
            raise ValueError("curves measured at different sizes")
        return cls(sizes, tuple(min(c.seconds[i] for c in curves) for i in range(len(sizes))))

    def subset(self, sizes: Iterable[int]) -> CostCurve:
        """The measured points at `sizes` (each one measured)."""
        index = {n: i for i, n in enumerate(self.sizes)}
        kept = sorted(set(sizes))
        return CostCurve(tuple(kept), tuple(self.seconds[index[n]] for n in kept))

    def relative(self) -> dict[int, float]:
        return {n: s / self.seconds[0] for n, s in zip(self.sizes, self.seconds)}


def measure(forward, device: torch.device, sizes: Sequence[int], kv_len: int = 256, repeats: int = 3,
            min_seconds: float = 0.05, clock: Callable[[], float] = time.perf_counter) -> CostCurve:  # fmt: skip
    """Median latency per size of `forward(tokens, layout)` (a program's verify forward) on a chain
    of `size` tokens after `kv_len - size` cached slots.

    Each size runs once to warm up (oneDNN primitives, a CUDA graph's capture), then at least `repeats`
    times and until `min_seconds` have been timed: a CPU step takes tens of milliseconds and repeats
    closely, so the median of three suffices (two warm-ups and five runs made most of the default
    model's first call); a CUDA-graph replay takes a few hundred microseconds, where five runs left
    the curve noisy on an H100 (docs/experiments.md, "Cost-curve timing on the GPU"), so it runs until
    `min_seconds` have passed. `clock`: seconds, for a test to inject.
    """
    seconds = []
    for size in sizes:
        layout = SlotLayout.chain(max(kv_len - size, 0), size)  # on the host, as the decode loop passes it
        tokens = torch.zeros(size, dtype=torch.long)
        forward(tokens, layout)  # warm-up (and CUDA-graph capture)
        samples: list[float] = []
        while len(samples) < repeats or sum(samples) < min_seconds:
            _synchronize(device)
            t0 = clock()
            forward(tokens, layout)
            _synchronize(device)
            samples.append(clock() - t0)
        seconds.append(statistics.median(samples))
    return CostCurve(tuple(sizes), tuple(seconds))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
