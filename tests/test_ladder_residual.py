"""LadderResidual (rewrites.ladder_residual): the data flow against a hand-written reference, identity on
no layers, structural verification, refusals, the lossy label, and speculation on a laddered model."""

import pytest
import torch
from conftest import TINY_ARCHS, char_tokenizer as _char_tokenizer, tiny_model

import specpass
from specpass.drafters.registry import drafter_by_name
from specpass.common.errors import GraphVerificationError, InvalidParameterError, PassMismatchError, PassPipelineError
from specpass.ir import SlotLayout, capture
from specpass.rewrites import EarlyExit, LadderResidual, TreeAttention
from specpass.rewrites.ladder_residual import laddered_layers, residual_adds


@torch.no_grad()
def _reference(model, ids: torch.Tensor, laddered: set[int]) -> torch.Tensor:
    """The ladder written out on HF's own modules (Llama): sub-layer k reads s_{k-2} when its layer is
    laddered, else s_{k-1}; s_k = s_{k-1} + f_k(input). Returns logits [1, T, V]."""
    inner = model.model
    t = ids.shape[1]
    streams = [inner.embed_tokens(ids)] * 2  # s_{-2}, s_{-1}
    position_embeddings = inner.rotary_emb(streams[-1], torch.arange(t)[None])
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]  # [1, 1, T, T]
    for i, layer in enumerate(inner.layers):
        source = streams[-2] if i in laddered else streams[-1]
        attended = layer.self_attn(layer.input_layernorm(source), position_embeddings, causal)[0]
        streams.append(streams[-1] + attended)
        source = streams[-2] if i in laddered else streams[-1]
        streams.append(streams[-1] + layer.mlp(layer.post_attention_layernorm(source)))
    return model.lm_head(inner.norm(streams[-1]))


@torch.no_grad()
@pytest.mark.parametrize("layers", [(), (0,), (1,), (0, 1), (-1,)])
def test_the_rewritten_step_equals_the_hand_written_ladder(layers):
    model = tiny_model("llama")
    gm, _ = specpass.Pipeline(LadderResidual(layers)).run(capture(model, cache_size=64))
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    inputs = SlotLayout.chain(0, 20).step_inputs(ids)
    logits = gm(**{n.target: inputs[n.target] for n in gm.graph.nodes if n.op == "placeholder"})[0]
    laddered = {i % 2 for i in layers}
    torch.testing.assert_close(logits, _reference(model, ids, laddered), rtol=0, atol=1e-5)
    if laddered:  # the ladder changes the function: the standard model's logits are not these
        assert (logits - _reference(model, ids, set())).abs().max() > 1e-3


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_family_ladders_structurally(arch):
    model = tiny_model(arch)
    gm, report = specpass.Pipeline(TreeAttention(8), LadderResidual.top(2)).run(capture(model, cache_size=64))
    assert laddered_layers(gm.graph, 2) == (0, 1)
    attention_add, mlp_add = residual_adds(gm.graph, 1)
    layer_input = attention_add.args[0]
    before_mlp = residual_adds(gm.graph, 0)[0]
    assert {u for u in attention_add.users if u.meta["specpass"].layer == 1} == {mlp_add}  # the MLP reads no later stream
    assert any(u.meta["specpass"].layer == 1 for u in before_mlp.users)  # layer 1's attention reads s_0
    assert any(u.meta["specpass"].layer == 1 and u is not attention_add for u in layer_input.users)  # its MLP, s_1
    assert "LadderResidual: modified" in str(report) and "function changes" in str(report)


def test_no_layers_is_the_identity():
    model = tiny_model()
    plain, _ = specpass.Pipeline(TreeAttention(8)).run(capture(model, cache_size=64))
    laddered, report = specpass.Pipeline(TreeAttention(8), LadderResidual()).run(capture(model, cache_size=64))
    assert laddered.graph.python_code("self").src == plain.graph.python_code("self").src
    assert "LadderResidual: unchanged" in str(report)


def test_the_pass_refuses_where_it_must_not_apply():
    model = tiny_model()
    laddered, _ = specpass.Pipeline(LadderResidual((1,))).run(capture(model, cache_size=64))
    source = laddered.graph.python_code("self").src
    with pytest.raises(PassMismatchError, match=r"already laddered \(layers \[1\]\)"):
        specpass.Pipeline(LadderResidual((0,))).run(laddered)
    assert laddered.graph.python_code("self").src == source  # the graph is unchanged
    with pytest.raises(PassMismatchError, match=r"layer\(s\) \[2\] outside the model's 2 layers"):
        specpass.Pipeline(LadderResidual((2,))).run(capture(model, cache_size=64))
    with pytest.raises(PassMismatchError, match="named twice"):
        specpass.Pipeline(LadderResidual((1, -1))).run(capture(model, cache_size=64))
    with pytest.raises(PassPipelineError, match="listed twice"):
        specpass.Pipeline(LadderResidual((0,)), LadderResidual((1,)))
    with pytest.raises(PassMismatchError, match="a ladder crosses the layer boundary"):  # either order
        specpass.Pipeline(TreeAttention(8), LadderResidual((1,)), EarlyExit(1)).run(capture(model, cache_size=64))
    exited, _ = specpass.Pipeline(TreeAttention(8), EarlyExit(1)).run(capture(model, cache_size=64))
    with pytest.raises(PassMismatchError, match="early-exit resume graph"):
        specpass.Pipeline(LadderResidual((1,))).run(exited)
    for bad in ("top", (0.5,), (True,), 3):
        with pytest.raises(InvalidParameterError, match="tuple of layer indices"):
            LadderResidual(bad)
    with pytest.raises(InvalidParameterError, match="int >= 0"):
        LadderResidual.top(-1)


