"""The feature draft (heads.feature_draft) and its training-time test (research.feature_training)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (check_drafting_equals_hf_greedy, check_sampling_equals_one_node_sampling, peaked_four_layer_llama,
                      random_draft, train_tiny_feature_draft)

from specpass.common.errors import DamagedFileError, InvalidParameterError
from specpass.heads.feature_draft import FeatureDraftConfig, FeatureDraftLayer, chain_mask, default_feature_layers
from specpass.heads.io import HeadsMismatchError, load_feature_draft, save_feature_draft


def _config(**changes) -> FeatureDraftConfig:
    values = dict(hidden_size=16, vocab_size=40, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=24,
                  feature_layers=(1, 2, 3), draft_vocab=12, rope_theta=10000.0, rms_eps=1e-6, model="m")  # fmt: skip
    return FeatureDraftConfig(**(values | changes))


def _draft(seed: int = 0) -> FeatureDraftLayer:
    return random_draft(FeatureDraftLayer(_config()), seed=seed)


def test_chain_mask_is_the_definition():
    length = 7
    for step in range(4):
        mask = chain_mask(length, step)
        assert mask.shape == (length, (step + 1) * length)
        for s in range(step, length):
            seen = {(i, p) for i in range(step + 1) for p in range(length) if mask[s, i * length + p]}
            expected = {(0, p) for p in range(s - step + 1)} | {(i, s - step + i) for i in range(1, step + 1)}
            assert seen == expected


@pytest.mark.parametrize("design", ["eagle3", "clover", "chimera"])
@torch.no_grad()
def test_training_chains_equal_drafting_one_token_at_a_time(design):
    """Depth j at position s of forward_chains == decoding: one draft call over positions 0..s-j at depth 0
    (the target's states: fused for EAGLE-3, as they are for the others) filling the draft's cache, then j
    drafted tokens, each a one-token call at its depth seeing everything so far, each token with the
    embeddings of the two before it (zeros before the first)."""
    from specpass.heads.io import feature_draft_module

    designs = {"eagle3": {}, "clover": dict(feature_layers=(), design="clover"),
               "chimera": dict(feature_layers=(), design="chimera", parallel_heads=4)}  # fmt: skip
    config = _config(**designs[design])
    draft = random_draft(feature_draft_module(config))
    b, t, steps = 2, 9, 4
    sequence = torch.randn(b, t + 1, 16)  # embeddings of x[0..T]
    embeds = sequence[:, 1:]  # [B, T, H]: e(x[s+1])
    previous = torch.stack((F.pad(sequence, (0, 0, 1, 0))[:, :t], sequence[:, :t]), 2)  # [B, T, 2, H]
    features = torch.randn(b, t, 3 * 16 if design == "eagle3" else 16)
    roots = draft.fuse(features) if design == "eagle3" else features  # [B, T, H]
    chains = draft.forward_chains(features, embeds, previous, steps)
    kv, d = config.num_kv_heads, config.head_dim
    for s in range(t):
        for j in range(min(steps, s + 1)):
            start = s - j
            causal = torch.ones(start + 1, start + 1, dtype=torch.bool).tril()[None].expand(b, -1, -1)
            empty = torch.zeros(b, kv, 0, d)
            state, logits, keys, values = draft.draft_step(embeds[:, : start + 1], roots[:, : start + 1],
                                                           torch.arange(start + 1).expand(b, -1), empty, empty,
                                                           causal, torch.zeros(b, start + 1, dtype=torch.long),
                                                           previous[:, : start + 1])  # fmt: skip
            state, logits = state[:, -1:], logits[:, -1:]
            for i in range(1, j + 1):  # drafted token i sits at position start + i
                see = torch.ones(b, 1, keys.shape[2] + 1, dtype=torch.bool)
                state, logits, keys, values = draft.draft_step(embeds[:, start + i : start + i + 1], state,
                                                               torch.full((b, 1), start + i), keys, values, see,
                                                               torch.full((b, 1), i),
                                                               previous[:, start + i : start + i + 1])  # fmt: skip
            torch.testing.assert_close(draft.logits(chains[j][:, s]), logits[:, 0], rtol=1e-5, atol=1e-5)


def test_config_refuses_bad_values():
    with pytest.raises(InvalidParameterError, match="three distinct"):
        _config(feature_layers=(1, 1, 2))
    with pytest.raises(InvalidParameterError, match="multiple of num_kv_heads"):
        _config(num_kv_heads=3)
    with pytest.raises(InvalidParameterError, match="exceeds the vocabulary"):
        _config(draft_vocab=41)
    assert default_feature_layers(30) == (2, 15, 27) and default_feature_layers(3) == (0, 1, 2)
    with pytest.raises(InvalidParameterError, match="three layers"):
        default_feature_layers(2)


def test_saved_draft_loads_for_its_model_only(tmp_path):
    from specpass.heads.io import model_fingerprint

    torch.manual_seed(0)
    lm_head, other = torch.nn.Linear(16, 40, bias=False), torch.nn.Linear(16, 40, bias=False)
    draft = _draft()
    draft.config = _config(model=model_fingerprint(lm_head))
    save_feature_draft(draft, draft.config, str(tmp_path), dtype=torch.float32)
    loaded = load_feature_draft(str(tmp_path), lm_head)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    with pytest.raises(HeadsMismatchError, match="trained for model"):
        load_feature_draft(str(tmp_path), other)
    (tmp_path / "feature_draft.json").write_text("[1]")
    with pytest.raises(DamagedFileError, match="specpass train-heads --kind feature"):
        load_feature_draft(str(tmp_path), lm_head)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A feature draft trained on a 4-layer peaked tiny Llama's continuations of 20 random prompts."""
    model = peaked_four_layer_llama()
    directory = tmp_path_factory.mktemp("trained_feature_draft")
    return model, *train_tiny_feature_draft(model, str(directory))


def test_training_teaches_the_chain_and_saves_a_draft_for_its_model(trained):
    """On a tiny random model nothing generalises, so the check is on the training sequences: the trained
    draft's chain agrees with the model's greedy token more than the untrained one at every depth; the
    saved draft loads with the same accuracy table, and the features and final states caught while
    generating equal batched forwards' (what a corpus cached as tokens trains on)."""
    from specpass.research.feature_training import make_feature_draft, measure_chain_accuracy, with_features
    from specpass.research.heads_training import Continuation

    model, corpus, held_out, directory, draft, result, losses = trained
    recomputed = with_features(model, [Continuation(c.tokens, c.start) for c in corpus[:3]], result.feature_layers)
    for caught, forward in zip(corpus, recomputed):
        torch.testing.assert_close(caught.layer_states, forward.layer_states, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caught.hidden, forward.hidden, rtol=1e-4, atol=1e-4)  # the teacher's states too
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    untrained = make_feature_draft(model, result, [c.tokens for c in corpus]).eval()
    trained_on = measure_chain_accuracy(model, draft, corpus, 3, 1)
    before = measure_chain_accuracy(model, untrained, corpus, 3, 1)
    assert all(a[0] > b[0] + 0.1 for a, b in zip(trained_on, before)), (trained_on, before)
    assert len(result.accuracy) == 3 and all(len(row) == 4 for row in result.accuracy)
    loaded = load_feature_draft(directory, model.lm_head)
    assert loaded.config == result
    again = measure_chain_accuracy(model, loaded.float(), held_out, 3, 4)
    assert all(abs(a - b) < 0.05 for x, y in zip(again, result.accuracy) for a, b in zip(x, y))  # float16 weights


def test_training_resumes_from_a_saved_draft(trained):
    """A saved draft trained further starts where it ended (its first losses near the first run's last,
    far below that run's first), keeps its vocabulary and feature layers, and gains a new table."""
    from specpass.research.feature_training import FeatureTrainConfig, train_feature_draft

    model, corpus, held_out, directory, _, result, losses = trained
    start = load_feature_draft(directory, model.lm_head)
    config = FeatureTrainConfig(epochs=2, sequences=4, steps=3, lr=1e-3, draft_vocab=96, ranks=4)
    draft, resumed, more = train_feature_draft(model, corpus, held_out, config, progress=False, start=start)
    assert more[0] < 0.5 * losses[0] and more[0] < 2 * max(losses[-5:]), (more[:3], losses[:3], losses[-5:])
    assert torch.equal(draft.draft_vocab, start.draft_vocab)
    assert resumed.feature_layers == result.feature_layers and resumed.model == result.model
    assert len(resumed.accuracy) == 3


def test_feature_drafting_equals_hf_greedy_alone_combined_and_in_a_batch(trained):
    """Greedy with the trained draft, alone and in the combined tree, equals HF greedy token for token
    on prompts it was trained on (where it drafts well: tau > 1.5) and on unseen ones; a batch of rows
    of different lengths equals each row alone."""
    import specpass
    from specpass.drafters import Combined, Feature, PromptLookup, TokenRecycling
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, corpus, _, directory, *_ = trained
    combined = Combined(Feature(top_k=4, beam=4, depth=4), PromptLookup(), TokenRecycling())
    pipeline = specpass.Pipeline(TreeAttention(16), FeatureDraft(directory))
    check_drafting_equals_hf_greedy(model, corpus, pipeline, Feature(), combined)


def test_cli_refuses_options_of_other_kinds(capsys):
    """Refused before any model loads: one line naming the option, exit 2."""
    from specpass.cli import main

    for args, message in ((("--kind", "feature", "--heads", "3"), "--heads is for draft heads"),
                          (("--kind", "hydra", "--chain-steps", "3"), "--chain-steps and --resume are for"),
                          (("--kind", "hydra", "--sequences", "32"), "--sequences is for --kind feature"),
                          (("--kind", "medusa", "--resume", "unused"), "--chain-steps and --resume are for"),
                          (("--kind", "feature", "--sequences", "0"), "sequences must be a positive int"),
                          (("--kind", "feature", "--chain-steps", "0"), "steps must be a positive int"),
                          (("--kind", "chimera", "--layer", "3"), "--layer is for --kind exit-adapter or hidden-transfer"),
                          (("--kind", "hidden-transfer", "--chain-steps", "3"), "--chain-steps and --resume are for"),
                          (("--kind", "hidden-transfer", "--blocks", "2"), "--blocks and --inner-size are for"),
                          (("--kind", "hidden-transfer", "--draft-vocab", "100"), "through the model's own LM head"),
                          (("--kind", "hidden-transfer", "--heads", "0"), "pseudo_tokens must be a positive int")):  # fmt: skip
        assert main(["train-heads", "--out", "unused", *args]) == 2
        assert message in capsys.readouterr().err
    # the feature draft's old name still works for one release, with a note: here it reaches the same refusal
    assert main(["train-heads", "--out", "unused", "--kind", "eagle", "--heads", "3"]) == 2
    err = capsys.readouterr().err
    assert "--kind eagle is now --kind feature" in err and "--heads is for draft heads" in err and "not --kind feature" in err


@pytest.fixture(scope="module")
def saved_draft(tmp_path_factory):
    """A 4-layer tiny Llama and a random-weight feature draft saved for it (float32)."""
    from specpass.heads.feature_draft import config_for
    from specpass.heads.io import model_fingerprint

    model = peaked_four_layer_llama()
    config = config_for(model, 48, model_fingerprint(model.lm_head))
    torch.manual_seed(1)
    layer = FeatureDraftLayer(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
        layer.draft_vocab.copy_(torch.randperm(96)[:48])
    directory = tmp_path_factory.mktemp("feature_draft")
    save_feature_draft(layer, config, str(directory), dtype=torch.float32)
    return model, str(directory), layer.eval()


def _step_inputs(t: int = 5):
    return dict(input_ids=torch.randint(0, 96, (1, t)), positions=torch.arange(t)[None], kv_len=t,
                tree_mask=torch.ones(t, t, dtype=torch.bool).tril()[None], cache_slots=torch.arange(t)[None])  # fmt: skip


@torch.no_grad()
def test_the_pass_adds_the_features_output_and_a_draft_graph_equal_to_the_module(saved_draft):
    """The verify step's outputs before the pass are bit for bit unchanged; its `features` output is the
    draft's fuse over HF's hidden_states at the three layers; the draft graph equals the module."""
    import specpass
    from specpass.ir import capture, verify
    from specpass.ir.draft import DRAFT_STATES, step_output
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, directory, layer = saved_draft
    base, _ = specpass.Pipeline(TreeAttention(8)).run(capture(model, cache_size=32))
    rewritten, report = specpass.Pipeline(TreeAttention(8), FeatureDraft(directory)).run(capture(model, cache_size=32))
    assert "added a draft graph: a feature draft layer over layers (1, 2, 3)" in str(report)
    verify(rewritten)
    inputs = _step_inputs()
    expected = [o.clone() for o in base(**inputs)]
    got = rewritten(**_step_inputs_like(inputs))
    assert len(got) == len(expected) + 1 and all(torch.equal(a, b) for a, b in zip(got, expected))  # bit for bit
    assert step_output(rewritten, DRAFT_STATES) is not None
    states = model(inputs["input_ids"], output_hidden_states=True).hidden_states
    by_hand = layer.fuse(torch.cat([states[i] for i in layer.config.feature_layers], -1))  # [1, T, H]
    torch.testing.assert_close(got[-1], by_hand, rtol=1e-5, atol=1e-5)
    draft = rewritten.draft
    assert draft.embed_tokens is model.model.embed_tokens  # shared, not copied
    n, t, s, kv, d = 3, 4, 6, layer.config.num_kv_heads, layer.config.head_dim
    args = (torch.randint(0, 96, (n, t)), torch.randn(n, t, 32), torch.arange(s, s + t).expand(n, t),
            torch.randn(n, kv, s, d), torch.randn(n, kv, s, d), torch.rand(n, t, s + t) < 0.7)  # fmt: skip
    args[5][..., s:] |= torch.eye(t, dtype=torch.bool)  # every query sees itself
    out, keys, values = layer.extend(model.model.embed_tokens(args[0]), *args[1:])
    graph_out = draft(*args, torch.randint(0, 3, (n, t)), torch.randint(-1, 96, (n, t, 2)))  # depth, previous: unread
    for a, b in zip(graph_out, (out, layer.logits(out), layer.draft_vocab, keys, values)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("n, t, s", [(3, 3, 5), (1, 7, 0), (2, 1, 9)])
@torch.no_grad()
def test_the_draft_graph_padded_to_its_bucket_equals_the_call(saved_draft, n, t, s):
    """What a GPU replays (backends.lowering.draft_buckets): the lowered draft graph on inputs padded to
    their bucket, its outputs cut back, equals the plain call, each row with its own prefix length."""
    import specpass
    from specpass.backends.lowering.draft_buckets import call_in_buckets
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, directory, layer = saved_draft
    program = specpass.compile_program(model, {"pipeline": specpass.Pipeline(TreeAttention(8), FeatureDraft(directory)),
                                               "cache_size": 32})  # fmt: skip
    kv, d = layer.config.num_kv_heads, layer.config.head_dim
    lengths = [s - r % 2 * (s // 2) for r in range(n)]  # rows with shorter caches, right-padded
    mask = torch.zeros(n, t, s + t, dtype=torch.bool)
    for r, length in enumerate(lengths):
        mask[r, :, :length] = True
    mask[..., s:] = torch.ones(t, t, dtype=torch.bool).tril()
    inputs = dict(tokens=torch.randint(0, 96, (n, t)), states=torch.randn(n, t, 32),
                  positions=torch.tensor(lengths)[:, None] + torch.arange(t), past_keys=torch.randn(n, kv, s, d),
                  past_values=torch.randn(n, kv, s, d), mask=mask, depth=torch.randint(0, 2, (n, t)),
                  previous=torch.randint(-1, 96, (n, t, 2)))  # fmt: skip
    plain = program.draft(**inputs)
    padded = call_in_buckets(program.draft.spec, inputs, lambda bucket, padded_inputs: program.draft.run(padded_inputs))
    for name, a, b in zip(program.draft.spec.output_names, padded, plain):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def _step_inputs_like(inputs: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def test_the_pass_is_refused_twice_on_another_model_and_where_its_layers_are_missing(saved_draft, tmp_path):
    import specpass
    from specpass.heads.feature_draft import config_for
    from specpass.heads.io import model_fingerprint
    from specpass.ir import capture
    from specpass.research.tiny_models import tiny_model
    from specpass.rewrites import FeatureDraft

    model, directory, layer = saved_draft
    gm, _ = specpass.Pipeline(FeatureDraft(directory)).run(capture(model, 32))
    assert "already has a draft graph" in FeatureDraft(directory).check(gm)
    other = capture(peaked_four_layer_llama(seed=7), 32)
    before = other.graph.python_code("self").src
    with pytest.raises(specpass.PassMismatchError, match="trained for model"):
        specpass.Pipeline(FeatureDraft(directory)).run(other)
    assert other.graph.python_code("self").src == before and not hasattr(other, "draft")
    two_layers = tiny_model("llama")  # hidden and vocabulary fit, but it has no layer 2 or 3
    config = config_for(model, 48, model_fingerprint(two_layers.lm_head))
    save_feature_draft(FeatureDraftLayer(config), config, str(tmp_path / "deep"), dtype=torch.float32)
    assert "taps layers 1 .. 1" in FeatureDraft(str(tmp_path / "deep")).check(capture(two_layers, 32))
    assert "no feature draft" in FeatureDraft(str(tmp_path / "none")).check(capture(model, 32))
    with pytest.raises(InvalidParameterError, match="FeatureDraft.draft"):
        FeatureDraft("")


def test_the_export_carries_the_features_and_the_draft_cache_and_ort_equals_hf_greedy(trained, tmp_path):
    """model.onnx gains the declared output, draft.onnx takes and returns the draft's cache with rows, T
    and S dynamic (checked against PyTorch at other sizes than traced); on ORT the feature drafter's
    greedy equals HF greedy alone and in a batch of rows of different lengths, drafting as in PyTorch."""
    import json

    import specpass
    from conftest import padded
    from specpass.backends.onnx.export import export
    from specpass.drafters import Feature
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, corpus, _, directory, *_ = trained
    pipeline = specpass.Pipeline(TreeAttention(16), FeatureDraft(directory))
    out = str(tmp_path / "export")
    export(model, pipeline, out, progress=False)
    manifest = json.load(open(f"{out}/manifest.json"))
    assert [o["name"] for o in manifest["outputs"]][-1] == "draft_states"
    assert manifest["check"]["max_abs_diff"]["draft_states"] < 1e-4
    assert manifest["draft"]["check_max_abs_diff"] < 1e-4
    draft_inputs = {t["name"]: t["shape"] for t in manifest["draft"]["spec"]["inputs"]}
    assert draft_inputs["past_keys"][2] == "S" and draft_inputs["mask"] == ["N", "T", "S+T"]
    prompts = [c.tokens[: c.start + 1][None] for c in corpus[:2]]
    prompts.append(torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(11)))
    program = specpass.load_onnx(out, drafter=Feature(), cache_size=96, budget=12, rows=3)
    eager = specpass.compile_program(model, {"pipeline": pipeline, "drafter": Feature(), "cache_size": 96, "budget": 12})
    for ids in prompts:
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                   eos_token_id=None)  # fmt: skip
        on_ort = specpass.generate(program, ids, 24, eos_token_id=[])
        assert torch.equal(on_ort.sequences, reference)
        assert on_ort.stats.tau == pytest.approx(specpass.generate(eager, ids, 24, eos_token_id=[]).stats.tau)
    ids, mask = padded(prompts)
    batch = specpass.generate(program, ids, 20, attention_mask=mask, eos_token_id=[])
    for row, new in zip(prompts, batch.new_tokens):
        alone = model.generate(row, max_new_tokens=20, do_sample=False, eos_token_id=None)
        assert list(new) == alone[0, row.shape[1] :].tolist()


@pytest.mark.parametrize("lowering", ["eager", "onednn", "inductor"])
def test_every_cpu_lowering_returns_the_features(trained, lowering):
    """The declared output reaches the drafters through each lowering: the same tokens and taus as eager."""
    import specpass
    from specpass.drafters import Feature
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, corpus, _, directory, *_ = trained
    ids = corpus[0].tokens[: corpus[0].start + 1][None]
    options = {"pipeline": specpass.Pipeline(TreeAttention(8), FeatureDraft(directory)), "drafter": Feature(),
               "cache_size": 64, "budget": 8, "lowering": lowering}  # fmt: skip
    out = specpass.generate(model, ids, max_new_tokens=16, eos_token_id=[], options=options)
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                               eos_token_id=None)  # fmt: skip
    assert torch.equal(out.sequences, reference) and out.stats.tau > 1.5


def test_feature_sampling_equals_one_node_sampling_with_the_same_seed(trained):
    """Sample-and-match over the feature draft's tree: the same tokens as sampling one token a step."""
    import specpass
    from specpass.drafters import Feature
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, corpus, _, directory, *_ = trained
    pipeline = specpass.Pipeline(TreeAttention(16), FeatureDraft(directory))
    check_sampling_equals_one_node_sampling(model, corpus, pipeline, Feature())


def _session_parts(trained, prompt_length: int):
    """The compiled program's draft graph and fuse, a sequence of the corpus and every position's fused
    features from one full forward of the target."""
    import specpass
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, corpus, _, directory, *_ = trained
    program = specpass.compile_program(model, {"pipeline": specpass.Pipeline(TreeAttention(8), FeatureDraft(directory)),
                                               "drafter": specpass.drafters.Feature(), "cache_size": 64})  # fmt: skip
    fuse = program.step.graph_module.get_submodule("feature_fuse")
    tokens = corpus[0].tokens[: prompt_length + 8]
    with torch.no_grad():
        states = model(tokens[None], output_hidden_states=True).hidden_states
        layers = program.draft.config.feature_layers
        features = fuse(torch.cat([states[i] for i in layers], -1))[0]  # [L, H]
    return program.draft, tokens.tolist(), features


def _target_forward(features: torch.Tensor, choices: list[int]):
    from specpass.drafters import TargetForward

    return TargetForward(torch.zeros(len(choices), 1, dtype=torch.long), features, torch.tensor(choices))


@torch.no_grad()
def test_the_draft_cache_after_a_step_equals_recomputing_it(trained):
    """A session's cache after a verify step's accepted path equals a session started on the longer prompt."""
    from specpass.drafters.feature import Feature, FeatureSession
    from specpass.drafters.tree import DraftTree

    draft, tokens, features = _session_parts(trained, 8)
    p = 8
    session = FeatureSession(Feature(), draft, tokens[:p], _target_forward(features[:p], [0] * (p - 1) + [tokens[p]]))
    tree = DraftTree.chain(tokens[p : p + 3])  # root x[P], then two accepted drafts
    verified = _target_forward(features[p : p + 3], [tokens[p + 1], tokens[p + 2], tokens[p + 3]])
    session.observe(tree, verified, [0, 1, 2], tokens[: p + 1])
    fresh = FeatureSession(Feature(), draft, tokens[: p + 3],
                           _target_forward(features[: p + 3], [0] * (p + 2) + [tokens[p + 3]]))  # fmt: skip
    assert session.root == fresh.root == tokens[p + 3]
    for a, b in ((session.keys, fresh.keys), (session.values, fresh.values), (session.state, fresh.state)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_dynamic_tree_is_the_brute_force_top_n(trained):
    """The best-first tree over the session's drafted table holds exactly the N - 1 drafted paths of
    highest path probability (EAGLE-2's reranking), at every size."""
    from specpass.drafters.feature import Feature, FeatureSession
    from specpass.drafters.heads import CandidateTable
    from specpass.drafters.best_first import build_tree

    draft, tokens, features = _session_parts(trained, 10)
    session = FeatureSession(Feature(top_k=4, beam=3, depth=4), draft, tokens[:10],
                             _target_forward(features[:10], [0] * 9 + [tokens[10]]))  # fmt: skip
    FeatureSession.draft_rows([session])
    table = session.table
    score = {(session.root,): 1.0}
    for path in sorted(table, key=len):  # parents before children
        for token, probability, *_ in table[path]:
            score[(*path, token)] = score[path] * probability
    drafted = sorted((p for p in score if len(p) > 1), key=lambda p: -score[p])
    for n in (2, 5, 9, 17, len(drafted) + 1):
        tree = build_tree(session.root, [CandidateTable(table, (session.root,), by_path=True)], n, max_depth=8)
        by_node = [(session.root,)]
        for token, parent in zip(tree.tokens[1:], tree.parents[1:]):
            by_node.append((*by_node[parent], token))
        assert set(by_node[1:]) == set(drafted[: n - 1])


class _CountedDraft:
    """A draft graph that counts its calls."""

    def __init__(self, draft):
        self.draft, self.spec, self.calls = draft, draft.spec, 0

    @property
    def config(self):
        return self.draft.config

    def __call__(self, *args):
        self.calls += 1
        return self.draft(*args)


@torch.no_grad()
def test_every_token_a_call_hands_the_draft_comes_with_the_two_before_it(trained):
    """`previous` in every draft call: for an appended token, the two committed tokens before it (-1
    before the first); for a drafted token, its path's two before it, the root and the committed token
    before the root included; after a verify step, the accepted tokens' own predecessors."""
    from specpass.drafters.feature import Feature, FeatureSession
    from specpass.drafters.tree import DraftTree

    draft, tokens, features = _session_parts(trained, 6)
    calls = []

    class _Recorded(_CountedDraft):
        def __call__(self, *args):
            calls.append((args[0].tolist(), args[-1].tolist()))  # tokens [N, T], previous [N, T, 2]
            return super().__call__(*args)

    session = FeatureSession(Feature(top_k=3, beam=2, depth=3), _Recorded(draft), tokens[:6],
                             _target_forward(features[:6], [0] * 5 + [tokens[6]]))  # fmt: skip
    sequence = [-1, -1, *tokens[:7]]  # the prompt and the root, two -1 before them
    FeatureSession.draft_rows([session])
    appended, previous = calls[0]
    assert appended[0] == sequence[3:9] and previous[0] == [sequence[i + 1 : i + 3] for i in range(6)]
    for drafted, before in calls[1:]:  # each expanded path's last token, its path's two before it
        paths = [path for path in session.table if len(path) > 1 and path[-1] in drafted[0]]
        for token, pair in zip(drafted[0], before[0]):
            assert pair in [list(((sequence[-2],) + p)[-3:-1]) for p in paths if p[-1] == token]
    calls.clear()
    session.observe(DraftTree.chain(tokens[6:8]), _target_forward(features[6:8], [tokens[7], tokens[8]]), [0, 1],
                    tokens[:7])  # fmt: skip
    FeatureSession.draft_rows([session])
    appended, previous = calls[0]
    assert appended[0] == tokens[7:9] and previous[0] == [tokens[5:7], tokens[6:8]]


@torch.no_grad()
def test_rows_drafted_at_once_equal_each_row_alone(trained):
    """Three rows of different lengths drafted together take one draft call per depth (plus one appending
    every row's pending tokens) and get the tables and caches each row gets alone, before and after a
    verify step."""
    from specpass.drafters.feature import Feature, FeatureSession
    from specpass.drafters.tree import DraftTree

    draft, tokens, features = _session_parts(trained, 12)
    config = Feature(top_k=4, beam=3, depth=4)
    lengths = (6, 9, 12)

    def sessions(graph):
        return [FeatureSession(config, graph, tokens[:p], _target_forward(features[:p], [0] * (p - 1) + [tokens[p]]))
                for p in lengths]  # fmt: skip

    counted = _CountedDraft(draft)
    together, alone = sessions(counted), sessions(draft)
    for step in range(2):
        FeatureSession.draft_rows(together)
        assert counted.calls == (step + 1) * config.depth
        for row, single in zip(together, alone):
            FeatureSession.draft_rows([single])
            assert row.table.keys() == single.table.keys()
            for path, candidates in row.table.items():
                assert [c[0] for c in candidates] == [c[0] for c in single.table[path]]
                torch.testing.assert_close([c[2][2] for c in candidates], [c[2][2] for c in single.table[path]],
                                           rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(row.keys, single.keys, rtol=1e-5, atol=1e-5)
        for row, single, p in zip(together, alone, lengths):  # the next two tokens accepted, then the bonus
            tree = DraftTree.chain(tokens[p : p + 2])
            verified = _target_forward(features[p : p + 2], [tokens[p + 1], tokens[p + 2]])
            for session in (row, single):
                session.observe(tree, verified, [0, 1], tokens[: p + 1])
        lengths = tuple(p + 2 for p in lengths)


def test_length_batches_take_each_sequence_once_and_pad_less_than_random_ones():
    from specpass.research.feature_training import length_batches

    lengths = torch.randint(10, 500, (203,), generator=torch.Generator().manual_seed(0))
    batches = length_batches(lengths, 8, torch.Generator().manual_seed(1))
    assert len(batches) == 26 and sorted(torch.cat(batches).tolist()) == list(range(203))

    def padding(parts):
        return sum(int(lengths[p].max()) * len(p) - int(lengths[p].sum()) for p in parts)

    random = torch.randperm(203, generator=torch.Generator().manual_seed(1)).split(8)
    assert padding(batches) < 0.25 * padding(random)
