"""The trained designs of the feature draft's interface besides EAGLE-3's (heads.clover, heads.chimera), each
trained on a tiny model: the trainer, the pass, drafting against HF greedy, seeded sampling and ONNX export.
Their modules' own tests: tests/test_clover.py, tests/test_chimera.py."""

from __future__ import annotations

import pytest
import torch
from conftest import check_drafting_equals_hf_greedy, check_sampling_equals_one_node_sampling, peaked_four_layer_llama

DESIGNS = {"clover": ("CloverDraft", "a Clover draft", 1.1), "chimera": ("ChimeraDraft", "a Chimera draft", 1.1)}
# the design -> its module's class, the pass's summary, the mean tau the sampling test asks (measured 1.14 / 1.2)


@pytest.fixture(scope="module", params=list(DESIGNS))
def trained(request, tmp_path_factory):
    """A draft of the design (3 chain steps; Chimera: 3 heads) trained on a 4-layer peaked tiny Llama's
    continuations of 20 random prompts, 4 held out."""
    from specpass.research.feature_training import FeatureTrainConfig, train_feature_draft
    from specpass.research.heads_training import generate_corpus

    design = request.param
    model = peaked_four_layer_llama()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (1, 6), generator=gen) for _ in range(24)]
    corpus = generate_corpus(model, prompts[:20], max_new_tokens=24, progress=False)
    held_out = generate_corpus(model, prompts[20:], max_new_tokens=24, progress=False)
    config = FeatureTrainConfig(epochs=40, sequences=4, steps=3, lr=3e-3, draft_vocab=96, ranks=4, design=design)
    directory = str(tmp_path_factory.mktemp(design))
    draft, result, losses = train_feature_draft(model, corpus, held_out, config, out_dir=directory, progress=False)
    return design, model, corpus, directory, draft, result, losses


def test_training_teaches_every_depth_and_saves_a_draft_for_its_model_only(trained):
    """On a tiny random model nothing generalises, so the check is on the training sequences: the trained
    chain agrees with the model's greedy token more than the untrained one at every depth; the saved draft
    loads with its design for this model and is refused for another."""
    from specpass.heads.io import HeadsMismatchError, load_feature_draft
    from specpass.research.feature_training import make_feature_draft, measure_chain_accuracy
    from specpass.research.tiny_models import tiny_model

    design, model, corpus, directory, draft, result, losses = trained
    assert result.design == design and result.feature_layers == ()
    assert result.parallel_heads == (3 if design == "chimera" else 0)
    assert sum(losses[-5:]) < 2 / 3 * sum(losses[:5])
    untrained = make_feature_draft(model, result, [c.tokens for c in corpus]).eval()
    trained_on = measure_chain_accuracy(model, draft, corpus, 3, 1)
    before = measure_chain_accuracy(model, untrained, corpus, 3, 1)
    assert all(a[0] > b[0] + 0.1 for a, b in zip(trained_on, before)), (trained_on, before)
    loaded = load_feature_draft(directory, model.lm_head)
    assert type(loaded).__name__ == DESIGNS[design][0] and loaded.config == result
    with pytest.raises(HeadsMismatchError):
        load_feature_draft(directory, tiny_model("llama").lm_head)


def test_drafting_equals_hf_greedy_alone_combined_and_in_a_batch(trained):
    """The pass leaves the verify graph's outputs as they were (the draft reads the final normed states)
    and is refused a second time; greedy with the trained draft, alone and in the combined tree, equals
    HF greedy on prompts it was trained on (tau > 1.5 there) and unseen ones; a batch of rows equals
    each row alone."""
    import specpass
    from specpass.drafters import Combined, Feature, PromptLookup, TokenRecycling
    from specpass.ir import capture
    from specpass.ir.draft import STEP_OUTPUTS_META, draft_spec
    from specpass.rewrites import FeatureDraft, TreeAttention

    design, model, corpus, directory, *_ = trained
    plain = capture(model, 32)
    gm, report = specpass.Pipeline(FeatureDraft(directory)).run(capture(model, 32))
    assert DESIGNS[design][1] in str(report) and draft_spec(gm).config.design == design
    outputs = [next(n for n in g.graph.nodes if n.op == "output").args[0] for g in (plain, gm)]
    assert len(outputs[0]) == len(outputs[1]) and "draft_states" not in gm.meta.get(STEP_OUTPUTS_META, {})
    assert "already has a draft graph" in FeatureDraft(directory).check(gm)
    combined = Combined(Feature(top_k=4, beam=4, depth=3), PromptLookup(), TokenRecycling())
    pipeline = specpass.Pipeline(TreeAttention(16), FeatureDraft(directory))
    check_drafting_equals_hf_greedy(model, corpus, pipeline, Feature(), combined)


def test_sampling_equals_one_node_sampling_with_the_same_seed(trained):
    """Sample-and-match over the draft's tree: the same tokens as sampling one token a step."""
    import specpass
    from specpass.drafters import Feature
    from specpass.rewrites import FeatureDraft, TreeAttention

    design, model, corpus, directory, *_ = trained
    pipeline = specpass.Pipeline(TreeAttention(16), FeatureDraft(directory))
    check_sampling_equals_one_node_sampling(model, corpus, pipeline, Feature(), min_tau=DESIGNS[design][2])


def test_the_export_runs_the_draft_on_ort_equal_to_hf_greedy(trained, tmp_path):
    """model.onnx keeps the step's outputs, draft.onnx holds the draft (checked against PyTorch at other
    sizes than traced), and on ORT the drafter's greedy equals HF greedy."""
    import json

    import specpass
    from specpass.backends.onnx.export import export
    from specpass.drafters import Feature
    from specpass.rewrites import FeatureDraft, TreeAttention

    design, model, corpus, directory, *_ = trained
    out = str(tmp_path / "export")
    export(model, specpass.Pipeline(TreeAttention(16), FeatureDraft(directory)), out, progress=False)
    manifest = json.load(open(f"{out}/manifest.json"))
    assert "draft_states" not in [o["name"] for o in manifest["outputs"]]
    assert manifest["draft"]["check_max_abs_diff"] < 1e-4
    assert manifest["draft"]["spec"]["config"]["design"] == design
    program = specpass.load_onnx(out, drafter=Feature(), cache_size=96, budget=12)
    for ids in (corpus[1].tokens[: corpus[1].start + 1][None], torch.randint(0, 96, (1, 9))):
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                   eos_token_id=None)  # fmt: skip
        assert torch.equal(specpass.generate(program, ids, 24, eos_token_id=[]).sequences, reference)
