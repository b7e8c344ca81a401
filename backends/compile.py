"""The `specpass` torch.compile backend.

`torch.compile(model, backend="specpass", options={...})` finds this function through the
`torch_dynamo_backends` entry point. The backend is handed two kinds of graph:

* a captured specpass decode step (`specpass.ir.capture`, what `specpass.generate` builds for the
  compiled model): the options' pipeline runs on it, verified after every pass, and the result is
  lowered through the lowering registry (backends.lowering.registry: eager, oneDNN, inductor, CUDA
  graphs, gguf, gguf-compiled; `auto` picks one) and returned as the step the decode loop drives;
* dynamo's graph of the HF model's own forward (when the compiled model is simply called): its
  architecture is checked from the graph's module metadata and it runs unchanged, so `compiled(ids)`
  stays the model's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx

from .lowering.registry import lower
from .options import CompileOptions
from ..common.errors import UnsupportedArchitectureError
from ..ir import ArchSpec, SlotLayout, arch_of, is_captured_step
from ..ir.families import MODELING_MODULES, SUPPORTED_ARCHITECTURES
from ..passes import PassReport, Pipeline


def specpass_backend(gm: torch.fx.GraphModule, example_inputs, *, options=None, mode=None):
    opts = CompileOptions.from_mapping(options)
    if is_captured_step(gm):
        return compile_step(gm, opts)
    check_dynamo_graph(gm)
    return gm.forward


@dataclass(frozen=True)
class CompiledStep:
    """A rewritten, lowered decode step: call it with the graph's inputs as keywords."""

    run: Callable  # the lowered step (a registry Step: EagerStep, InductorStep, CudaGraphStep, ...): run(ids, layout)
    draft: Callable | None  # the lowered draft graph (ir.draft), if the pipeline adds one: draft.run_graph(inputs)
    resume: Callable | None  # with a cache-sharing draft graph: the lowered resume graph (ir.split)
    lower_side: Callable  # lowers another graph over the step's tensors as the step was (registry.Lowered)
    graph_module: torch.fx.GraphModule  # the rewritten graph, owner of the KV cache buffers
    report: PassReport
    arch: ArchSpec
    max_nodes: int  # largest tree the step is prepared for
    pipeline: Pipeline  # the passes that ran (the options' pipeline, or the default fitted to the model)

    def __call__(self, input_ids, layout: SlotLayout):
        return self.run(input_ids, layout)

    @property
    def input_names(self) -> list[str]:
        return self.run.input_names

    @property
    def lowering(self) -> str:
        return self.run.lowering


def compile_step(gm: torch.fx.GraphModule, opts: CompileOptions) -> CompiledStep:
    """Run the pipeline on a captured step (verified after every pass) and lower it."""
    pipeline = opts.pipeline_for(arch_of(gm))
    rewritten, report = pipeline.run(gm)
    max_nodes = pipeline.largest_tree()
    run, draft, resume, lower_side = lower(rewritten, opts.lowering, rewritten.k_cache.device, max_nodes,
                                           rewritten.k_cache.shape[3])  # fmt: skip
    return CompiledStep(run, draft, resume, lower_side, rewritten, report, arch_of(rewritten), max_nodes, pipeline)


def check_dynamo_graph(gm: torch.fx.GraphModule) -> None:
    """Reject graphs of HF models from families specpass cannot capture."""
    families = set()
    for node in gm.graph.nodes:
        for _, module_type in node.meta.get("nn_module_stack", {}).values():
            module = getattr(module_type, "__module__", "")
            if module.startswith("transformers.models."):
                families.add(module)
    unsupported = sorted(m for m in families if not m.startswith(MODELING_MODULES))
    if unsupported:
        raise UnsupportedArchitectureError(
            f"specpass cannot compile modules from {unsupported}; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
