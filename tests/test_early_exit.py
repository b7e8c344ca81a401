"""EarlyExit (rewrites.early_exit) and SelfDraft (drafters.self_draft): the graphs it cuts, the KV and
hidden states the draft shares with the verify step, losslessness, and where it must not apply."""

import pytest
import torch
from conftest import (
    TINY_ARCHS, RowCounter, check_default_model_greedy, draft_then_resume, self_draft_taus_equal_to_hf_greedy,
    tiny_model,
)  # fmt: skip

import specpass
from specpass.backends.onnx.export import export
from specpass.drafters import SelfDraft
from specpass.common.errors import ExportError, GraphVerificationError, InvalidParameterError, PassMismatchError
from specpass.common.errors import PassPipelineError
from specpass.ir import capture, draft_spec, verify
from specpass.ir.draft import RESUME_MODULE, draft_graph, resume_graph
from specpass.rewrites import DraftHeads, EarlyExit, TreeAttention

EXIT = specpass.Pipeline(TreeAttention(16), EarlyExit(1))  # tiny models have 2 layers: draft with the first


@torch.no_grad()
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_draft_then_resume_equals_the_verify_step_and_the_draft_equals_the_first_layers(arch):
    model = tiny_model(arch)
    gm, _ = EXIT.run(capture(model, cache_size=64))
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    exit_logits, exit_hidden, (k_drafted, _), (k_cache, _) = draft_then_resume(gm, ids)
    assert k_drafted[1].abs().sum() == 0 and torch.equal(k_drafted[0], k_cache[0])  # layer 0's K/V, in place
    by_hand = model(ids, output_hidden_states=True).hidden_states[1]  # after the first layer, by HF
    torch.testing.assert_close(exit_hidden, by_hand, rtol=0, atol=1e-5)
    if arch == "llama":  # a plain exit: the model's final norm and LM head on that state
        torch.testing.assert_close(exit_logits, model.lm_head(model.model.norm(by_hand)), rtol=0, atol=1e-5)


def test_the_pass_leaves_the_verify_graph_alone_and_reports_its_draft():
    model = tiny_model()
    before, _ = specpass.Pipeline(TreeAttention(16)).run(capture(model, cache_size=64))
    after, report = EXIT.run(capture(model, cache_size=64))
    assert after.graph.python_code("self").src == before.graph.python_code("self").src
    spec = draft_spec(after)
    assert spec.kind == "early-exit" and spec.shares_cache and spec.config.layer == 1 and spec.config.cache_size == 64
    assert "layers 0-0" in str(report) and "sharing the KV cache" in str(report)


def test_the_pass_refuses_where_it_must_not_apply():
    model = tiny_model()
    tree, _ = specpass.Pipeline(TreeAttention(16)).run(capture(model, cache_size=64))
    source = tree.graph.python_code("self").src
    with pytest.raises(PassMismatchError, match="leaves none of the model's 2 layers"):
        specpass.Pipeline(TreeAttention(16), EarlyExit(2)).run(capture(model, cache_size=64))
    with_exit, _ = EXIT.run(capture(model, cache_size=64))  # twice: what the pass manager asks before rewriting
    assert "already has a draft graph (EarlyExit applied twice" in EarlyExit(1).check(with_exit)
    with pytest.raises(PassPipelineError, match="requires"):
        specpass.Pipeline(EarlyExit(1)).run(capture(model, cache_size=64))  # the graphs are cut from the tree step
    with pytest.raises(InvalidParameterError, match="positive int"):
        EarlyExit(0)
    assert tree.graph.python_code("self").src == source and draft_graph(tree) is None


def test_verify_catches_a_broken_early_exit():
    gm, _ = EXIT.run(capture(tiny_model(), cache_size=64))
    resume = resume_graph(gm)
    delattr(gm, RESUME_MODULE)
    with pytest.raises(GraphVerificationError, match="resume graph"):
        verify(gm)
    gm.add_submodule(RESUME_MODULE, resume)
    verify(gm)
    stale = EarlyExit(1)
    object.__setattr__(stale, "layer", 2)  # the graphs were cut at layer 1: the resume graph runs layer 1
    with pytest.raises(GraphVerificationError, match="resume graph runs a layer < 2"):
        stale.verify(gm)


