"""The runtime-hook protocol: a rewrite's runtime half, what the decode loop does around the step it made.

A pass whose rewritten step needs more than forward-and-commit (KV eviction frees slots after each
commit; tensor parallelism keeps every process's decisions equal) provides a `RuntimeHook` through
`Pass.runtime_hook(gm)`. A program (backends.runtime.program) composes the hooks of its pipeline in pipeline
order; the loop never asks which rewrites ran. Every method has the neutral default, so a hook
overrides only what its rewrite needs. It lives here, below both rewrites/ and backends/, so a
rewrite's runtime half sits beside its rewrite without a rewrites -> backends import.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ir.layout import SlotLayout


class RuntimeHook:
    """What a rewritten step asks of the decode loop (module docstring)."""

    max_step: int | None = None  # the most tokens one forward may take (prompts are fed in pieces); None: no limit
    batch_refusal: str | None = None  # why a program with this hook cannot run several rows; None: it can
    fixed_measurement = False  # the cost curve is measured by a fixed number of forwards (every process alike)

    def new_sequence(self) -> None:
        """A batch's first forward is next: drop per-sequence state."""

    def after_commit(self, layout: SlotLayout, paths: Sequence[Sequence[int]], committed: list[int]) -> list[int]:
        """After each row's accepted path was compacted into its cache row: each row's committed slots
        now (`committed` as the program or an earlier hook left them; an eviction returns fewer)."""
        return committed

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Rows `keep` (ascending) of this hook's per-row state move to rows 0, 1, ... as the cache's do
        when the other rows' sequences ended."""

    def agreed_size(self, size: int) -> int:
        """The tree size every process verifies this step, from this process's choice."""
        return size

    def agreed_seconds(self, seconds: tuple[float, ...]) -> tuple[float, ...]:
        """The cost curve's timings every process adopts, from this process's measurement."""
        return seconds

    def state_bytes(self) -> int:
        """Bytes of the tensors this hook keeps beside the KV cache (an eviction policy's scores)."""
        return 0
