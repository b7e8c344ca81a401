"""LazyLLM (rewrites.lazy_llm): the graph the pass produces and verifies, refusals, the kept tokens and
the first token's logits against the rule applied by hand on HF's own layers, every token kept = the
plain program bit for bit, speculation under LazyLLM = one token a step under it, and the default model
on its GGUF blocks."""

import math

import pytest
import torch
import transformers
from conftest import needs_int4_kernel, tiny_model

import specpass
from specpass.backends.runtime.decode import feed
from specpass.backends.runtime.sequence import CacheCursor
from specpass.common.errors import GraphVerificationError, InvalidParameterError, PassMismatchError
from specpass.ir import capture, ops, query
from specpass.research.tiny_models import TINY
from specpass.rewrites import KVEviction, LazyLLM, SinksWindow, TokenSelect, TreeAttention
from specpass.rewrites.lazy_llm import PRUNED, LazyPrefill

LAZY = LazyLLM(keep=(0.6, 0.3), layers=(1, 3))


def _four_layers():
    """A tiny Llama of four layers with peaked attention (queries scaled up, as in a trained model)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(TINY | {"num_hidden_layers": 4}))
    config._attn_implementation = "eager"  # the reference reads HF's own attention weights
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model


def _options(lazy=LAZY, budget="cost", **more):
    return {"pipeline": specpass.Pipeline(TreeAttention(8), lazy), "budget": budget, **more}


@torch.no_grad()
def _reference(model, ids: torch.Tensor, lazy: LazyLLM) -> tuple[torch.Tensor, list[list[int]]]:
    """The rule by hand on HF's modules: each layer runs on the tokens still present (their own positions,
    causal among them); a pruning layer keeps ceil(share * T) of them: the last, then those the last token
    attended to most in the layer below (its attention weights averaged over heads). Returns the last
    token's logits [V] and each stage's kept token indices."""
    inner, t = model.model, ids.shape[1]
    layers = lazy.pruning_layers(len(inner.layers))
    hidden, present, weights, kept = inner.embed_tokens(ids), torch.arange(t), None, []
    for i, layer in enumerate(inner.layers):
        if i in layers:
            scores = weights[0, :, -1, :].mean(0).clone()  # [n]: the last token's attention in the layer below
            scores[-1] = math.inf
            n = math.ceil(lazy.keep[layers.index(i)] * t)
            chosen = scores.topk(n).indices.sort().values
            present, hidden = present[chosen], hidden[:, chosen]
            kept.append(present.tolist())
        n = present.shape[0]
        causal = torch.full((1, 1, n, n), -math.inf).triu(1)
        captured = {}
        handle = layer.self_attn.register_forward_hook(lambda m, a, out: captured.update(w=out[1]))
        hidden = layer(hidden, attention_mask=causal, position_ids=present[None],
                       position_embeddings=inner.rotary_emb(hidden, present[None]))  # fmt: skip
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        handle.remove()
        weights = captured["w"]  # [1, H, n, n]
    return model.lm_head(inner.norm(hidden))[0, -1], kept


def _prefill(program, ids: torch.Tensor) -> torch.Tensor:
    """The prompt through the program's prefill in one piece; its last token's logits [V]."""
    (logits, _, _), = feed(program, [ids[0].tolist()], [CacheCursor()], piece=ids.shape[1])
    return logits[0, -1]


def _hook(program) -> LazyPrefill:
    return next(hook for hook in program.hooks if isinstance(hook, LazyPrefill))


def test_the_rewrite_hides_each_stages_pruned_slots_and_is_verified():
    gm, report = specpass.Pipeline(TreeAttention(8), LAZY).run(capture(_four_layers(), cache_size=64))
    masks = [op.kwargs["attn_mask"] for op in query.attention_ops(gm.graph)]
    assert [m.args[2] if m.target is ops.pruned_visibility else None for m in masks] == [None, 0, 0, 1]
    assert query.shared_mask(gm.graph) is not None  # one slot-layout mask under the restrictions
    assert dict(gm.named_buffers())[PRUNED].shape == (2, 1, 64)
    assert "60% above layer 1, 30% above layer 3" in str(report)
    LAZY.verify(gm)
    with pytest.raises(GraphVerificationError, match="layer 2 hides the pruned slots of stage 0, expected 1"):
        LazyLLM(keep=(0.6, 0.3), layers=(1, 2)).verify(gm)


def test_the_pass_refuses_where_it_must_not_apply():
    model = tiny_model()
    lazy = LazyLLM(keep=(0.5,), layers=(1,))
    gm, _ = specpass.Pipeline(TreeAttention(8), lazy).run(capture(model, cache_size=64))
    source = gm.graph.python_code("self").src
    assert lazy.check(gm) == "the step already prunes its prompt (LazyLLM)"
    assert gm.graph.python_code("self").src == source
    cases = [((TreeAttention(8), SinksWindow(32, chunk=8), lazy), "evicts its KV cache"),
             ((TreeAttention(8), TokenSelect(8), lazy), "attends sparsely"),
             ((TreeAttention(8), LazyLLM(keep=(0.5,), layers=(0,))), r"pruning layers \(0,\) must ascend from layer 1"),
             ((TreeAttention(8), LazyLLM()), r"pruning layer\(s\) \[2\] outside the model's 2 layers")]  # fmt: skip
    for passes, message in cases:
        with pytest.raises(PassMismatchError, match=message):
            specpass.Pipeline(*passes).run(capture(model, cache_size=64))
    with pytest.raises(PassMismatchError, match="sinks or soft-capped logits"):
        specpass.Pipeline(TreeAttention(4), lazy).run(capture(tiny_model("gemma2"), cache_size=64))
    for bad, message in [(lambda: LazyLLM(keep=()), "non-empty tuple"), (lambda: LazyLLM(keep=(0.5, 0.7)), "must not grow"),
                         (lambda: LazyLLM(keep=(0.0,)), r"in \(0, 1\]"), (lambda: LazyLLM(keep=(True,)), r"in \(0, 1\]"),
                         (lambda: LazyLLM(keep=(0.5,), layers=(1, 2)), "2 pruning layers for 1 shares")]:  # fmt: skip
        with pytest.raises(InvalidParameterError, match=message):
            bad()


def test_batches_and_the_onnx_export_are_refused_by_name(tmp_path):
    model = tiny_model()
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(InvalidParameterError, match=r"batch size 2 .* LazyLLM \(each row's prompt is pruned"):
        specpass.generate(model, ids, 4, options=_options(LazyLLM(keep=(0.5,), layers=(1,))))
    from specpass.backends.onnx.export import export

    with pytest.raises(Exception, match="LazyLLM"):
        export(model, specpass.Pipeline(TreeAttention(8), LazyLLM(keep=(0.5,), layers=(1,))), str(tmp_path), progress=False)


def test_the_kept_tokens_and_the_first_logits_follow_the_rule_on_hfs_layers():
    """Two stages on a four-layer model: the slots the prefill pruned are exactly the tokens the rule drops,
    and the last token's logits are the reference's (float32, other kernels: to 1e-4)."""
    model = _four_layers()
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(3))
    expected, kept = _reference(model, ids, LAZY)
    program = specpass.compile_program(model, _options(budget=1))
    logits = _prefill(program, ids)
    pruned = _hook(program).pruned[:, 0, :30]  # [stages, T]
    assert [(~pruned[s]).nonzero().flatten().tolist() for s in range(2)] == kept
    assert [len(k) for k in kept] == [18, 9] and set(kept[1]) < set(kept[0]) and 29 in kept[1]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
    plain = _prefill(specpass.compile_program(model, {"pipeline": specpass.Pipeline(TreeAttention(8)), "budget": 1}), ids)
    assert (logits - plain).abs().max() > 1e-3  # the pruning shows


def test_with_every_token_kept_the_program_is_the_plain_program_bit_for_bit():
    model = _four_layers()
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    everything = LazyLLM(keep=(1.0, 1.0), layers=(1, 3))
    plain_options = {"pipeline": specpass.Pipeline(TreeAttention(8)), "budget": 1}
    assert torch.equal(_prefill(specpass.compile_program(model, _options(everything, budget=1)), ids),
                       _prefill(specpass.compile_program(model, plain_options), ids))  # fmt: skip
    lazy = specpass.generate(model, ids, 16, options=_options(everything), eos_token_id=[])
    plain = specpass.generate(model, ids, 16, options=plain_options, eos_token_id=[])
    assert torch.equal(lazy.sequences, plain.sequences)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_speculation_under_lazyllm_equals_one_token_steps_under_it(arch):
    """Trees verified by the decode step prune nothing: speculative greedy and seeded sampling under
    LazyLLM equal one-node trees under it (the prompt with a repeat for the drafter to find; mistral:
    sliding-window layers, whose window restriction the pruned slots compose with)."""
    model = tiny_model(arch)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked next-token law, so that drafts are accepted
    head = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(7))
    ids = torch.cat([head, head[5:20], head[5:12]])[None]
    lazy = LazyLLM(keep=(0.5,), layers=(1,))
    for sampling in ({}, {"do_sample": True, "temperature": 0.8, "seed": 3}):
        tree = specpass.generate(model, ids, 24, options=_options(lazy), eos_token_id=[], **sampling)
        alone = specpass.generate(model, ids, 24, options=_options(lazy, budget=1), eos_token_id=[], **sampling)
        assert torch.equal(tree.sequences, alone.sequences), (arch, sampling)
    assert tree.stats.mean_tree_size > 1  # trees of several nodes were verified


def test_the_pipeline_says_the_output_changes_and_round_trips():
    pipeline = specpass.Pipeline(TreeAttention(16), LazyLLM(keep=(0.8, 0.4)))
    assert "output changes: LazyLLM" in str(pipeline)
    assert specpass.Pipeline.from_json(pipeline.to_json()) == pipeline


@needs_int4_kernel
def test_the_default_model_prunes_its_prompt_and_speculation_keeps_it_on_its_gguf_blocks(default_model, cases):
    """The default pruning (three stages) on a code prompt, on the gguf lowering (the prefill graph runs
    the int4 kernel too): slots pruned in each stage, more above; the speculative output equals one token
    a step under LazyLLM (the tiny models above: the auto lowering)."""
    model, _ = default_model
    ids = cases[0][0]
    lazy = specpass.compile_program(model, _options(LazyLLM(), budget=8, lowering="gguf"))
    out = specpass.generate(lazy, ids, 24, eos_token_id=[])
    pruned = _hook(lazy).pruned[:, 0, : ids.shape[1]].sum(1).tolist()  # [stages]
    assert 0 < pruned[0] < pruned[1] < pruned[2] < ids.shape[1]
    alone = specpass.generate(model, ids, 24, options=_options(LazyLLM(), budget=1, lowering="gguf"), eos_token_id=[])
    assert torch.equal(out.sequences, alone.sequences)
    assert out.stats.target_forwards < 24