def _peaked(arch: str, seed: int = 2):
    model = tiny_model(arch, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked next-token law, so drafts get accepted
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "phi3"])
def test_self_draft_greedy_equals_hf_greedy(arch):
    model = _peaked(arch)
    options = {"pipeline": EXIT, "drafter": SelfDraft(4), "cache_size": 128, "budget": 5}
    assert max(self_draft_taus_equal_to_hf_greedy(model, options)) > 1.5


def test_layers_below_the_exit_run_once_per_drafted_token_and_never_in_verification(counted_linears):
    model = _peaked("llama")
    program = specpass.compile_program(model, specpass.CompileOptions(
        pipeline=EXIT, drafter=SelfDraft(4), cache_size=128, lowering="eager", budget=5))  # fmt: skip
    below, above = (RowCounter(layer.self_attn.q_proj) for layer in model.model.layers)
    calls = {"draft": 0, "resumed": 0, "full": 0}
    draft_run, verify, forward = program.draft.run, program.verify, program.forward

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)

        return call

    def resumed(*args):
        out = verify(*args)  # (logits, hidden, whether the exit hook resumed it)
        calls["resumed"] += out[2]
        return out

    object.__setattr__(program.draft, "run", counted("draft", draft_run))
    program.verify, program.forward = resumed, counted("full", forward)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0)).repeat(1, 2)
    out = specpass.generate(program, ids, max_new_tokens=40, eos_token_id=[])
    steps = len(out.stats.steps)
    assert calls["full"] == 1 and calls["resumed"] == steps  # the prefill, then every step resumed
    assert below.rows == 18 + calls["draft"]  # the prompt once, then one row per draft call: nothing twice
    assert above.rows == 18 + round(out.stats.mean_tree_size * steps)  # the upper layer verifies every node
    assert calls["draft"] == 5 * steps  # chain of 4 + the last drafted token's lower layers
    assert out.stats.tau > 1.5


def test_self_draft_on_the_default_model_equals_hf_greedy_with_eos_inside_a_draft_and_the_length_limit(
    default_model, cases
):
    """Two of the four cases (a code prompt, a chat prompt), chains of 2: each drafted token costs
    24 of 30 layers, which makes this the slowest drafter to test, and longer chains slower still."""
    model, _ = default_model
    options = {"pipeline": specpass.Pipeline(TreeAttention(16), EarlyExit(24)), "drafter": SelfDraft(2), "budget": 3}
    check_default_model_greedy(model, cases, options, min_tau=1.1)  # a layer-24 exit often agrees


def test_self_draft_sampling_equals_one_node_sampling_with_the_same_seed():
    model = _peaked("qwen3")
    one_node = {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1)), "cache_size": 128}
    options = {"pipeline": EXIT, "drafter": SelfDraft(4), "cache_size": 128}
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(seed)).repeat(1, 2)
        sampling = dict(do_sample=True, temperature=0.7, top_p=0.9, seed=seed)
        out = specpass.generate(model, ids, 40, eos_token_id=[], options=options, **sampling)
        plain = specpass.generate(model, ids, 40, eos_token_id=[], options=one_node, **sampling)
        assert torch.equal(out.sequences, plain.sequences)


def test_self_draft_needs_the_pass_and_the_export_refuses_the_shared_cache(tmp_path):
    model = tiny_model()
    with pytest.raises(InvalidParameterError, match="EarlyExit"):
        specpass.generate(model, torch.tensor([[1, 2, 3]]), 4, options={"drafter": SelfDraft(), "cache_size": 64})
    with pytest.raises(ExportError, match="cannot express pass EarlyExit"):
        export(model, EXIT, str(tmp_path / "out"), progress=False)
    with pytest.raises(PassMismatchError, match="already has a draft graph"):
        specpass.Pipeline(TreeAttention(16), EarlyExit(1), DraftHeads()).run(capture(model, cache_size=64))
