"""LayerSkip: the step with layers left out as a draft, verified from the first layer left out."""

import pytest
import torch
import transformers
from conftest import RowCounter, check_default_model_greedy, draft_then_resume, self_draft_taus_equal_to_hf_greedy

import specpass
from specpass.drafters import SelfDraft
from specpass.backends.onnx.export import export
from specpass.common.errors import ExportError, GraphVerificationError, InvalidParameterError, PassMismatchError
from specpass.ir import capture, draft_spec
from specpass.ir.draft import draft_graph
from specpass.rewrites import EarlyExit, LayerSkip, TreeAttention
from specpass.research.tiny_models import TINY, TINY_CONFIGS


def _deep_tiny(arch: str = "llama", layers: int = 4, seed: int = 0, peaked: bool = False):
    """A tiny model with `layers` layers (the shared tiny models have 2: nothing to skip between)."""
    model_class, config_class, extra = TINY_CONFIGS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**(TINY | {"num_hidden_layers": layers}), **extra)
    model = getattr(transformers, model_class)(config).eval()
    if peaked:
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # a peaked next-token law, so drafts get accepted
    return model


class _Identity(torch.nn.Module):
    """A decoder layer left out: its output is its input."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("skip", [(2,), (1, 3), (2, 3)])
def test_draft_is_the_model_without_those_layers_and_resume_equals_the_verify_step(arch, skip):
    model = _deep_tiny(arch)
    gm, _ = specpass.Pipeline(TreeAttention(16), LayerSkip(skip)).run(capture(model, cache_size=64))
    first = skip[0]
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    draft_logits, exit_hidden, (k_drafted, v_drafted), (k_cache, v_cache) = draft_then_resume(gm, ids)
    assert torch.equal(k_drafted[:first], k_cache[:first]) and torch.equal(v_drafted[:first], v_cache[:first])
    assert all(k_drafted[layer].abs().sum() == 0 for layer in skip)  # a skipped layer writes nothing
    by_hand = model(ids, output_hidden_states=True).hidden_states[first]  # after layer first - 1, by HF
    torch.testing.assert_close(exit_hidden, by_hand, rtol=0, atol=1e-5)
    for layer in skip:
        model.model.layers[layer] = _Identity()
    torch.testing.assert_close(draft_logits, model(ids).logits, rtol=0, atol=1e-5)  # HF without those layers


def test_the_pass_leaves_the_verify_graph_alone_reports_its_draft_and_round_trips_as_json():
    model = _deep_tiny(layers=6)
    before, _ = specpass.Pipeline(TreeAttention(16)).run(capture(model, cache_size=64))
    pipeline = specpass.Pipeline(TreeAttention(16), LayerSkip([5, 2, 3, 3]))
    after, report = pipeline.run(capture(model, cache_size=64))
    assert after.graph.python_code("self").src == before.graph.python_code("self").src
    spec = draft_spec(after)
    assert spec.kind == "early-exit" and spec.shares_cache and spec.config.layer == 2 and spec.source == "LayerSkip"
    assert "without layers 2-3, 5 (3 of 6 layers)" in str(report) and "verified from layer 2" in str(report)
    assert LayerSkip([5, 2, 3, 3]).skip == (2, 3, 5) and LayerSkip.span(2, 3) == LayerSkip((2, 3, 4))
    assert specpass.Pipeline.from_json(pipeline.to_json()) == pipeline


def test_the_pass_refuses_where_it_must_not_apply(tmp_path):
    model = _deep_tiny()
    tree, _ = specpass.Pipeline(TreeAttention(16)).run(capture(model, cache_size=64))
    source = tree.graph.python_code("self").src
    for skip, reason in [((), "the skip set is empty"), ((0, 2), "names layer 0"),
                         ((2, 4), "names layer 4 but the model has 4 layers")]:  # fmt: skip
        assert reason in LayerSkip(skip).check(tree)
        with pytest.raises(PassMismatchError, match=reason):
            specpass.Pipeline(TreeAttention(16), LayerSkip(skip)).run(capture(model, cache_size=64))
    with_skip, _ = specpass.Pipeline(TreeAttention(16), LayerSkip((2,))).run(capture(model, cache_size=64))
    assert "already has a draft graph (LayerSkip applied twice" in LayerSkip((2,)).check(with_skip)
    assert "already has a draft graph" in EarlyExit(1).check(with_skip)  # one draft graph per step
    with pytest.raises(ExportError, match="cannot express pass LayerSkip"):  # a draft sharing the cache, resumed
        export(model, specpass.Pipeline(TreeAttention(16), LayerSkip((2,))), str(tmp_path / "out"), progress=False)
    for bad in ("12", (1.5,), (-1,), (True,), 3):
        with pytest.raises(InvalidParameterError, match="LayerSkip.skip must be layer indices"):
            LayerSkip(bad)
    assert tree.graph.python_code("self").src == source and draft_graph(tree) is None


def test_verify_catches_a_stale_layer_skip():
    gm, _ = specpass.Pipeline(TreeAttention(16), LayerSkip((2, 3))).run(capture(_deep_tiny(), cache_size=64))
    LayerSkip((2, 3)).verify(gm)
    with pytest.raises(GraphVerificationError, match=r"draft graph runs a layer of \(1,\)"):
        LayerSkip((1,)).verify(gm)  # the graphs were cut for (2, 3): the draft runs layer 1
    with pytest.raises(GraphVerificationError, match="resume graph runs a layer < 3"):
        LayerSkip((3,)).verify(gm)  # ... and the resume graph runs layer 2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layer_skip_self_draft_greedy_equals_hf_greedy(arch):
    model = _deep_tiny(arch, seed=2, peaked=True)
    options = {"pipeline": specpass.Pipeline(TreeAttention(16), LayerSkip((2,))), "drafter": SelfDraft(4),
               "cache_size": 128, "budget": 5}  # fmt: skip
    assert max(self_draft_taus_equal_to_hf_greedy(model, options)) > 1.5


def test_layers_below_the_first_skipped_run_once_per_drafted_token(counted_linears):
    model = _deep_tiny(seed=2, peaked=True)
    program = specpass.compile_program(model, specpass.CompileOptions(
        pipeline=specpass.Pipeline(TreeAttention(16), LayerSkip((2,))), drafter=SelfDraft(4), cache_size=128,
        lowering="eager", budget=5))  # fmt: skip
    rows = [RowCounter(layer.self_attn.q_proj) for layer in model.model.layers]
    draft_calls = 0
    run = program.draft.run

    def counted(*args):
        nonlocal draft_calls
        draft_calls += 1
        return run(*args)

    object.__setattr__(program.draft, "run", counted)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0)).repeat(1, 2)
    out = specpass.generate(program, ids, max_new_tokens=40, eos_token_id=[])
    verified = round(out.stats.mean_tree_size * len(out.stats.steps))
    assert draft_calls == 5 * len(out.stats.steps)  # a chain of 4 + the last drafted token's states
    assert rows[0].rows == rows[1].rows == 18 + draft_calls  # below the skipped layer: once per token
    assert rows[2].rows == 18 + verified  # the skipped layer runs only in verification
    assert rows[3].rows == 18 + draft_calls + verified  # a kept layer above it: drafted, then verified
    assert out.stats.tau > 1.5


def test_layer_skip_on_the_default_model_equals_hf_greedy_with_eos_inside_a_draft_and_the_length_limit(
    default_model, cases
):
    """Two of the four cases (a code prompt, a chat prompt), layers 25 and 27 of 30 left out."""
    model, _ = default_model
    options = {"pipeline": specpass.Pipeline(TreeAttention(16), LayerSkip((25, 27))), "drafter": SelfDraft(4), "budget": 5}
    check_default_model_greedy(model, cases, options, min_tau=1.5)  # two layers out: the draft mostly agrees


def test_skip_search_grows_the_set_that_keeps_agreement_highest():
    from specpass.research.skip_search import search_skip_sets

    model = _deep_tiny(layers=6, seed=3, peaked=True)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    found = search_skip_sets(model, ids, max_size=3)
    assert [len(s) for s in found.sets] == [1, 2, 3] and all(0 not in s for s in found.sets)
    assert all(set(a) < set(b) for a, b in zip(found.sets, found.sets[1:]))  # grown one layer at a time
    assert found.positions == 40 and found.forwards == 1 + 5 + 4 + 3

    with torch.no_grad():
        target = model(ids).logits.argmax(-1)

        def by_hand(skip):  # HF's model with those layers replaced by the identity
            layers = list(model.model.layers)
            try:
                for layer in skip:
                    model.model.layers[layer] = _Identity()
                return float((model(ids).logits.argmax(-1) == target).float().mean())
            finally:
                for i, layer in enumerate(layers):
                    model.model.layers[i] = layer

        singles = {layer: by_hand({layer}) for layer in range(1, 6)}
    best = max(singles.values())
    assert found.agreement[0] == pytest.approx(best, abs=1e-4)
    assert found.sets[0] == (max(k for k, a in singles.items() if a == best),)  # ties go to the higher layer
    assert found.agreement[2] == pytest.approx(by_hand(found.sets[2]), abs=1e-4)
    assert found.best(0.0) == found.sets[-1] and found.best(1.01) == ()
    with pytest.raises(InvalidParameterError, match=r"max_size must be an int in \[1, 4\]"):
        search_skip_sets(model, ids, max_size=5)
    with pytest.raises(InvalidParameterError, match="one sequence"):
        search_skip_sets(model, ids[:, :1], max_size=1)


def test_the_self_draft_is_one_more_proposer_in_the_combined_tree(monkeypatch):
    """Combined(SelfDraft, PromptLookup, TokenRecycling): the self-draft's chain competes for nodes in
    the one tree (verified by the full step when the tree is not its chain alone); greedy stays HF's,
    and some accepted nodes are the self-draft's."""
    from specpass.drafters import Combined, PromptLookup, TokenRecycling, base

    model = _deep_tiny(seed=2, peaked=True)
    accepted_sources = []
    observe = base.observe_row

    def recording(sessions, tree, verified, path, tokens):
        accepted_sources.extend(tree.origins[i][0] for i in path[1:])
        return observe(sessions, tree, verified, path, tokens)

    monkeypatch.setattr(base, "observe_row", recording)
    options = {"pipeline": specpass.Pipeline(TreeAttention(16), LayerSkip((2,))),
               "drafter": Combined(SelfDraft(4), PromptLookup(), TokenRecycling()),
               "cache_size": 128, "budget": 5}  # fmt: skip
    assert max(self_draft_taus_equal_to_hf_greedy(model, options)) > 1.5
    assert 0 in accepted_sources and len(set(accepted_sources)) > 1  # the self-draft's nodes, and others'
