"""Clover's draft (heads.clover) in the feature draft's interface: its module, the pass, drafting and training."""

from __future__ import annotations

import pytest
import torch
from conftest import (check_drafting_equals_hf_greedy, check_sampling_equals_one_node_sampling, peaked_four_layer_llama,
                      random_draft)

from specpass.common.errors import InvalidParameterError
from specpass.heads.clover import CloverDraft
from specpass.heads.feature_draft import FeatureDraftConfig


def _config(**changes) -> FeatureDraftConfig:
    values = dict(hidden_size=16, vocab_size=40, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=24,
                  feature_layers=(), draft_vocab=12, rope_theta=10000.0, rms_eps=1e-6, model="m", design="clover")  # fmt: skip
    return FeatureDraftConfig(**(values | changes))


def _draft(seed: int = 0) -> CloverDraft:
    return random_draft(CloverDraft(_config()), seed=seed)


def test_config_refuses_layers_and_an_unsplittable_width():
    with pytest.raises(InvalidParameterError, match="reads the final normed state"):
        _config(feature_layers=(1, 2, 3))
    with pytest.raises(InvalidParameterError, match="splits hidden_size"):
        _config(num_heads=3, num_kv_heads=1)
    with pytest.raises(InvalidParameterError, match="unknown feature draft design"):
        _config(design="medusa")


@torch.no_grad()
def test_the_fusion_cell_is_its_definition():
    """GatedFusion against loops: per attention head, gate = cos(q_h, k_h); out = x + v * gate."""
    draft = _draft()
    cell = draft.chain_fusion
    x, y = torch.randn(3, 16), torch.randn(3, 16)
    out = cell(x, y)
    q, k, v = cell.q_proj(cell.norm(x)), cell.k_proj(y), cell.v_proj(y)
    for i in range(3):
        for h in range(4):
            part = slice(4 * h, 4 * h + 4)
            gate = torch.dot(q[i, part], k[i, part]) / (q[i, part].norm() * k[i, part].norm())
            torch.testing.assert_close(out[i, part], x[i, part] + v[i, part] * gate)


@torch.no_grad()
def test_a_drafted_token_reads_no_cache_and_depth_picks_each_tokens_part():
    """A token at depth > 0 gets the same state and logits whatever its call's cache and mask (the
    Regressive Connection: no attention); in one call, each token takes the part its depth says (the
    training chains against decoding: tests/test_feature_draft.py)."""
    draft = _draft()
    embeds, states = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    positions, depth = torch.arange(3)[None], torch.tensor([[0, 2, 1]])
    outs = []
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        keys, values = torch.randn(1, 2, 4, 4, generator=gen), torch.randn(1, 2, 4, 4, generator=gen)
        mask = torch.rand(1, 3, 7, generator=gen) < 0.5
        mask[..., 4:] = torch.ones(3, 3, dtype=torch.bool).tril()
        outs.append(draft.draft_step(embeds, states, positions, keys, values, mask, depth))
    for a, b in zip(outs[0][:2], outs[1][:2]):
        assert torch.equal(a[:, 1:], b[:, 1:]) and not torch.equal(a[:, 0], b[:, 0])  # depth 0 reads the cache
    chained = draft.chain_fusion(states, embeds)
    torch.testing.assert_close(outs[0][0][:, 1:], chained[:, 1:])
    torch.testing.assert_close(outs[0][1][:, 1:], draft.logits(draft.chain_out(torch.cat((chained, embeds), -1)))[:, 1:])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Clover draft trained on a 4-layer peaked tiny Llama's continuations of 20 random prompts."""
    from specpass.research.feature_training import FeatureTrainConfig, train_feature_draft
    from specpass.research.heads_training import generate_corpus

    model = peaked_four_layer_llama()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (1, 6), generator=gen) for _ in range(24)]
    corpus = generate_corpus(model, prompts[:20], max_new_tokens=24, progress=False)
    held_out = generate_corpus(model, prompts[20:], max_new_tokens=24, progress=False)
    config = FeatureTrainConfig(epochs=40, sequences=4, steps=3, lr=3e-3, draft_vocab=96, ranks=4, design="clover")
    directory = str(tmp_path_factory.mktemp("clover"))
    draft, result, losses = train_feature_draft(model, corpus, held_out, config, out_dir=directory, progress=False)
    return model, corpus, held_out, directory, draft, result, losses