def test_verification_catches_a_layer_that_is_not_what_the_pass_says():
    model = tiny_model()
    gm, _ = specpass.Pipeline(LadderResidual((0, 1))).run(capture(model, cache_size=64))
    LadderResidual((0, 1)).verify(gm)
    with pytest.raises(GraphVerificationError, match=r"layers \[0, 1\] are laddered, expected \[1\]"):
        LadderResidual((1,)).verify(gm)
    attention_add, _ = residual_adds(gm.graph, 1)
    layer_input, before_mlp = attention_add.args[0], residual_adds(gm.graph, 0)[0]
    for user in [u for u in before_mlp.users if u.meta["specpass"].layer == 1]:
        user.replace_input_with(before_mlp, layer_input)  # layer 1's attention back on the standard stream
    with pytest.raises(GraphVerificationError, match="layer 1's attention does not read layer 0's stream"):
        LadderResidual((0, 1)).verify(gm)


def test_the_pipeline_says_the_output_changes_and_round_trips():
    pipeline = specpass.Pipeline(TreeAttention(16), LadderResidual.top(4))
    assert "output changes: LadderResidual rewires residual inputs" in str(pipeline)
    assert pipeline.changes_output() and not specpass.Pipeline(TreeAttention(16)).changes_output()
    assert "output changes" not in str(specpass.Pipeline(TreeAttention(16)))
    assert specpass.Pipeline.from_json(pipeline.to_json()) == pipeline


def _strong_layers(model):
    """Random init leaves the sub-layers' outputs small against the residual stream, so a tiny model's
    greedy tokens would not notice a ladder: scale the outputs up."""
    for layer in model.model.layers:
        layer.mlp.down_proj.weight.data.mul_(30.0)
        layer.self_attn.o_proj.weight.data.mul_(30.0)
    return model


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_speculation_on_a_laddered_model_equals_its_own_plain_greedy(arch):
    """The ladder defines a new model; speculation adds no change of its own (every drafter's tree)."""
    model = _strong_layers(tiny_model(arch))
    seed = 4  # a prompt HF greedy runs 40 tokens on, for all three
    ladder = LadderResidual((0, 1))
    one_node = {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1), ladder)}
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(seed))
    plain = specpass.generate(model, ids, max_new_tokens=40, options=one_node).sequences
    assert not torch.equal(plain, model.generate(ids, max_new_tokens=40, do_sample=False))  # a different model
    for drafter in ("prompt-lookup", "token-recycling", "combined"):
        options = {"pipeline": specpass.Pipeline(TreeAttention(16), ladder), "drafter": drafter_by_name(drafter)}
        assert torch.equal(specpass.generate(model, ids, max_new_tokens=40, options=options).sequences, plain)


def test_the_onnx_export_keeps_the_ladder_and_the_cli_says_the_output_changes(tmp_path, capsys):
    from specpass.backends.onnx.export import export
    from specpass.cli import main

    model = _strong_layers(tiny_model("llama"))
    ladder = LadderResidual((0, 1))
    export(model, specpass.Pipeline(TreeAttention(16), ladder), str(tmp_path / "onnx"), progress=False)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    one_node = {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1), ladder)}
    laddered = specpass.generate(model, ids, max_new_tokens=30, options=one_node).sequences
    on_ort = specpass.generate(specpass.load_onnx(str(tmp_path / "onnx")), ids, max_new_tokens=30).sequences
    assert torch.equal(on_ort, laddered)  # ORT runs the laddered model, speculatively, to the same tokens
    model.save_pretrained(tmp_path / "model")
    _char_tokenizer(model.config.vocab_size).save_pretrained(tmp_path / "model")
    pipeline = ["--pipeline", specpass.Pipeline(TreeAttention(16), ladder).to_json()]
    prompt = ["--prompt", "the cat sat on the mat", "--raw", "--max-new-tokens", "16"]
    assert main(["generate", "--model", str(tmp_path / "model"), *prompt, *pipeline]) == 0
    printed = capsys.readouterr().out
    assert "note: the output differs from the original model's: LadderResidual rewires" in printed
    assert "plain greedy (same rewrites)" in printed and "identical to greedy: True" in printed
