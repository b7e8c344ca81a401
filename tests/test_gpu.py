"""GPU-only checks (skipped without CUDA): CUDA-graph lowering and losslessness on the GPU."""

import pytest
import torch
from conftest import padded, peaked_four_layer_llama, peaked_tiny_model, tiny_model, train_tiny_feature_draft

import specpass
from specpass.research import prompts
from specpass.backends.lowering.registry import lower
from specpass.drafters import DraftTree
from specpass.ir import SlotLayout, capture

pytestmark = pytest.mark.gpu
BF16_TIE_ULPS = 2  # a bf16 near-tie: the top-2 logits within 2 units in the last place (8 mantissa bits)


@pytest.mark.parametrize("lowering", ["cudagraphs", "inductor"])
@torch.no_grad()
def test_cuda_graph_step_equals_eager_step(lowering):
    """Replays (the FX step's graphs, or the inductor step's) equal the eager step, with inputs on the
    device and on the host (what the decode loop passes: padded on the host, copied once)."""
    model = tiny_model("llama").cuda()
    gm, _ = specpass.Pipeline(specpass.rewrites.TreeAttention(16)).run(capture(model, cache_size=512))
    eager = lower(gm, "eager", torch.device("cuda"), 16, 512).step
    graphed = lower(gm, lowering, torch.device("cuda"), 16, 512).step
    assert graphed.lowering == lowering
    prompt = torch.randint(0, 96, (1, 40), device="cuda")
    for step in (eager, graphed):  # same prefill in both
        step(prompt, SlotLayout.chain(0, 40, "cuda"))
    tree = DraftTree((5, 6, 7, 8, 9), (-1, 0, 0, 1, 3), (1.0,) * 5, (None,) * 5)
    ids, layout = torch.from_numpy(tree.tokens)[None], SlotLayout.tree(40, tree.ancestor_mask())
    expected, _ = eager(ids.cuda(), layout.to("cuda"))
    for where in ("cuda", "cuda", "cpu", "cpu"):  # capture, then replays
        got, _ = graphed(ids.to(where), layout.to(where))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(graphed.graphs) == 1


def _divergence(out: torch.Tensor, reference: torch.Tensor, model, start: int):
    n = min(out.shape[1], reference.shape[1])
    diff = (out[0, :n] != reference[0, :n]).nonzero()
    if len(diff) == 0:
        return None if out.shape == reference.shape else ("length", None)
    i = int(diff[0])
    logits = model(reference[:, :i]).logits[0, -1].float()
    top2 = logits.topk(2).values
    ulp = 2.0 ** (torch.floor(torch.log2(top2[0].abs())) - 7)
    return i - start, float(top2[0] - top2[1]), float(ulp)


