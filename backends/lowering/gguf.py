"""GGUF lowering for CPUs: the step's linear layers read the model's own quantized GGUF blocks.

At a handful of tokens a step is bound by the bytes of its weights, and the file's 4-bit blocks are a
fraction of the de-quantized float32 weights (docs/design.md, "GGUF blocks"). Each `nn.Linear` whose
blocks matched (backends.lowering.gguf_blocks) becomes `gguf_linear(x, planes, bias)` on PyTorch's int4
CPU kernel (`aten._weight_int4pack_mm_for_cpu`, groups of 32, weight (code - 8) * scale + zero) with
bfloat16 activations (its float16 path is a slow reference). Q4_0 / Q4_1: one plane, scale d, zero offset
+ 8 d; Q8_0: two, code + 128 = 16 h + l, h with scale 16 d, l with scale d and zero 8 d. The planes are
buffers shared by the graphs lowered together; other linears stay float32; the source graph is not
modified. Not the float32 function: activations, scales and zeros round to bfloat16, so greedy output
can differ from float32 greedy at a near-tie (NEAR_TIE_LOGITS; docs/experiments.md, "GGUF lowering").
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from .gguf_blocks import BLOCK, BlockWeight, match_blocks
from ...common.errors import InvalidParameterError
from ...ir import arch_of, copy_step, replace_node
from ...ir.capture import GGUF_META

# A greedy flip needs the float32 top-2 logit gap below the sum of the two logits' errors: the bound is
# twice the largest error measured on the default model, rounded up (docs/experiments.md, "GGUF lowering",
# "First measurements").
NEAR_TIE_LOGITS = 1.5
ACTIVATION = torch.bfloat16  # the kernel's activation, scale and zero dtype (float16 is its slow reference path)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel exists here: float32 models on a CPU with PyTorch's int4 CPU kernel."""
    return device.type == "cpu" and dtype == torch.float32 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def planes_of(blocks: BlockWeight) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(packed codes [N, K/2] uint8, scale_zero [K/32, N, 2] bfloat16)], summed by gguf_linear."""
    if blocks.block_type == "Q8_0":
        shifted = blocks.codes.int() + 128  # 0..255 = 16 h + l
        scale = blocks.scale
        return [_plane(shifted // 16, 16 * scale, torch.zeros_like(scale)), _plane(shifted % 16, scale, 8 * scale)]
    return [_plane(blocks.codes.int(), blocks.scale, blocks.offset + 8 * blocks.scale)]


def _plane(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int().contiguous(), 1)  # [N, K/2]
    scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(ACTIVATION).contiguous()  # [K/32, N, 2]
    return packed, scale_zero


def gguf_linear(x: torch.Tensor, packed: tuple[torch.Tensor, ...], scale_zero: tuple[torch.Tensor, ...],
                bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """x [..., K] float32 -> [..., N] float32 through the int4 planes (module docstring)."""
    rows = x.reshape(-1, x.shape[-1]).to(ACTIVATION)  # [M, K]
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed[0], BLOCK, scale_zero[0]).float()  # [M, N]
    for codes, scales in zip(packed[1:], scale_zero[1:]):  # Q8_0's second plane, summed in float32
        out = out + torch.ops.aten._weight_int4pack_mm_for_cpu(rows, codes, BLOCK, scales).float()
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def gguf_source(gm: torch.fx.GraphModule) -> str:
    """The GGUF file the step's model was loaded from, or a clear error."""
    path = gm.meta.get(GGUF_META)
    if path is None:
        raise InvalidParameterError(
            "the gguf lowerings read the quantized blocks of the GGUF file the model was loaded from; this "
            "model has none: load it with specpass.load_model() (the default model, or a .gguf file)"
        )
    return path


def gguf_planes(gm: torch.fx.GraphModule) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """id(weight) -> packed planes for every linear of the verify step `gm` whose GGUF blocks matched
    (backends.lowering.gguf_blocks); a clear error where the lowering cannot run at all."""
    device, dtype = gm.k_cache.device, gm.k_cache.dtype
    if not available(device, dtype):
        raise InvalidParameterError(f"the gguf lowerings need a float32 model on a CPU; the model is {dtype} on {device}")
    arch = arch_of(gm)
    matched = match_blocks(gguf_source(gm), gm, arch.num_heads, arch.num_kv_heads)
    if not matched.weights:
        raise InvalidParameterError(f"the gguf lowerings: no linear layer matched its GGUF blocks: {matched.unmatched}")
    return {id(gm.get_submodule(target).weight): planes_of(blocks) for target, blocks in matched.weights.items()}


def pack_gguf_linears(gm: torch.fx.GraphModule, planes: dict[int, list]) -> torch.fx.GraphModule:
    """A copy of `gm` whose linears with planes (by weight, from `gguf_planes`) run on them; the
    others are left as they are (see module docstring)."""
    lowered = copy_step(gm)
    graph = lowered.graph
    names: dict[int, list[tuple[str, str]]] = {}  # id(weight) -> buffer names in this graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        module = lowered.get_submodule(node.target)
        key = id(getattr(module, "weight", None))
        if not isinstance(module, nn.Linear) or key not in planes:
            continue
        if key not in names:
            names[key] = []
            for index, (packed, scale_zero) in enumerate(planes[key]):
                stem = f"gguf_{len(names) - 1}_{index}"
                lowered.register_buffer(f"{stem}_packed", packed, persistent=False)
                lowered.register_buffer(f"{stem}_scale_zero", scale_zero, persistent=False)
                names[key].append((f"{stem}_packed", f"{stem}_scale_zero"))
        with graph.inserting_before(node):
            packed_nodes = tuple(graph.get_attr(p) for p, _ in names[key])
            scale_nodes = tuple(graph.get_attr(s) for _, s in names[key])
            bias_node = graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
            linear = graph.call_function(gguf_linear, (node.args[0], packed_nodes, scale_nodes, bias_node))
        replace_node(node, linear, (*packed_nodes, *scale_nodes, bias_node, linear))
    graph.lint()
    lowered.recompile()
    return lowered
