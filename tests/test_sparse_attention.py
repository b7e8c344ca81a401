"""Sparse attention (rewrites.sparse_attention, TidalDecode and TokenSelect): the selection against brute
force, the CPU kernels against the reference ops, the graph each pass produces and verifies, refusals,
every slot selected = the full model, greedy against an independent reference (tests/sparse_reference.py)
one token a step, speculatively and in a batch, the CPU lowerings, ONNX Runtime and the GGUF lowering
alike, and a pipeline with KV eviction."""

import pytest
import torch
import transformers
from conftest import needs_cxx, needs_onednn, padded, tiny_model
from sparse_reference import sparse_greedy

import specpass
from specpass.backends.kernels import attention as ordered, sparse_attention as kernels
from specpass.common.errors import GraphVerificationError, InvalidParameterError, PassMismatchError
from specpass.drafters.registry import drafter_by_name
from specpass.ir import capture, ops, query
from specpass.research.tiny_models import TINY
from specpass.rewrites import H2O, TOVA, SparseAttention, TidalDecode, TokenSelect, TreeAttention


def _four_layers():
    """A tiny Llama of four layers whose attention is peaked as a trained model's is (queries scaled up):
    a random model's near-uniform attention makes TokenSelect's votes near-ties."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(TINY | {"num_hidden_layers": 4}))).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(QUERY_SCALE)
    return model


QUERY_SCALE = 4.0


def _random_call(gen, b=2, h=6, kv=2, t=3, s=40, d=8):
    q, k, v = torch.randn(b, h, t, d, generator=gen), torch.randn(b, kv, s + 3, d, generator=gen), torch.randn(b, kv, s + 3, d, generator=gen)
    mask = torch.rand(b, 1, t, s, generator=gen) < 0.6
    own = torch.randint(0, s, (b, t), generator=gen)
    mask[torch.arange(b)[:, None], 0, torch.arange(t)[None, :], own] = True  # a token sees its own slot
    return q, k, v, mask, own


# ---- the ops against brute force, the kernels against the ops ---------------------------------


@pytest.mark.parametrize("vote", [False, True])
def test_select_slots_is_the_own_slot_then_the_best_visible_ones(vote):
    gen = torch.Generator().manual_seed(0)
    q, k, _, mask, own = _random_call(gen)
    count, scale = 28, 0.3
    got = ops.select_slots(q, k, mask, scale, count, own, vote)  # [B, H, T, C]
    b_, h_, t_, _ = q.shape
    for b in range(b_):
        for t in range(t_):
            seen = mask[b, 0, t].nonzero().flatten().tolist()
            logits = torch.stack([torch.stack([q[b, h, t] @ k[b, h // 3, s] * scale for s in seen]) for h in range(h_)])
            votes = logits.softmax(-1).sum(0)  # [seen]
            for h in range(h_):
                score = votes if vote else logits[h]
                ranked = [seen[i] for i in score.argsort(descending=True).tolist() if seen[i] != own[b, t]]
                want = sorted([int(own[b, t])] + ranked[: count - 1])
                assert got[b, h, t].tolist() == [-1] * (count - len(want)) + want
    assert (got[..., 0] == -1).any()  # some queries see fewer than `count` slots: padded with -1


@pytest.mark.parametrize("vote", [False, True])
def test_the_cpu_kernels_choose_the_reference_slots_and_attend_alike(vote):
    gen = torch.Generator().manual_seed(1)
    for shape in [dict(), dict(b=1, h=4, kv=4, t=1, s=10), dict(t=5, s=70, d=16)]:
        q, k, v, mask, own = _random_call(gen, **shape)
        want = ops.select_slots(q, k, mask, 0.3, 9, own, vote)
        assert torch.equal(kernels.select_slots(q, k, mask, 0.3, 9, own, vote), want)
        torch.testing.assert_close(kernels.selected_attention(q, k, v, mask, 0.3, want),
                                   ops.selected_attention(q, k, v, mask, 0.3, want))  # fmt: skip
    # every visible slot selected: the ordered attention's bits, step for step
    q, k, v, _, _ = _random_call(gen, t=4, s=50, d=16)
    mask = torch.ones(2, 1, 4, 50, dtype=torch.bool).tril(46)
    every = kernels.select_slots(q, k, mask, 0.25, 50, torch.arange(46, 50).expand(2, 4), vote)
    assert torch.equal(kernels.selected_attention(q, k, v, mask, 0.25, every), ordered.ordered_attention(q, k, v, mask, 0.25))


# ---- the graph -----------------------------------------------------------------------------------


def test_each_pass_selects_and_attends_sparsely_where_its_paper_says():
    model = _four_layers()
    tidal, report = specpass.Pipeline(TreeAttention(8), TidalDecode(16)).run(capture(model, cache_size=64))
    attention = query.attention_ops(tidal.graph)
    assert [a.target is ops.selected_attention for a in attention] == [False, False, False, True]  # (2, 13/32 * 4 = 2)
    selections = [n for n in tidal.graph.nodes if n.target is ops.select_slots]
    assert len(selections) == 1 and selections[0].meta["specpass"].layer == 2 and selections[0].args[4] == 16
    assert attention[3].kwargs["selected"] is selections[0]
    assert "1 selecting layer(s) [2]; 1 of 4 layers attend to 16 slots" in str(report)
    assert TidalDecode(16).selecting_layers(30) == (2, 12)  # SmolLM2's 30 layers
    voting, _ = specpass.Pipeline(TreeAttention(8), TokenSelect(16)).run(capture(model, cache_size=64))
    attention = query.attention_ops(voting.graph)
    assert all(a.target is ops.selected_attention and a.kwargs["selected"].args[6] for a in attention)
    assert [a.kwargs["selected"].meta["specpass"].layer for a in attention] == [0, 1, 2, 3]


def test_the_passes_refuse_where_they_must_not_apply():
    model = tiny_model()
    sparse, _ = specpass.Pipeline(TreeAttention(8), TokenSelect(8)).run(capture(model, cache_size=64))
    source = sparse.graph.python_code("self").src
    assert TidalDecode(8, selecting=(0,)).check(sparse) == "the step already attends sparsely"
    assert sparse.graph.python_code("self").src == source
    with pytest.raises(PassMismatchError, match=r"TidalDecode does not apply .*already attends sparsely"):
        specpass.Pipeline(TreeAttention(8), TokenSelect(8), TidalDecode(8, selecting=(0,))).run(capture(model, cache_size=64))
    for arch, message in [("mistral", "sliding-window layers"), ("gemma2", "sinks or soft-capped logits"),
                          ("gpt-oss", "sinks or soft-capped logits")]:  # fmt: skip
        with pytest.raises(PassMismatchError, match=message):
            specpass.Pipeline(TreeAttention(4), TokenSelect(8)).run(capture(tiny_model(arch), cache_size=64))
    with pytest.raises(PassMismatchError, match=r"selecting layer\(s\) \[2\] outside the model's 2 layers"):
        specpass.Pipeline(TreeAttention(8), TidalDecode(8)).run(capture(model, cache_size=64))  # the default on 2 layers
    with pytest.raises(PassMismatchError, match="no layer is left to attend sparsely after layer 1 of 2"):
        specpass.Pipeline(TreeAttention(8), TidalDecode(8, selecting=(-1,))).run(capture(model, cache_size=64))
    for bad, message in [(lambda: TokenSelect(0), "tokens must be an int >= 1"), (lambda: TidalDecode(2.5), "tokens"),
                         (lambda: TidalDecode(8, selecting=()), "non-empty tuple"),
                         (lambda: TidalDecode(8, selecting=(True,)), "non-empty tuple")]:  # fmt: skip
        with pytest.raises(InvalidParameterError, match=message):
            bad()
    with pytest.raises(TypeError):
        SparseAttention(8)  # the base chooses no layers


def test_verification_catches_a_layer_reading_another_layers_selection():
    model = _four_layers()
    gm, _ = specpass.Pipeline(TreeAttention(8), TokenSelect(8)).run(capture(model, cache_size=64))
    TokenSelect(8).verify(gm)
    with pytest.raises(GraphVerificationError, match="expected layer 0's of 4 slots"):
        TokenSelect(4).verify(gm)
    attention = query.attention_ops(gm.graph)
    attention[3].kwargs = {**attention[3].kwargs, "selected": attention[1].kwargs["selected"]}
    with pytest.raises(GraphVerificationError, match="layer 3 reads the selection of layer 1, expected layer 3's"):
        TokenSelect(8).verify(gm)


def test_the_pipeline_says_the_output_changes_and_round_trips():
    pipeline = specpass.Pipeline(TreeAttention(16), TidalDecode(128, selecting=(2, 9)))
    assert "output changes: sparse attention" in str(pipeline)
    assert specpass.Pipeline.from_json(pipeline.to_json()) == pipeline
    voting = specpass.Pipeline(TreeAttention(16), TokenSelect(64))
    assert specpass.Pipeline.from_json(voting.to_json()) == voting


# ---- decoding ------------------------------------------------------------------------------------


def _generate(model, ids, sparse, budget, new=30, lowering="auto", extra=()):
    options = {"pipeline": specpass.Pipeline(TreeAttention(16), *extra, sparse), "budget": budget,
               "drafter": drafter_by_name("combined"), "lowering": lowering}  # fmt: skip
    out = specpass.generate(model, ids, max_new_tokens=new, options=options, eos_token_id=[])
    return out.sequences[0, ids.shape[1] :].tolist(), out.stats


def _prompts(seed: int, count: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    heads = [torch.randint(3, 96, (24 + 7 * i,), generator=gen) for i in range(count)]
    return [torch.cat([h, h[4:18]]) for h in heads]  # a repeat for the drafter to find


@torch.no_grad()
@pytest.mark.parametrize("sparse", [TidalDecode(200, selecting=(1,)), TokenSelect(200)], ids=["tidal", "token-select"])
def test_with_every_slot_selected_the_model_is_the_full_model(sparse):
    model = _four_layers()
    ids = _prompts(2, 1)[0][None]
    full = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)[0, ids.shape[1] :].tolist()
    assert _generate(model, ids, sparse, budget=8)[0] == full


NEAR_TIE = 1e-6  # a selection decided by a smaller relative gap may go either way in float32 (8 ulps)


@torch.no_grad()
@pytest.mark.parametrize("sparse", [TidalDecode(8, selecting=(1, 2)), TidalDecode(6), TokenSelect(8)],
                         ids=["tidal-two-selections", "tidal-default", "token-select"])  # fmt: skip
def test_greedy_equals_an_independent_reference_alone_speculatively_and_in_a_batch(sparse):
    """Each prompt's tokens equal tests/sparse_reference.py's (HF's model with the papers' rule as an
    attention function) with one-node trees, speculatively, and as a row of a left-padded batch; the
    rule does change them (the full model's differ). Prompts where a selection was decided by a
    near-tie are left out of the comparison (TokenSelect's summed softmaxes on a random model have
    some); at least two are compared."""
    model = _four_layers()
    prompts = _prompts(3, count=4)
    references = [sparse_greedy(model, p.tolist(), sparse, 30) for p in prompts]
    clear = [b for b, (_, margin) in enumerate(references) if margin > NEAR_TIE]
    assert len(clear) >= 2
    reference = [references[b][0] for b in clear]
    full = [model.generate(prompts[b][None], max_new_tokens=30, do_sample=False, eos_token_id=None)[0, len(prompts[b]) :].tolist()
            for b in clear]  # fmt: skip
    assert reference != full
    taus = []
    for b, want in zip(clear, reference):
        assert _generate(model, prompts[b][None], sparse, budget=1)[0] == want
        tokens, stats = _generate(model, prompts[b][None], sparse, budget=8)
        assert tokens == want
        taus.append(stats.tau)
    assert max(taus) > 1.0  # speculation accepted drafts
    ids, mask = padded(prompts)
    options = {"pipeline": specpass.Pipeline(TreeAttention(16), sparse), "budget": 8, "drafter": drafter_by_name("combined")}
    out = specpass.generate(model, ids, max_new_tokens=30, attention_mask=mask, eos_token_id=[], options=options)
    assert [list(out.new_tokens[b]) for b in clear] == reference


@torch.no_grad()
@pytest.mark.parametrize("lowering", [pytest.param("onednn", marks=needs_onednn), pytest.param("inductor", marks=needs_cxx)])
def test_the_cpu_lowerings_give_the_eager_tokens(lowering):
    """oneDNN and inductor (the kernels as custom ops) decode speculatively as eager decodes one token a step."""
    model = tiny_model()
    ids = _prompts(4, 1)[0][None]
    for sparse in (TidalDecode(8, selecting=(0,)), TokenSelect(8)):
        want, _ = _generate(model, ids, sparse, budget=1, lowering="eager")
        assert _generate(model, ids, sparse, budget=8, lowering=lowering)[0] == want, sparse


@torch.no_grad()
def test_an_onnx_export_attends_sparsely_on_ort_as_pytorch_does(tmp_path):
    """The exported step's selection reads each token's own slot in the functional layout (past slots,
    then the step's tokens): ORT decodes speculatively as eager decodes one token a step."""
    from specpass.backends.onnx.export import export

    model = tiny_model()
    sparse = TidalDecode(8, selecting=(0,))
    ids = _prompts(5, 1)[0][None]
    result = export(model, specpass.Pipeline(TreeAttention(8), sparse), str(tmp_path / "out"), progress=False)
    want, _ = _generate(model, ids, sparse, budget=1, lowering="eager")
    program = specpass.load_onnx(result.directory, drafter=drafter_by_name("combined"), budget=8)
    got = specpass.generate(program, ids, max_new_tokens=30, eos_token_id=[])
    assert got.sequences[0, ids.shape[1] :].tolist() == want
    assert got.stats.tau > 1.0
    assert "output changes: sparse attention" in str(program.pipeline)


@torch.no_grad()
@pytest.mark.parametrize("order", ["eviction-first", "sparse-first"])
def test_sparse_attention_composes_with_kv_eviction(order):
    """One pipeline with TOVA over a 32-slot cache, in either order: speculation = one token a step, and
    both rewrites change the tokens (each alone gives others)."""
    model = tiny_model()
    ids = _prompts(6, 1)[0][None]
    sparse, eviction = TidalDecode(8, selecting=(0,)), TOVA(32, 8)
    passes = (TreeAttention(16), eviction, sparse) if order == "eviction-first" else (TreeAttention(16), sparse, eviction)
    options = lambda budget: {"pipeline": specpass.Pipeline(*passes), "budget": budget, "drafter": drafter_by_name("combined")}  # noqa: E731
    one = specpass.generate(model, ids, max_new_tokens=30, options=options(1), eos_token_id=[])
    spec = specpass.generate(model, ids, max_new_tokens=30, options=options(8), eos_token_id=[])
    assert torch.equal(one.sequences, spec.sequences) and spec.stats.tau > 1.0
    tokens = one.sequences[0, ids.shape[1] :].tolist()
    assert tokens != _generate(model, ids, sparse, budget=1)[0]
    assert tokens != _generate(model, ids, TOVA(32, 8), budget=1)[0]
    assert H2O(32, 8).check(specpass.Pipeline(TreeAttention(16), sparse).run(capture(model, cache_size=64))[0]) is None


@torch.no_grad()
def test_the_gguf_lowering_attends_sparsely_on_the_default_model(default_model):
    """TidalDecode at its default layers (2 and 12 of SmolLM2's 30) on the GGUF lowering: speculative
    decoding gives the tokens of one token a step."""
    model, tokenizer = default_model
    ids = tokenizer("def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n", return_tensors="pt").input_ids
    sparse = TidalDecode(8)
    want, _ = _generate(model, ids, sparse, budget=1, new=16, lowering="gguf")
    got, stats = _generate(model, ids, sparse, budget=8, new=16, lowering="gguf")
    assert got == want and stats.tau > 1.0