@pytest.mark.parametrize("lowering", ["cudagraphs", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_lossless_on_gpu_with_cuda_graphs(dtype, lowering):
    model, tokenizer = specpass.load_default_model(dtype=dtype, device="cuda")
    fast = torch.compile(model, backend="specpass", options={"lowering": lowering})
    cases = [prompts.encode_code(tokenizer, p) for p in prompts.code_prompts(4)]
    cases += [prompts.encode_chat(tokenizer, m) for m in prompts.chat_messages(4)]
    exact, ties = 0, []
    for ids in cases:
        ids = ids.cuda()
        reference = model.generate(ids, max_new_tokens=128, do_sample=False)
        out = specpass.generate(fast, ids, max_new_tokens=128)
        where = _divergence(out.sequences, reference, model, ids.shape[1])
        if where is None:
            exact += 1
            continue
        assert dtype == torch.bfloat16, f"float32 output diverged from greedy at {where}"
        assert where[1] is not None and where[1] <= BF16_TIE_ULPS * where[2], f"not a near-tie: {where}"
        ties.append(where)
    print(f"{dtype} {lowering}: {exact}/{len(cases)} identical, near-tie divergences (position, top-2 gap, ulp): {ties}")


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_ort_cuda_ep_with_iobinding_equals_hf_greedy(tmp_path, cuda_graphs):
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA EP here (install onnxruntime-gpu)")
    from specpass.backends.onnx.export import export

    model = tiny_model("llama")
    export(model, specpass.Pipeline(specpass.rewrites.TreeAttention(16)), str(tmp_path), progress=False)
    program = specpass.load_onnx(str(tmp_path), device="cuda", cache_size=300, cuda_graphs=cuda_graphs)
    assert program.keys.device.type == "cuda"  # the KV cache lives on the GPU, bound with IOBinding
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(seed))
        out = specpass.generate(program, ids.cuda(), max_new_tokens=40, eos_token_id=[])
        reference = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
        assert torch.equal(out.sequences.cpu(), reference)


def test_trainer_on_cuda_lowers_the_loss_and_saves_heads_the_cpu_loads(tmp_path):
    """`train-heads --device cuda`: the corpus is generated and the heads train on the GPU; the saved
    heads load on the CPU and draft for the same (CPU) model."""
    from specpass.heads import load_heads
    from specpass.research.heads_training import TrainConfig, generate_corpus, train_heads

    model = peaked_tiny_model()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (1, 6), generator=gen) for _ in range(28)]
    corpus = generate_corpus(model.cuda(), prompts, max_new_tokens=24, progress=False)
    assert all(seq.hidden.device.type == "cpu" and len(seq.tokens) > 6 for seq in corpus)
    config = TrainConfig(design="hydra", num_heads=3, prompts=24, epochs=6, batch_size=16, lr=3e-3, held_out=4)
    heads, _, losses = train_heads(model, corpus[:24], corpus[24:], config, out_dir=str(tmp_path), progress=False)
    assert next(heads.parameters()).device.type == "cuda"
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5
    loaded, _ = load_heads(str(tmp_path), model.cpu().lm_head)
    h = torch.randn(2, model.config.hidden_size)
    tokens = torch.randint(0, 96, (2, 3))
    with torch.no_grad():
        expected = heads.cpu()(h, model.model.embed_tokens(tokens))
        got = loaded(h, model.model.embed_tokens(tokens))
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)  # float16 on disk


def test_feature_trainer_on_cuda_lowers_the_loss_and_saves_a_draft_the_cpu_loads(tmp_path):
    """`train-heads --kind feature --device cuda`: the corpus, the teacher and the training-time test run on
    the GPU; the saved draft loads on the CPU and drafts there as well as it did on the GPU (its
    held-out accuracy table within float16's rounding of the one measured on the GPU)."""
    from specpass.research.feature_training import measure_chain_accuracy
    from specpass.heads.io import load_feature_draft

    model = peaked_four_layer_llama().cuda()
    _, held_out, _, draft, result, losses = train_tiny_feature_draft(model, str(tmp_path))
    assert draft.draft_vocab.device.type == "cuda"
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    cpu_model = model.cpu()
    loaded = load_feature_draft(str(tmp_path), cpu_model.lm_head).float()
    again = measure_chain_accuracy(cpu_model, loaded, held_out, 3, 4)
    assert all(abs(a - b) < 0.05 for x, y in zip(again, result.accuracy) for a, b in zip(x, y))


@pytest.fixture(scope="module")
def feature_draft_on_cuda(tmp_path_factory):
    """A 4-layer tiny Llama on the GPU and a feature draft trained for it (on the CPU: quick)."""
    model = peaked_four_layer_llama()
    directory = str(tmp_path_factory.mktemp("feature_draft"))
    corpus, *_ = train_tiny_feature_draft(model, directory)
    return model.cuda(), directory, corpus


