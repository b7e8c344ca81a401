"""The gguf lowerings on a tiny model (tests/test_gguf_compiled.py): a tiny llama whose every linear
weight is its own GGUF round trip (Q4_0, Q4_1 and Q8_0 blocks in turn), with the blocks' int4 planes
handed to the lowerings as `lower` hands them the GGUF file's.

Run as a script, it builds the compiled step in a fresh process and prints whether the process compiled
its package or loaded it, and the tree's logits, as one JSON line: the cross-process test runs it twice
on one cache directory ($SPECPASS_CACHE)."""

import json

import gguf
import torch
from conftest import tiny_model
from test_lowering import _run_prefix_and_tree
from torch import nn

import specpass
from specpass.backends.lowering.gguf import planes_of
from specpass.backends.lowering.gguf_blocks import parse_blocks
from specpass.backends.lowering.registry import LOWERINGS, BuildContext
from specpass.ir import capture

KINDS = ("Q4_0", "Q4_1", "Q8_0")


def quantized_tiny_step() -> tuple[torch.fx.GraphModule, BuildContext]:
    """(a TreeAttention(16) step of a tiny llama whose linear weights equal their GGUF blocks, the
    BuildContext carrying those blocks' planes)."""
    model = tiny_model("llama")
    gm, _ = specpass.Pipeline(specpass.rewrites.TreeAttention(16)).run(capture(model, cache_size=128))
    planes = {}
    for module in gm.modules():
        if not isinstance(module, nn.Linear) or id(module.weight) in planes:
            continue
        kind = KINDS[len(planes) % len(KINDS)]
        rows, cols = module.weight.shape
        raw = gguf.quants.quantize(module.weight.detach().numpy(), gguf.GGMLQuantizationType[kind])
        blocks = parse_blocks(kind, raw, rows, cols)
        with torch.no_grad():
            module.weight.copy_(blocks.dequantize())
        planes[id(module.weight)] = planes_of(blocks)
    return gm, BuildContext(torch.device("cpu"), 16, 128, packed={}, planes=planes)


if __name__ == "__main__":
    gm, ctx = quantized_tiny_step()
    step = LOWERINGS["gguf-compiled"].build(gm, ctx)
    logits = _run_prefix_and_tree(step)
    print(json.dumps({"built_here": step.built_here, "package": step.package_path, "logits": logits.flatten().tolist()}))
