"""One decode step lowered several ways; each call runs the lowering measured fastest for its token count.

Why. On a CPU the two lowerings' cost curves can cross. Measured on a 2-core Intel Xeon with AMX
(torch 2.13, SmolLM2-135M, float32): eager (MKL sgemm) 31.8 ms at T = 1 against oneDNN's 36.0 ms,
while from T = 4 oneDNN is faster (38.8 against 47.4 ms; 45.1 against 57.7 at T = 8). On a 2-core
AMD EPYC oneDNN was faster at every T. Which kernel wins where is a property of the machine, so it is
measured, not assumed.

Contract. Until `choose` is given the measured curves, every call runs `default`. After it, a call
verifying T tokens runs the lowering whose curve is lowest at T (interpolated between measured sizes,
extrapolated past the largest, so a long prefill goes to the kernel that wins at large T).

Invariants. Every lowering computes the same function of the same graph on the same KV-cache buffers,
so switching between them from one step to the next changes outputs only by float rounding, as each
lowering alone does (the oneDNN lowering agrees with eager to ~1e-5).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

from specpass.backends.runtime.cost import CostCurve
from specpass.ir.layout import SlotLayout


class FastestPerSize:
    """Dispatches each call to one of `steps` (name -> step with the same `input_names`) by T."""

    def __init__(self, steps: Mapping[str, Callable], default: str):
        if default not in steps:
            raise ValueError(f"default lowering {default!r} is not one of {sorted(steps)}")
        self.steps = dict(steps)
        self.default = default
        self.input_names = self.steps[default].input_names
        self._curves: dict[str, CostCurve] = {}
        self._pinned: str | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.steps)

    @property
    def curves(self) -> dict[str, CostCurve]:
        """The measured curve of each lowering (empty until `choose`)."""
        return dict(self._curves)

    @contextlib.contextmanager
    def pinned(self, kind: str) -> Iterator[None]:
        """Run every call on `kind` inside the block (to measure that lowering's own curve)."""
        self._pinned = kind
        try:
            yield
        finally:
            self._pinned = None

    def choose(self, curves: Mapping[str, CostCurve]) -> CostCurve:
        """Adopt the measured curves (one per lowering, same sizes); returns their lower envelope."""
        if set(curves) != set(self.steps):
            raise ValueError(f"need one curve per lowering {sorted(self.steps)}, got {sorted(curves)}")
        self._curves = dict(curves)
        return CostCurve.lower_envelope(self._curves.values())

    def kind_for(self, size: int) -> str:
        """The lowering a call verifying `size` tokens runs."""
        if self._pinned is not None:
            return self._pinned
        if not self._curves:
            return self.default
        return min(self._curves, key=lambda kind: self._curves[kind].latency(size))

    def __call__(self, input_ids, layout: SlotLayout):
        return self.steps[self.kind_for(layout.size)](input_ids, layout)