@torch.no_grad()
def test_feature_draft_graph_replayed_in_buckets_equals_the_eager_graph(feature_draft_on_cuda):
    """The draft graph in CUDA graphs (backends.lowering.draft_buckets): calls of other sizes in one bucket
    and in others, each equal to the eager graph's; a bucket's second call gets its own inputs' answer."""
    from specpass.backends.lowering.draft_buckets import CudaGraphDraft
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, directory, _ = feature_draft_on_cuda
    pipeline = specpass.Pipeline(TreeAttention(16), FeatureDraft(directory))
    program = specpass.compile_program(model, {"pipeline": pipeline, "lowering": "cudagraphs", "cache_size": 96})
    replayed = program.draft.run.__self__
    assert isinstance(replayed, CudaGraphDraft)
    config = program.draft.config
    gen = torch.Generator().manual_seed(0)
    for n, t, s in ((3, 3, 5), (3, 4, 7), (1, 1, 0), (2, 5, 40), (3, 3, 6)):  # the first, second and last: one bucket
        mask = torch.ones(n, t, s + t, dtype=torch.bool)
        mask[..., s:] = torch.ones(t, t, dtype=torch.bool).tril()
        mask[0, :, : s // 2] = False  # a row with a shorter cache
        inputs = dict(tokens=torch.randint(0, 96, (n, t), generator=gen), states=torch.randn(n, t, 32, generator=gen),
                      positions=s + torch.arange(t).expand(n, t),
                      past_keys=torch.randn(n, config.num_kv_heads, s, config.head_dim, generator=gen),
                      past_values=torch.randn(n, config.num_kv_heads, s, config.head_dim, generator=gen), mask=mask,
                      depth=torch.randint(0, 3, (n, t), generator=gen),
                      previous=torch.randint(-1, 96, (n, t, 2), generator=gen))  # fmt: skip
        inputs = {name: value.cuda() for name, value in inputs.items()}
        for name, a, b in zip(program.draft.spec.output_names, program.draft(**inputs), replayed.eager.run_graph(inputs)):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert len(replayed.graphs) == 3


@pytest.mark.parametrize("lowering", ["cudagraphs", "inductor"])
@torch.no_grad()
def test_feature_drafting_with_replayed_draft_graphs_equals_hf_greedy(feature_draft_on_cuda, lowering):
    """The feature draft alone and combined, its draft graph replayed, one row and three at once."""
    from specpass.drafters import Combined, Feature, PromptLookup, TokenRecycling
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, directory, corpus = feature_draft_on_cuda
    pipeline = specpass.Pipeline(TreeAttention(16), FeatureDraft(directory))
    rows = [corpus[0].tokens[: corpus[0].start + 1][None], torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(5)),
            torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(11))]  # fmt: skip
    rows = [row.cuda() for row in rows]
    references = [model.generate(row, max_new_tokens=24, do_sample=False, eos_token_id=None) for row in rows]
    for drafter in (Feature(), Combined(Feature(), PromptLookup(), TokenRecycling())):
        options = {"pipeline": pipeline, "drafter": drafter, "cache_size": 96, "budget": 12, "lowering": lowering}
        program = specpass.compile_program(model, options)
        taus = []
        for row, reference in zip(rows, references):
            out = specpass.generate(program, row, max_new_tokens=24, eos_token_id=[])
            assert torch.equal(out.sequences, reference)
            taus.append(out.stats.tau)
        assert program.draft.run.__self__.graphs and taus[0] > 1.5, taus
    batch_program = specpass.compile_program(model, {**options, "drafter": Feature()}, rows=3)
    ids, mask = padded([row.cpu() for row in rows])
    batch = specpass.generate(batch_program, ids.cuda(), 24, attention_mask=mask.cuda(), eos_token_id=[])
    for row, new, reference in zip(rows, batch.new_tokens, references):
        assert list(new) == reference[0, row.shape[1] :].tolist()


