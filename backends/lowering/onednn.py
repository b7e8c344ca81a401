"""oneDNN lowering for CPUs: every float32 `nn.Linear` of the step reads weights packed once for oneDNN.

Why. PyTorch's default CPU linear (MKL sgemm on the row-major weight) is slow for the skinny GEMMs of
decoding: a verify step multiplies 1..64 rows by each weight. Measured on a 2-core AMD EPYC (AVX-512,
torch 2.13, SmolLM2-135M, float32): the whole step costs 47 ms at T = 1 and 65 ms at T = 16 with
`F.linear`, 23 ms and 31 ms with the weights pre-packed into oneDNN's blocked layout. The flatter
cost curve is what makes wide trees pay off on a CPU.

Rewrite. A copy of the graph in which each `call_module` of an `nn.Linear` becomes
`torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias)`; the packed weights are buffers of the
lowered module (one per distinct weight tensor, so a tied LM head is packed once). Node annotations
are kept. The source graph module is not modified.

Invariants. The lowered step computes the same function as the source: only the GEMM kernel changes,
so outputs agree to float rounding (logits within ~1e-4 of the eager step on the default model,
checked in tests). The packed weights are a copy, so the model's weights must not change after
compilation, and the CPU holds the linear weights twice: once for the model, once packed, whatever
the number of programs compiled from it (`packed_weight` packs each weight once per process; 540 MB
for the default model, which every program used to copy).
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from specpass.backends.lowering.derived_cache import DerivedCache
from specpass.ir import copy_step, replace_node

_PACKED: DerivedCache[torch.Tensor] = DerivedCache()  # weight -> its packed form


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this lowering applies: float32 weights on a CPU with oneDNN (mkldnn) built in."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_linears(gm: torch.fx.GraphModule, packed: dict[int, torch.Tensor] | None = None) -> torch.fx.GraphModule:
    """A copy of `gm` whose float32 CPU linears run on oneDNN-packed weights (see module docstring).

    packed: id(weight) -> packed weight, shared between graphs lowered together (the verify and the
    draft graph share the LM head), so each weight is packed once.
    """
    lowered = copy_step(gm)
    graph = lowered.graph
    packed = {} if packed is None else packed
    names: dict[int, str] = {}  # id(weight) -> buffer name in this graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        module = lowered.get_submodule(node.target)
        if not isinstance(module, nn.Linear) or not available(module.weight.device, module.weight.dtype):
            continue
        key = id(module.weight)
        if key not in packed:
            packed[key] = packed_weight(module.weight)
        if key not in names:
            names[key] = f"packed_{len(names)}"
            lowered.register_buffer(names[key], packed[key], persistent=False)
        name = names[key]
        with graph.inserting_before(node):
            weight_node = graph.get_attr(name)
            bias_node = graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
            linear = graph.call_function(
                torch.ops.mkldnn._linear_pointwise, (node.args[0], weight_node, bias_node, "none", [], "")
            )
        replace_node(node, linear, (weight_node, bias_node, linear))
    graph.lint()
    lowered.recompile()
    return lowered


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] in oneDNN's blocked layout, shared by every graph lowered from it in this process.
    Packed again when the weight changed in place since (its version counter moved); the entry goes
    when the weight does."""
    return _PACKED.get((weight,), lambda: torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
