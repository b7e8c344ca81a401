"""The pass contract: a pass requires graph properties, checks that it matches, rewrites, ensures properties.

A pass object is an immutable value (a frozen dataclass of validated parameters). It keeps no state
about the graphs it has seen: `check` reports why it does not match (or None), `rewrite` edits the
graph in place and returns a PassResult, `verify` checks the invariants the pass established. Every
concrete subclass is known by its class name to `Pipeline.from_json` (passes.registry): defining the
class is registering it.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx

CAPTURED = "captured_decode_step"


@dataclass(frozen=True)
class PassResult:
    graph_module: torch.fx.GraphModule
    modified: bool
    summary: str = ""


class Pass(ABC):
    """Base class of every rewrite. Subclasses are frozen dataclasses of their parameters."""

    requires: ClassVar[frozenset[str]] = frozenset({CAPTURED})
    ensures: ClassVar[frozenset[str]] = frozenset()
    changes_output: ClassVar[str | None] = None  # a lossy rewrite says here how the model's output changes

    @property
    def name(self) -> str:
        return type(self).__name__

    @abstractmethod
    def check(self, gm: torch.fx.GraphModule) -> str | None:
        """Return None when the pass applies to `gm`, else the reason it does not."""

    @abstractmethod
    def rewrite(self, gm: torch.fx.GraphModule) -> PassResult:
        """Rewrite `gm` in place; only called after `check` returned None."""

    def verify(self, gm: torch.fx.GraphModule) -> None:
        """Check the invariants this pass established; raises GraphVerificationError. The manager runs
        it after the generic `ir.verify`, after this pass and after every later one."""

    def runtime_hook(self, step):
        """This pass's runtime half (a passes.runtime.RuntimeHook) for a PyTorch program of the step it
        rewrote, lowered (`step`: a passes.runtime.LoweredStep), or None (the default: the step needs
        nothing but forward and commit)."""
        return None

    def onnx_runtime_hook(self, program):
        """This pass's runtime half for an ONNX Runtime program of its export (backends.onnx.program), or
        None (the default)."""
        return None

    def export_hook(self, gm: torch.fx.GraphModule, arch, dtype: torch.dtype):
        """What this pass adds to an ONNX export of the step `gm` it rewrote, for `arch` (ir.ArchSpec)
        in `dtype` (a passes.export.ExportHook), or None (the default): the exporter cannot express it."""
        return None

    def largest_tree(self) -> int | None:
        """The largest token tree the rewritten step verifies, if this pass decides it (TreeAttention)."""
        return None

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]