@torch.no_grad()
def test_kv_eviction_with_cuda_graphs_equals_one_token_steps():
    """The eviction ops inside replayed graphs (queries recorded in the step) and the eviction graphs
    after each commit: speculative greedy equals the same policy one token a step, budget held."""
    model = tiny_model("llama").cuda()
    policy = specpass.rewrites.H2O(48, 12)  # chunk 12: queries stored for replays padded to 16
    pipeline = specpass.Pipeline(specpass.rewrites.TreeAttention(16), policy)
    ids = torch.randint(3, 96, (1, 70), generator=torch.Generator().manual_seed(1)).cuda()
    one = specpass.generate(model, ids, 40, eos_token_id=[], options={"pipeline": pipeline, "budget": 1,
                                                                       "lowering": "eager"})  # fmt: skip
    program = specpass.compile_program(model, {"pipeline": pipeline, "lowering": "cudagraphs"})
    spec = specpass.generate(program, ids, 40, eos_token_id=[])
    assert torch.equal(spec.sequences, one.sequences)
    assert program.step.graph_module.k_cache.shape[3] == 48


@pytest.mark.parametrize("lowering", ["cudagraphs", "inductor"])
@torch.no_grad()
def test_batched_rows_in_cuda_graphs_equal_eager_rows(lowering):
    """A batch replayed in CUDA graphs bucketed by rows: rows finish at different steps (one at an EOS,
    the others at the length limit), the graphs follow the live rows down, and every row's tokens are
    the eager lowering's."""
    from specpass.backends.runtime.decode import generate as decode
    from specpass.drafters import PromptLookup

    model = peaked_tiny_model().cuda()
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11, 8)]
    prompts[1] = prompts[1] * 3  # a repetitive row: prompt lookup matches, multi-token steps

    def run(lowering: str, eos: list[int]):
        options = {"lowering": lowering, "drafter": PromptLookup(), "budget": 8}
        program = specpass.compile_program(model, options, rows=3)
        return program, decode(program, prompts, max_new_tokens=40, eos_token_ids=eos)

    _, free = run("eager", [])
    eos = next(t for t in free.new_tokens[0][5:] if t not in free.new_tokens[1] and t not in free.new_tokens[2])
    _, expected = run("eager", [eos])
    program, got = run(lowering, [eos])
    assert [s.finish_reason for s in expected.stats] == ["eos", "length", "length"]
    assert got.new_tokens == expected.new_tokens
    assert program.step.run.lowering == lowering
    replayed = {rows for rows, _, _ in program.step.run.graphs}
    assert {3, 2} <= replayed <= {3, 2, 1}  # the row buckets follow the live rows down
    if lowering == "inductor":
        assert 1 not in replayed  # its smallest row bucket is two: no one-row specialisation to compile


@torch.no_grad()
def test_batched_greedy_with_cuda_graphs_equals_hf_greedy_alone():
    """Float32, the real model, 4 rows (code and chat, different prompt lengths, rows ending at EOS at
    different steps): each row equals HF greedy of that prompt alone."""
    model, tokenizer = specpass.load_default_model(device="cuda")
    cases = [prompts.encode_code(tokenizer, p) for p in prompts.code_prompts(2)]
    cases += [prompts.encode_chat(tokenizer, m) for m in prompts.chat_messages(2)]
    width = max(c.shape[1] for c in cases)
    ids = torch.full((len(cases), width), tokenizer.eos_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, c in enumerate(cases):
        ids[b, width - c.shape[1] :], mask[b, width - c.shape[1] :] = c[0], 1
    out = specpass.generate(model, ids.cuda(), 128, attention_mask=mask.cuda(), options={"lowering": "cudagraphs"})
    for b, c in enumerate(cases):
        reference = model.generate(c.cuda(), max_new_tokens=128, do_sample=False)[0, c.shape[1] :].tolist()
        assert list(out.new_tokens[b]) == reference, f"row {b} differs from HF greedy alone"
    print("finish reasons:", [s.finish_reason for s in out.stats], "tau:", [round(s.tau, 2) for s in out.stats])