def test_training_teaches_every_depth_and_saves_a_draft_for_its_model_only(trained, tmp_path):
    """On a tiny random model nothing generalises, so the check is on the training sequences: the trained
    chain agrees with the model's greedy token more than the untrained one at every depth; the saved draft
    loads with its design for this model and is refused for another."""
    from specpass.heads.io import HeadsMismatchError, load_feature_draft
    from specpass.research.feature_training import make_feature_draft, measure_chain_accuracy
    from specpass.research.tiny_models import tiny_model

    model, corpus, _, directory, draft, result, losses = trained
    assert result.design == "clover" and result.feature_layers == ()
    assert sum(losses[-5:]) < 2 / 3 * sum(losses[:5])
    untrained = make_feature_draft(model, result, [c.tokens for c in corpus]).eval()
    trained_on = measure_chain_accuracy(model, draft, corpus, 3, 1)
    before = measure_chain_accuracy(model, untrained, corpus, 3, 1)
    assert all(a[0] > b[0] + 0.1 for a, b in zip(trained_on, before)), (trained_on, before)
    loaded = load_feature_draft(directory, model.lm_head)
    assert isinstance(loaded, CloverDraft) and loaded.config == result
    with pytest.raises(HeadsMismatchError):
        load_feature_draft(directory, tiny_model("llama").lm_head)


def test_clover_drafting_equals_hf_greedy_alone_combined_and_in_a_batch(trained):
    """The pass leaves the verify graph's outputs as they were (Clover reads the final normed states) and
    is refused a second time; greedy with the trained draft, alone and in the combined tree, equals HF
    greedy on prompts it was trained on (tau > 1.5 there) and unseen ones; a batch of rows equals each
    row alone."""
    import specpass
    from specpass.drafters import Combined, Feature, PromptLookup, TokenRecycling
    from specpass.ir import capture
    from specpass.ir.draft import STEP_OUTPUTS_META, draft_spec
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, corpus, _, directory, *_ = trained
    plain = capture(model, 32)
    gm, report = specpass.Pipeline(FeatureDraft(directory)).run(capture(model, 32))
    assert "a Clover draft" in str(report) and draft_spec(gm).config.design == "clover"
    outputs = [next(n for n in g.graph.nodes if n.op == "output").args[0] for g in (plain, gm)]
    assert len(outputs[0]) == len(outputs[1]) and "draft_states" not in gm.meta.get(STEP_OUTPUTS_META, {})
    assert "already has a draft graph" in FeatureDraft(directory).check(gm)
    combined = Combined(Feature(top_k=4, beam=4, depth=4), PromptLookup(), TokenRecycling())
    pipeline = specpass.Pipeline(TreeAttention(16), FeatureDraft(directory))
    check_drafting_equals_hf_greedy(model, corpus, pipeline, Feature(), combined)


def test_clover_sampling_equals_one_node_sampling_with_the_same_seed(trained):
    """Sample-and-match over Clover's tree: the same tokens as sampling one token a step."""
    import specpass
    from specpass.drafters import Feature
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, corpus, _, directory, *_ = trained
    pipeline = specpass.Pipeline(TreeAttention(16), FeatureDraft(directory))
    check_sampling_equals_one_node_sampling(model, corpus, pipeline, Feature(), min_tau=1.1)  # its tiny draft: 1.14


def test_the_export_runs_clover_on_ort_equal_to_hf_greedy(trained, tmp_path):
    """model.onnx keeps the step's outputs, draft.onnx holds Clover's draft (checked against PyTorch at
    other sizes than traced), and on ORT the drafter's greedy equals HF greedy."""
    import json

    import specpass
    from specpass.backends.onnx.export import export
    from specpass.drafters import Feature
    from specpass.rewrites import FeatureDraft, TreeAttention

    model, corpus, _, directory, *_ = trained
    out = str(tmp_path / "export")
    export(model, specpass.Pipeline(TreeAttention(16), FeatureDraft(directory)), out, progress=False)
    manifest = json.load(open(f"{out}/manifest.json"))
    assert "draft_states" not in [o["name"] for o in manifest["outputs"]]
    assert manifest["draft"]["check_max_abs_diff"] < 1e-4
    assert manifest["draft"]["spec"]["config"]["design"] == "clover"
    program = specpass.load_onnx(out, drafter=Feature(), cache_size=96, budget=12)
    for ids in (corpus[1].tokens[: corpus[1].start + 1][None], torch.randint(0, 96, (1, 9))):
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                   eos_token_id=None)  # fmt: skip
        assert torch.equal(specpass.generate(program, ids, 24, eos_token_id=[]).sequences, reference)
