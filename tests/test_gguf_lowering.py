"""The GGUF lowering: block parsing, the int4 planes against the de-quantized float32 linear, matching
the default model's GGUF file, refusals, and greedy output against float32 (near-ties only), op by op
and compiled whole (tests/test_gguf_compiled.py has the compiled step's own tests)."""

import collections

import gguf
import numpy as np
import pytest
import torch

import specpass
from specpass.backends.lowering.gguf_blocks import BLOCK, match_blocks, parse_blocks
from specpass.backends.lowering.gguf import NEAR_TIE_LOGITS, gguf_linear, gguf_source, planes_of
from specpass.common.errors import InvalidParameterError
from specpass.ir import arch_of, capture
from conftest import needs_cxx, needs_int4_kernel, tiny_model

KINDS = ("Q4_0", "Q4_1", "Q8_0")
UNIT = 2.0**-8  # bfloat16's unit roundoff: the lowering rounds activations, the constants and its output to it


def random_blocks(kind: str, rows: int = 96, cols: int = 128, seed: int = 0):
    """(BlockWeight, gguf's own de-quantization [rows, cols]) of random weights quantized by gguf."""
    weights = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    weights[0, :BLOCK] = 0.0  # an all-zero block (scale 0)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(weights, qtype)  # [rows, cols / 32 * bytes] uint8
    return parse_blocks(kind, raw, rows, cols), gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize("kind", KINDS)
def test_parsed_blocks_dequantize_as_gguf_does(kind):
    blocks, reference = random_blocks(kind)
    assert blocks.codes.shape == (96, 128) and blocks.scale.shape == (96, 128 // BLOCK)
    low, high = (0, 15) if kind.startswith("Q4") else (-128, 127)
    assert low <= int(blocks.codes.min()) and int(blocks.codes.max()) <= high
    assert torch.equal(blocks.dequantize(), torch.from_numpy(reference))  # bit for bit


def test_unsupported_block_type_is_refused():
    with pytest.raises(InvalidParameterError, match="Q5_K is not supported; supported"):
        parse_blocks("Q5_K", np.zeros((1, 176), np.uint8), 1, 256)
    with pytest.raises(InvalidParameterError, match="multiple of 32"):
        parse_blocks("Q4_1", np.zeros((1, 20), np.uint8), 1, 48)


@needs_int4_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_int4_planes_equal_the_dequantized_linear(kind, tokens):
    """gguf_linear = x @ W^T within bfloat16 rounding: |error| <= 4 u (|x| @ |W|^T + |x| @ |Z|^T), u = 2^-8,
    Z the kernel's per-block zero (its rounding, for Q4_1); the bound is below the error a wrong
    scale, zero, code order or plane split makes (checked: swapped block halves are caught)."""
    blocks, _ = random_blocks(kind, seed=tokens)
    weight = blocks.dequantize()  # [N, K]
    x = torch.randn(2, tokens, weight.shape[1])  # [2, T, K]
    bias = torch.randn(weight.shape[0])
    planes = planes_of(blocks)
    assert len(planes) == (2 if kind == "Q8_0" else 1)
    out = gguf_linear(x, tuple(p for p, _ in planes), tuple(s for _, s in planes), bias)
    assert out.shape == (2, tokens, weight.shape[0]) and out.dtype == torch.float32
    reference = x @ weight.T + bias
    zero = (blocks.offset + 8 * blocks.scale).abs().repeat_interleave(BLOCK, 1) if kind == "Q4_1" else 0 * weight
    bound = 4 * UNIT * (x.abs() @ weight.abs().T + x.abs() @ zero.T) + 1e-6
    assert ((out - reference).abs() <= bound).all()
    rows, cols = blocks.codes.shape  # the classic layout bug: a block's two halves of 16 codes swapped
    swapped = blocks.codes.view(rows, cols // BLOCK, 2, BLOCK // 2).flip(2).reshape(rows, cols)
    wrong = planes_of(type(blocks)(blocks.block_type, swapped, blocks.scale, blocks.offset))
    broken = gguf_linear(x, tuple(p for p, _ in wrong), tuple(s for _, s in wrong), bias)
    assert ((broken - reference).abs() > bound).float().mean() > 0.5


def test_lowering_refuses_a_model_without_gguf_blocks():
    model = tiny_model("llama")
    with pytest.raises(InvalidParameterError, match="load it with specpass.load_model"):
        specpass.compile_program(model, {"lowering": "gguf", "budget": 4})
    with pytest.raises(InvalidParameterError, match="lowering"):
        specpass.compile_program(model, {"lowering": "q4"})


@pytest.fixture(scope="module")
def matched(default_model):
    model, _ = default_model
    gm = capture(model, cache_size=64)
    arch = arch_of(gm)
    return model, gm, match_blocks(gguf_source(gm), gm, arch.num_heads, arch.num_kv_heads)


def test_default_model_blocks_equal_every_linear_weight(matched):
    """Every linear of the default model, q/k (row-permuted by transformers) and the tied LM head
    (token_embd, Q8_0) included, matches its GGUF blocks bit for bit."""
    _, gm, blocks = matched
    linears = {n.target for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), torch.nn.Linear)}
    assert set(blocks.weights) == linears and not blocks.unmatched
    assert collections.Counter(b.block_type for b in blocks.weights.values()) == {"Q4_1": 210, "Q8_0": 1}
    assert blocks.weights["lm_head"].block_type == "Q8_0"


