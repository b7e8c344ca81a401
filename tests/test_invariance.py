"""Lossless by construction: the CPU kernel set gives a token's outputs the same bits whatever else the
call holds, every CPU lowering of every family passes the build-time check in float32 and bfloat16,
and a kernel that depends on the rest of the call is refused."""

import pytest
import torch
from conftest import TINY_ARCHS, needs_onednn, tiny_model

import specpass
from specpass.backends.kernels import attention as attention_module
from specpass.backends.kernels import linear as linear_module
from specpass.backends.kernels.attention import ordered_attention
from specpass.backends.kernels.linear import row_plan, rows_linear

SDPA = torch.nn.functional.scaled_dot_product_attention


def _qkv(batch, heads, kv_heads, tokens, slots, dim, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tokens, dim, generator=gen).to(dtype)
    keys = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
    return q, keys, values


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 16), (6, 6, 80), (8, 2, 128), (2, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_node_attends_as_the_same_token_decoded_alone(heads, kv_heads, dim, dtype):
    """A node of a tree verified among other nodes and rows, its keys at scattered slots behind hidden
    ones, gets exactly the output of the same query alone over its keys in consecutive slots."""
    committed, nodes = 70, 12
    parents = [-1, 0, 0, 1, 1, 3, 2, 6, 5, 8, 9, 7]
    q, keys, values = _qkv(2, heads, kv_heads, nodes, committed + nodes + 5, dim, dtype=dtype)
    mask = torch.zeros(2, 1, nodes, committed + nodes, dtype=torch.bool)
    mask[:, :, :, :committed] = True
    for i, p in enumerate(parents):
        mask[:, 0, i, committed + i] = True
        if p >= 0:
            mask[:, 0, i, committed : committed + nodes] |= mask[:, 0, p, committed : committed + nodes]
    mask[1, :, :, 40:committed] = False  # row 1: a shorter prefix (its slots past 40 hidden)
    together = ordered_attention(q, keys, values, mask, scale=0.3, softcap=None)
    for b in range(2):
        for i in range(nodes):
            seen = mask[b, 0, i].nonzero().flatten()  # the node's keys, prefix then ancestors by depth
            alone = ordered_attention(q[b : b + 1, :, i : i + 1], keys[b : b + 1, :, seen], values[b : b + 1, :, seen],
                                      torch.ones(1, 1, 1, len(seen), dtype=torch.bool), scale=0.3)  # fmt: skip
            assert torch.equal(alone[0, :, 0], together[b, :, i]), (b, i)


def test_attention_equals_sdpa_up_to_rounding_and_the_soft_cap_as_hf_computes_it():
    q, keys, values = _qkv(1, 8, 2, 7, 50, 16)
    mask = torch.rand(1, 1, 7, 50, generator=torch.Generator().manual_seed(1)) < 0.7
    mask[..., 0] = True
    expected = SDPA(q, keys, values, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(ordered_attention(q, keys, values, mask, 0.25), expected, rtol=1e-5, atol=1e-6)
    from specpass.ir.ops import softcapped_attention

    capped = softcapped_attention(q, keys, values, attn_mask=mask, scale=0.25, softcap=2.0)
    torch.testing.assert_close(ordered_attention(q, keys, values, mask, 0.25, softcap=2.0), capped, rtol=1e-5, atol=1e-6)


def test_attention_with_sinks_is_gpt_oss_attention_and_a_node_attends_as_alone():
    """Sinks (a logit per head in the denominator): equal to HF's eager form (ir.ops.sink_attention, and
    written out here) up to rounding, a sink above every score included; a tree node among others gets
    the bits of the same query alone."""
    from specpass.ir.ops import sink_attention

    q, keys, values = _qkv(2, 8, 2, 7, 50, 16)
    mask = torch.rand(2, 1, 7, 50, generator=torch.Generator().manual_seed(1)) < 0.7
    mask[..., 0] = True
    sinks = torch.tensor([0.0, 1.0, -2.0, 3.0, 30.0, 0.5, -0.5, 2.0])  # head 4's sink dwarfs its scores
    got = ordered_attention(q, keys, values, mask, 0.25, sinks=sinks)
    torch.testing.assert_close(got, sink_attention(q, keys, values, attn_mask=mask, scale=0.25, sinks=sinks),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    scores = (q @ keys.repeat_interleave(4, dim=1).transpose(-1, -2)) * 0.25  # [B, H, T, S], by hand
    scores = scores.masked_fill(~mask, float("-inf"))
    combined = torch.cat([scores, sinks[None, :, None, None].expand(2, -1, 7, 1)], dim=-1).softmax(-1)[..., :-1]
    torch.testing.assert_close(got, combined @ values.repeat_interleave(4, dim=1), rtol=1e-5, atol=1e-6)
    assert got[:, 4].abs().max() < 1e-6 < got[:, 0].abs().max()  # the large sink takes nearly all the weight
    for b, i in ((0, 3), (1, 6)):
        seen = mask[b, 0, i].nonzero().flatten()
        alone = ordered_attention(q[b : b + 1, :, i : i + 1], keys[b : b + 1, :, seen], values[b : b + 1, :, seen],
                                  torch.ones(1, 1, 1, len(seen), dtype=torch.bool), 0.25, sinks=sinks)  # fmt: skip
        assert torch.equal(alone[0, :, 0], got[b, :, i])


def test_attention_reads_only_the_slots_its_mask_covers_and_not_the_thread_count():
    """Cache rows longer than the mask (a step passes its written rows whole) and hidden slots holding
    garbage change nothing; nor does the number of threads."""
    q, keys, values = _qkv(1, 4, 2, 3, 40, 16)
    mask = torch.ones(1, 1, 3, 30, dtype=torch.bool)
    mask[..., 10:20] = False
    expected = ordered_attention(q, keys[:, :, :30], values[:, :, :30], mask, 0.5)
    keys[:, :, 10:20] = float("nan")
    values[:, :, 30:] = float("inf")
    assert torch.equal(ordered_attention(q, keys, values, mask, 0.5), expected)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ordered_attention(q, keys, values, mask, 0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, expected)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_of_the_linear_does_not_depend_on_the_other_rows(dtype):
    """Calls of sizes the probe never measured (17, 100, 600 rows: run in measured pieces) and of sizes it
    did give every row the bits of the same row computed alone, on both kernels: small weights on ATen's
    mm, large ones on oneDNN as they are and packed (as float32: bfloat16 computes in float32). One-output
    weights (a mixture's shared-expert gate) too: a one-row call of them is a GEMV that gives most rows
    other bits than a GEMM, and one row by chance the same (found on an Intel Xeon)."""
    gen = torch.Generator().manual_seed(0)
    for k, n in ((576, 1536), (1536, 576), (32, 96), (64, 256), (32, 1), (576, 1), (32, 4)):
        weight, bias = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
        x = torch.randn(600, k, generator=gen).to(dtype)
        large = linear_module.runs_on_onednn(weight)
        assert large == (n * k > linear_module.ATEN_MAX_WEIGHT)
        weights = (weight, torch.ops.mkldnn._reorder_linear_weight(weight.float())) if large else (weight,)
        for w in weights:
            plan = row_plan(w)
            assert plan.onednn == large and plan.sizes, (k, n, plan)
            alone = torch.cat([rows_linear(x[i : i + 1], w, bias, *plan) for i in range(600)])
            for m in (1, 2, 3, 7, 16, 17, 33, 100, 130, 600):
                assert torch.equal(rows_linear(x[:m], w, bias, *plan), alone[:m]), (k, n, m, plan)
            assert torch.equal(rows_linear(x[None, :5], w, bias, *plan), alone[None, :5])  # [B, T, K] inputs
            assert alone.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_element_of_a_pointwise_op_does_not_depend_on_the_rest_of_the_call(dtype):
    """Every transcendental op the kernel set takes, rows of widths that leave ATen's vector loop a tail
    (1, 16, 48) and one wider than a thread's piece (40000), calls of 1 .. 70 rows and slices at odd
    offsets: every element has the bits it has alone, and the values are the op's own (up to rounding)."""
    from specpass.backends.kernels.pointwise import OPS, rows_pointwise

    gen = torch.Generator().manual_seed(0)
    for width in (1, 16, 48, 40000):
        x = (torch.randn(70, width, generator=gen) * 3).to(dtype)
        for op, fn in OPS.items():
            alone = torch.cat([rows_pointwise(x[i : i + 1], op) for i in range(70)])
            torch.testing.assert_close(alone.float(), fn(x).float(), rtol=1e-2, atol=1e-2)
            for m in (2, 3, 7, 17, 54, 63, 70):
                assert torch.equal(rows_pointwise(x[:m], op), alone[:m]), (width, op, m)
            assert torch.equal(rows_pointwise(x[5:8], op), alone[5:8]) and torch.equal(
                rows_pointwise(x[None, 1:4], op), alone[None, 1:4])  # fmt: skip  # [B, T, D] inputs


@needs_onednn
def test_the_linear_runs_only_planned_call_sizes(monkeypatch):
    """A long call is cut into pieces of planned sizes, the largest that fits first; a remainder of at
    most 16 rows runs in one call, padded up to the next planned size; with no planned size each row
    runs in a call of the reference size."""
    calls = []
    real_linear = torch.nn.functional.linear

    def recording_linear(x, w):
        calls.append(x.shape[0])
        return real_linear(x, w)

    monkeypatch.setattr(torch.nn.functional, "linear", recording_linear)
    weight = torch.randn(8, 4)
    ladder = (4, 8, 12, 16, 24, 32, 64, 512)
    for m, sizes, expected in ((1, ladder, [4]), (600, ladder, [512, 64, 24]), (45, ladder, [32, 16]),
                               (10, (4, 8), [8, 4]), (2, (), [8, 8]), (3, (1, 2, 3), [3])):  # fmt: skip
        calls.clear()
        x = torch.randn(m, 4)
        out = linear_module.rows_linear(x, weight, None, False, sizes)
        assert calls == expected, (m, sizes)
        assert out.shape == (m, 8)
        torch.testing.assert_close(out, x @ weight.t())


@needs_onednn
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_family_computes_one_function_on_every_cpu_lowering(arch, monkeypatch):
    """The build-time check runs (prompt pieces, tree nodes alone, rows) and passes for each family on
    the eager lowering (its small weights on ATen's mm) and the oneDNN lowering (every weight on oneDNN,
    packed, as a large model's), float32 and bfloat16, two rows."""
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(arch).to(dtype)
        for lowering in ("eager", "onednn"):
            with monkeypatch.context() as patch:
                if lowering == "onednn":
                    patch.setattr(linear_module, "ATEN_MAX_WEIGHT", 0)
                program = specpass.compile_program(model, {"lowering": lowering, "cache_size": 128}, rows=2)
            check = program.report.invariance
            assert check.passed and check.compared >= 80 and "rows" in check.cases, (arch, dtype, lowering)


@needs_onednn
def test_a_kernel_that_depends_on_the_rest_of_the_call_is_refused(monkeypatch):
    """Two deliberately non-invariant kernels, each injected alone: SDPA for attention (its split of the
    keys depends on the call), and a linear whose rounding depends on the number of rows."""
    model = tiny_model("llama")

    def sdpa_attention(q, keys, values, mask, scale, softcap=None, sinks=None):
        slots = mask.shape[-1]
        return SDPA(q, keys[:, :, :slots], values[:, :, :slots], attn_mask=mask, scale=scale, enable_gqa=True)

    def rows_dependent_linear(x, weight, bias, onednn, sizes):
        rows = x.numel() // x.shape[-1]
        return rows_linear(x, weight, bias, onednn, sizes) * (1 + 1e-6 * (rows > 1))

    for name, module, kernel in (("ordered_attention", attention_module, sdpa_attention),
                                 ("rows_linear", linear_module, rows_dependent_linear)):  # fmt: skip
        with monkeypatch.context() as patch:
            patch.setattr(module, name, kernel)
            with pytest.raises(specpass.InvalidParameterError, match="does not compute one function") as refused:
                specpass.compile_program(model, {"lowering": "eager", "cache_size": 128})
            assert "differ, by up to" in str(refused.value), name
    program = specpass.compile_program(model, {"lowering": "eager", "cache_size": 128})  # the real kernels again
    assert program.report.invariance.passed


def _prompts(vocab: int, seed: int) -> list[torch.Tensor]:
    """Three prompts of 5, 11 and 17 tokens, each a piece repeated (drafts get accepted)."""
    gen = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(3, vocab, (n,), generator=gen) for n in (3, 4, 6)]
    return [torch.cat([p, p, p])[:n] for p, n in zip(pieces, (5, 11, 17))]


def _near_tie(model) -> None:
    """The LM head in near-twin rows and peaked: at nearly every step the top two logits lie within a few
    ulps, so a token-level comparison is as sensitive as a bitwise one."""
    with torch.no_grad():
        head = model.lm_head.weight  # [V, H]
        twins = head.shape[0] // 2
        head[1 : 2 * twins : 2] = head[0 : 2 * twins : 2] * (1 + 2**-20)
        head.mul_(8.0)


def _decode(program, prompts, new_tokens, **sampling):
    """(each row's new tokens, each row's committed logits) of one generate call over `prompts`."""
    from conftest import padded, recorded_logits

    ids, mask = padded(prompts)
    with recorded_logits(program) as logits:
        out = specpass.generate(program, ids, new_tokens, attention_mask=mask, eos_token_id=[], **sampling)
    rows = [out.sequences[0, ids.shape[1] :].tolist()] if len(prompts) == 1 else [list(r) for r in out.new_tokens]
    return rows, [torch.stack(row) for row in logits]


def _assert_one_function(model, options, prompts, new_tokens, monkeypatch, **sampling):
    """Speculative decoding of `prompts` in one batch equals each prompt decoded alone one token a step
    (prefilled in 3-token pieces), token for token and logits bit for bit."""
    from specpass.backends.runtime import decode

    rows = len(prompts)
    tokens, logits = _decode(specpass.compile_program(model, options, rows=rows), prompts, new_tokens, **sampling)
    one_node = specpass.compile_program(model, options | {"budget": 1})
    with monkeypatch.context() as patch:
        patch.setattr(decode, "PREFILL_LOGITS_BYTES", 3 * 4 * model.config.vocab_size)  # 3 tokens a forward
        for b, prompt in enumerate(prompts):
            alone_tokens, alone_logits = _decode(one_node, [prompt], new_tokens, **sampling)
            assert tokens[b] == alone_tokens[0], (b, options)
            assert logits[b].shape == alone_logits[0].shape and torch.equal(logits[b], alone_logits[0]), (b, options)


@needs_onednn
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_speculative_logits_equal_one_token_logits_bit_for_bit(arch, monkeypatch):
    """Every family, the eager and oneDNN lowerings, float32 and bfloat16, a near-tie LM head: trees of up
    to 16 nodes, three rows of other lengths (padding nodes) against each alone, other prefill pieces."""
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(arch)
        _near_tie(model)
        model = model.to(dtype)
        prompts = _prompts(model.config.vocab_size, seed=len(arch))
        for lowering in ("eager", "onednn"):
            options = {"pipeline": specpass.Pipeline(specpass.rewrites.TreeAttention(16)), "lowering": lowering,
                       "budget": 16, "cache_size": 128}  # fmt: skip
            _assert_one_function(model, options, prompts, 24, monkeypatch)


@needs_onednn
def test_the_default_model_is_one_function_float32_bfloat16_and_on_its_gguf_blocks(default_model, monkeypatch):
    """The default model on `auto` in float32 and bfloat16 (the cost budget), and on the gguf lowering
    (its int4 kernel at every tree size, the prefill included), greedy and sampled with a seed."""
    model, tokenizer = default_model
    prompts = [tokenizer(text, return_tensors="pt").input_ids[0] for text in
               ("def fibonacci(n):\n    if n < 2:\n        return n\n    return", "The capital of France is Paris. The capital of")]  # fmt: skip
    _assert_one_function(model, {}, prompts, 24, monkeypatch)
    bfloat16, _ = specpass.load_default_model(dtype=torch.bfloat16)
    _assert_one_function(bfloat16, {}, prompts[:1], 16, monkeypatch)
    gguf = {"lowering": "gguf"}
    _assert_one_function(model, gguf, prompts[:1], 24, monkeypatch)
    _assert_one_function(model, gguf, prompts[:1], 24, monkeypatch, do_sample=True, temperature=0.8, seed=5)
