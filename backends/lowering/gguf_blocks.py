"""The quantized blocks of a GGUF file, matched to the linear layers of a captured decode step.

GGUF stores a linear weight [N, K] in blocks of 32 inputs with float16 constants: Q4_0 w = d (q - 8) and
Q4_1 w = d q + m (q in 0..15), Q8_0 w = d q (q in -128..127). Here a weight is codes [N, K] with per-block
`scale` and `offset` [N, K/32] (float32, exact): w = scale * code + offset. A step linear's HF name finds
its GGUF tensor through gguf's own name map (a tied LM head reads `token_embd`, as llama.cpp does), and
the row permutation transformers applies to llama q/k, taken from its own tensor processor, is applied.

Invariant. A weight's blocks are used only when, de-quantized as transformers does (d * q + m), they
equal the module's float32 weight bit for bit; a weight that does not match (another file, changed
weights, an unsupported block type) is reported and left to the float32 kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.fx
from torch import nn

from .gguf_index import read_index
from ...common.errors import InvalidParameterError

BLOCK = 32
# block type name -> bytes per block (float16 constants, then the codes)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class BlockWeight:
    """One linear weight as GGUF blocks: w[n, k] = scale[n, k // 32] * codes[n, k] + offset[n, k // 32]."""

    block_type: str  # "Q4_0", "Q4_1" or "Q8_0"
    codes: torch.Tensor  # [N, K] int16: 0..15 (Q4_*) or -128..127 (Q8_0)
    scale: torch.Tensor  # [N, K / 32] float32 (float16 values)
    offset: torch.Tensor  # [N, K / 32] float32 (float16 values; Q4_0: -8 d; Q8_0: 0)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, computed as transformers' GGUF loader computes it (d * q + m). For Q4_0 its
        d * (q - 8) equals d * q + (-8 d) exactly: d is a float16, so d * q, 8 d and their difference
        all fit float32's mantissa."""
        scale = self.scale.repeat_interleave(BLOCK, dim=1)
        offset = self.offset.repeat_interleave(BLOCK, dim=1)
        return scale * self.codes.float() + offset


@dataclass(frozen=True)
class MatchedBlocks:
    """The blocks matched to a step's linears, and why each other linear was left to float32."""

    weights: dict[str, BlockWeight]  # call_module target -> its blocks
    unmatched: dict[str, str]  # call_module target -> the reason


def parse_blocks(block_type: str, raw: np.ndarray, rows: int, cols: int) -> BlockWeight:
    """A BlockWeight from GGUF's raw bytes [rows, cols / 32 * bytes per block] (uint8)."""
    if block_type not in BLOCK_BYTES:
        raise InvalidParameterError(f"GGUF block type {block_type} is not supported; supported: {sorted(BLOCK_BYTES)}")
    if cols % BLOCK:
        raise InvalidParameterError(f"a {block_type} weight needs a multiple of {BLOCK} inputs, got {cols}")
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // BLOCK, BLOCK_BYTES[block_type])  # [N, K/32, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    if block_type == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).astype(np.int16)  # [N, K/32, 32]
        offset = np.zeros_like(d)
    else:
        start = 4 if block_type == "Q4_1" else 2
        packed = blocks[..., start:]  # [N, K/32, 16]: low nibbles are inputs 0..15, high nibbles 16..31
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int16)  # [N, K/32, 32]
        offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if block_type == "Q4_1" else -8 * d
    return BlockWeight(block_type, torch.from_numpy(codes.reshape(rows, cols)), torch.from_numpy(d),
                       torch.from_numpy(np.ascontiguousarray(offset)))  # fmt: skip


def match_blocks(path: str, gm: torch.fx.GraphModule, num_heads: int, num_kv_heads: int) -> MatchedBlocks:
    """The GGUF blocks of every `nn.Linear` the step calls (see the module docstring)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    index = read_index(path)
    arch_name = index.architecture
    archs = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch_name not in archs:
        raise InvalidParameterError(f"{path}: gguf does not know the architecture {arch_name!r}")
    tensors = index.tensors
    layers = 1 + max((int(name.split(".")[1]) for name in tensors if name.startswith("blk.")), default=-1)
    names = gguf.get_tensor_name_map(archs[arch_name], layers)
    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(
        config={"num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads}
    )
    weights: dict[str, BlockWeight] = {}
    unmatched: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target in weights or node.target in unmatched:
            continue
        module = gm.get_submodule(node.target)
        if not isinstance(module, nn.Linear):
            continue
        gguf_name = names.get_name(node.target)
        if gguf_name == "output" and "output.weight" not in tensors:
            gguf_name = "token_embd"  # a tied LM head
        tensor = tensors.get(f"{gguf_name}.weight") if gguf_name else None
        if tensor is None:
            unmatched[node.target] = "no GGUF tensor of that name"
            continue
        block_type = tensor.block_type
        if block_type not in BLOCK_BYTES:
            unmatched[node.target] = f"block type {block_type} (supported: {', '.join(sorted(BLOCK_BYTES))})"
            continue
        rows, cols = module.weight.shape
        if tuple(int(n) for n in reversed(tensor.shape)) != (rows, cols):  # GGUF lists shapes inner-first
            unmatched[node.target] = f"{tensor.name} is {list(reversed(tensor.shape))}, the weight {[rows, cols]}"
            continue
        blocks = parse_blocks(block_type, tensor.data, rows, cols)
        order = processor.process(weights=np.arange(rows)[:, None], name=tensor.name).weights[:, 0]
        blocks = BlockWeight(block_type, *(part[torch.from_numpy(np.ascontiguousarray(order))]
                                     for part in (blocks.codes, blocks.scale, blocks.offset)))  # fmt: skip
        if not torch.equal(blocks.dequantize(), module.weight.detach().float()):
            unmatched[node.target] = f"{tensor.name} de-quantized differs from the weight"
            continue
        weights[node.target] = blocks
    return MatchedBlocks(weights, unmatched)