def test_a_weight_changed_after_loading_is_left_to_float32(matched):
    model, gm, _ = matched
    weight = gm.get_submodule("layers.2.mlp.up_proj").weight
    old = weight[5, 9].clone()
    with torch.no_grad():
        weight[5, 9] = old + 0.125
    try:
        arch = arch_of(gm)
        blocks = match_blocks(gguf_source(gm), gm, arch.num_heads, arch.num_kv_heads)
    finally:
        with torch.no_grad():
            weight[5, 9] = old
    assert set(blocks.unmatched) == {"layers.2.mlp.up_proj"}
    assert "de-quantized differs" in blocks.unmatched["layers.2.mlp.up_proj"]
    assert len(blocks.weights) == 210


def first_difference(tokens: torch.Tensor, other: torch.Tensor) -> int | None:
    """The first position where two [1, S] sequences differ (None: equal). They stop at EOS or at the
    same length limit, so equal up to the shorter length means equal."""
    length = min(tokens.shape[1], other.shape[1])
    different = (tokens[0, :length] != other[0, :length]).nonzero()
    assert len(different) or tokens.shape == other.shape
    return int(different[0]) if len(different) else None


@needs_int4_kernel
@pytest.mark.parametrize("lowering", ["gguf", pytest.param("gguf-compiled", marks=needs_cxx)])
def test_gguf_greedy_differs_from_float32_only_at_near_ties(default_model, cases, lowering):
    """Speculative greedy on a GGUF lowering (op by op, or compiled whole) equals the lowering's own
    one-token greedy token for token (its int4 kernel at every size, the prefill included), and differs
    from HF float32 greedy (the `cases` fixture) only where both tokens' float32 logits are within
    NEAR_TIE_LOGITS of the largest (the default model has three-way ties: 33.543, 33.520, 33.516 at
    HumanEval 0's fourth token)."""
    model, _ = default_model
    program = specpass.compile_program(model, {"lowering": lowering, "budget": 8})
    one_node = specpass.compile_program(model, {"lowering": lowering, "budget": 1})
    assert program.step.run.lowering == one_node.step.run.lowering == lowering
    assert program.report.invariance.passed  # checked at build, compiled steps included
    chosen = (cases[0], cases[3]) if lowering == "gguf" else cases[:1]  # compiled = op by op: tests/test_gguf_compiled.py
    for ids, reference in chosen:  # a code prompt and a chat prompt (the compiled step: the code one)
        new = reference.shape[1] - ids.shape[1]
        tokens = specpass.generate(program, ids, new).sequences
        alone = specpass.generate(one_node, ids, new).sequences
        assert torch.equal(tokens, alone)
        for other in (reference,):
            at = first_difference(tokens, other)
            if at is None:
                continue
            assert at >= ids.shape[1]
            with torch.no_grad():
                logits = model(other[:, :at]).logits[0, -1]  # [V] float32
            # both tokens within NEAR_TIE_LOGITS of the float32 maximum (two of a two- or three-way tie)
            gap = float(logits.max() - logits[[int(tokens[0, at]), int(other[0, at])]].min())
            assert gap <= NEAR_TIE_LOGITS, f"divergence at token {at - ids.shape[1]}, {gap:.4f} below the top logit"


@needs_int4_kernel
def test_a_weight_changed_after_building_is_noticed_by_the_gguf_lowering():
    """A GGUF program keeps the file's int4 blocks: after a linear's weight changes in place, the next call
    builds it again, leaves that linear to float32 (its blocks no longer equal the weight) and gives the
    changed model's output (HF float32 greedy of it, up to near-ties), not the file's."""
    model, tokenizer = specpass.load_default_model()  # its own copy: the change must not reach other tests
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids  # [1, P]
    options = {"lowering": "gguf", "budget": 8}
    before = specpass.generate(model, ids, 16, eos_token_id=[], options=options).sequences
    program = specpass.compile_program(model, options)
    with torch.no_grad():
        for layer in model.model.layers[-4:]:
            layer.mlp.down_proj.weight.mul_(-1.0)
    after = specpass.generate(model, ids, 16, eos_token_id=[], options=options).sequences
    rebuilt = specpass.compile_program(model, options)
    assert rebuilt is not program
    assert not torch.equal(after, before)  # the change shows
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                               eos_token_id=None)  # fmt: skip
    at = first_difference(after, reference)
    if at is not None:
        with torch.no_grad():
            logits = model(reference[:, :at]).logits[0, -1]  # [V] float32, the changed model
        gap = float(logits.max() - logits[[int(after[0, at]), int(reference[0, at])]].min())
        assert gap <= NEAR_TIE_LOGITS, f"divergence at token {at - ids.shape[1]}, {gap:.4f} below the top logit"
