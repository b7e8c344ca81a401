"""The export-hook protocol: what a rewrite adds to an ONNX export of the step it made.

`Pass.export_hook(gm, arch, dtype)` answers for the step `gm` the pass rewrote: None when the
exporter cannot express the pass (the export then refuses, naming it), else an `ExportHook`. A hook
with nothing in it says the pass lives entirely inside the step's graph (a tree mask, draft heads'
outputs, the ladder's streams). A hook with graphs adds files beside model.onnx: each graph is a
torch module with sample inputs, which the exporter (backends.onnx.export) traces, saves and checks on
ONNX Runtime against PyTorch, and `entry` goes to the manifest under `manifest_key` for the runtime
that reads the export back. It lives here, below rewrites/ and backends/, as the runtime hooks do:
the rewrite says what to export, the backend knows how.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ExportGraph:
    """One graph beside the exported step, in a file of its own."""

    file: str  # e.g. "evict.onnx"
    module: torch.nn.Module  # what the graph computes (traced by torch.onnx.export)
    inputs: Mapping[str, torch.Tensor]  # sample inputs, in the graph's input order (traced, then checked)
    outputs: tuple[str, ...]
    dynamic_shapes: Mapping | None = None  # torch.export's, by input name (None: every shape static)


@dataclass(frozen=True)
class ExportHook:
    """What a pass adds to an ONNX export (module docstring); the empty hook adds nothing."""

    manifest_key: str | None = None  # where `entry` goes in manifest.json (None: no entry)
    graphs: tuple[ExportGraph, ...] = ()
    entry: Mapping[str, object] = field(default_factory=dict)  # JSON-ready: file names, state shapes, ...
