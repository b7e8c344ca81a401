"""CPU lowerings: the oneDNN lowering computes the eager step's function on packed weights."""

import pytest
import torch
from conftest import needs_cxx, needs_onednn, tiny_model
from torch import nn

import specpass
from specpass.backends.lowering import onednn
from specpass.backends.lowering.buckets import pad_step
from specpass.backends.runtime.cost import CostCurve
from specpass.backends.lowering.registry import lower, resolve_lowering
from specpass.backends.lowering.per_size import FastestPerSize
from specpass.drafters import DraftTree
from specpass.ir import SlotLayout, capture, info



def _tree_step(arch: str):
    model = tiny_model(arch)
    gm, _ = specpass.Pipeline(specpass.rewrites.TreeAttention(16)).run(capture(model, cache_size=128))
    return model, gm


def _run_prefix_and_tree(step):
    """Prefill 30 tokens, then verify a 5-node tree; returns the tree's logits."""
    torch.manual_seed(1)
    prompt = torch.randint(0, 96, (1, 30))
    step(prompt, SlotLayout.chain(0, 30))
    tree = DraftTree((5, 6, 7, 8, 9), (-1, 0, 0, 1, 3), (1.0,) * 5, (None,) * 5)
    logits, _ = step(torch.tensor([tree.tokens]), SlotLayout(30, tree.ancestor_mask()))
    return logits


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_onednn_step_equals_eager_step(arch):
    _, gm = _tree_step(arch)
    expected = _run_prefix_and_tree(lower(gm, "eager", torch.device("cpu"), 16, 128)[0])
    gm.k_cache.zero_()
    gm.v_cache.zero_()
    got = _run_prefix_and_tree(lower(gm, "onednn", torch.device("cpu"), 16, 128)[0])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_onednn_graph_replaces_every_linear_and_keeps_annotations():
    model, gm = _tree_step("qwen2")  # qwen2 has q/k/v biases
    before = gm.graph.python_code("self").src
    lowered = onednn.pack_linears(gm)
    assert gm.graph.python_code("self").src == before  # the source graph is untouched
    modules = [n for n in lowered.graph.nodes if n.op == "call_module"]
    assert not any(isinstance(lowered.get_submodule(n.target), nn.Linear) for n in modules)
    linears = [n for n in lowered.graph.nodes if n.target is torch.ops.mkldnn._linear_pointwise]
    layers = model.config.num_hidden_layers
    assert len(linears) == 7 * layers + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    roles = {info(n).role.value for n in linears}
    assert roles == {"q", "k", "v", "o", "mlp", "lm_head"}
    assert sum(n.args[2] is not None for n in linears) == 3 * layers  # the q/k/v biases are kept
    assert lowered.k_cache is gm.k_cache  # the KV cache is shared, not copied


@needs_onednn
def test_programs_of_one_model_share_its_packed_weights_until_a_weight_changes():
    model = tiny_model("llama")

    def step():
        return specpass.Pipeline(specpass.rewrites.TreeAttention(8)).run(capture(model, cache_size=64))[0]

    def packed(gm) -> dict[str, torch.Tensor]:  # oneDNN tensors have no storage pointer: compared by identity
        return {name: b for name, b in gm.named_buffers() if name.startswith("packed_")}

    first, second = (packed(onednn.pack_linears(step())) for _ in range(2))
    assert len(first) == 7 * model.config.num_hidden_layers + 1
    assert all(second[name] is weight for name, weight in first.items())  # packed once, shared
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # changed in place: its version moves, so it is packed again
    lowered = onednn.pack_linears(step())
    assert [name for name, w in packed(lowered).items() if w is not first[name]] == [f"packed_{len(first) - 1}"]
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    inputs = SlotLayout.chain(0, 5).step_inputs(ids)
    expected = step()(**inputs)[0]  # the changed model, eager
    torch.testing.assert_close(lowered(**inputs)[0], expected, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_auto_lowering_runs_each_tree_size_on_the_kernel_measured_faster():
    _, gm = _tree_step("llama")
    step, _, _ = lower(gm, "auto", torch.device("cpu"), 16, 128)
    assert isinstance(step, FastestPerSize) and step.kinds == ("eager", "onednn")
    assert step.kind_for(1) == step.kind_for(30) == "onednn"  # nothing measured yet: the default
    # As on an AMX Xeon: eager cheaper for small T, oneDNN from T = 16 (prefill of 30 tokens on oneDNN).
    envelope = step.choose({"eager": CostCurve((1, 8, 16), (1.0, 1.5, 3.0)),
                            "onednn": CostCurve((1, 8, 16), (1.2, 1.6, 2.0))})  # fmt: skip
    assert envelope == CostCurve((1, 8, 16), (1.0, 1.5, 2.0))
    assert [step.kind_for(t) for t in (1, 5, 8, 16, 30)] == ["eager", "eager", "eager", "onednn", "onednn"]
    got = _run_prefix_and_tree(step)

    # The same calls made by hand: the prefill on the oneDNN step, the 5-node tree on the eager step.
    gm.k_cache.zero_()
    gm.v_cache.zero_()
    by_hand = {"eager": step.steps["eager"], "onednn": step.steps["onednn"]}
    calls = []

    def routed(input_ids, layout):
        kind = "onednn" if layout.size == 30 else "eager"
        calls.append(kind)
        return by_hand[kind](input_ids, layout)

    assert torch.equal(got, _run_prefix_and_tree(routed)) and calls == ["onednn", "eager"]
    with step.pinned("onednn"):
        assert step.kind_for(1) == "onednn"
    assert step.kind_for(1) == "eager"


@needs_onednn
def test_program_measures_both_cpu_lowerings_and_keeps_the_envelope():
    model = tiny_model()
    program = specpass.compile_program(model, {"pipeline": specpass.Pipeline(specpass.rewrites.TreeAttention(2))})
    run = program.step.run
    curve = program.cost_curve
    assert set(run.curves) == {"eager", "onednn"}
    assert curve.sizes == (1, 2)  # the program's tree sizes
    for c in run.curves.values():  # the lowerings' curves go past them, for the prefill's choice
        assert c.sizes == (1, 2, 4, 16, 64)
    for i in range(len(curve.sizes)):
        assert curve.seconds[i] == min(c.seconds[i] for c in run.curves.values())
    ids = torch.tensor([[3, 5, 7, 9]])
    out = specpass.generate(program, ids, 6).sequences
    reference = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, reference)




@needs_cxx
def test_inductor_step_equals_eager_step():
    """The inductor-compiled step (one compile with symbolic sizes) computes the FX step's function:
    prefill, then a tree over the committed prefix, and the K/V it writes into the shared cache."""
    _, gm = _tree_step("llama")
    expected = _run_prefix_and_tree(lower(gm, "eager", torch.device("cpu"), 16, 128)[0])
    expected_cache = gm.k_cache.clone()
    gm.k_cache.zero_()
    gm.v_cache.zero_()
    step, _, _ = lower(gm, "inductor", torch.device("cpu"), 16, 128)
    assert step.kind == "inductor"
    torch.testing.assert_close(_run_prefix_and_tree(step), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gm.k_cache, expected_cache, rtol=1e-5, atol=1e-5)


@needs_cxx
def test_speculative_greedy_with_the_inductor_lowering_equals_hf_greedy():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    reference = model.generate(ids, max_new_tokens=40, do_sample=False)
    fast = torch.compile(model, backend="specpass", options={"lowering": "inductor"})
    out = specpass.generate(fast, ids, max_new_tokens=40)
    assert torch.equal(out.sequences, reference)
    assert specpass.compile_program(fast).step.run.kind == "inductor"


def test_auto_lowering_and_its_refusals():
    cpu = torch.device("cpu")
    expected = ("eager", "onednn") if onednn.available(cpu, torch.float32) else ("eager",)
    assert resolve_lowering("auto", cpu, torch.float32) == expected
    assert resolve_lowering("auto", cpu, torch.bfloat16) == ("eager",)
    assert resolve_lowering("onednn", cpu, torch.float32) == ("onednn",)
    assert resolve_lowering("auto", torch.device("cuda"), torch.bfloat16) == ("inductor",)
    model = tiny_model().to(torch.bfloat16)
    gm = capture(model, cache_size=64)
    with pytest.raises(specpass.InvalidParameterError, match="'onednn' needs float32"):
        lower(gm, "onednn", cpu, 8, 64)
    with pytest.raises(specpass.InvalidParameterError, match="needs the model on a CUDA device"):
        lower(gm, "cudagraphs", cpu, 8, 64)


@pytest.mark.parametrize("tree_step", [True, False])
def test_padding_to_a_bucket_leaves_the_real_nodes_and_the_cache_unchanged(tree_step):
    """What the CUDA-graph lowerings replay (backends.lowering.buckets.pad_step), run on the CPU: a step padded
    to its bucket gives the real nodes' logits of the unpadded step and writes no slot a real node
    reads, for a tree step and for a chain step (which writes each token at its position)."""
    model = tiny_model("llama")
    pipeline = specpass.Pipeline(specpass.rewrites.TreeAttention(16)) if tree_step else specpass.Pipeline()
    gm, _ = pipeline.run(capture(model, cache_size=128))
    step, _, _ = lower(gm, "eager", torch.device("cpu"), 16, 128)
    step(torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2)), SlotLayout.chain(0, 30))
    prefix = gm.k_cache[:, :, :, :30].clone()
    tree = DraftTree((5, 6, 7, 8, 9), (-1, 0, 0, 1, 3), (1.0,) * 5, (None,) * 5)
    if not tree_step:
        tree = DraftTree.chain((5, 6, 7, 8, 9))
    ids, layout = torch.tensor([tree.tokens]), SlotLayout(30, tree.ancestor_mask())
    expected, _ = step(ids, layout)
    real_kv = gm.k_cache[:, :, :, 30:35].clone()
    padded_ids, positions, padded = pad_step(ids, layout, 8)
    inputs = padded.step_inputs(padded_ids)
    inputs.update(positions=positions, kv_len=64)  # a bucket's attended length: past the tree, hidden
    got = step.run_graph(inputs)[0]
    torch.testing.assert_close(got[:, :5], expected, rtol=1e-5, atol=1e-5)
    assert positions[0].tolist() == [30, 31, 31, 32, 33, 35, 36, 37] if tree_step else list(range(30, 38))
    assert torch.equal(gm.k_cache[:, :, :, :30], prefix)  # the committed prefix is untouched
    torch.testing.assert_close(gm.k_cache[:, :, :, 30:35], real_kv)  # the real nodes' K/V as unpadded


def test_the_lowering_registry_is_the_one_list_of_lowerings_and_their_capabilities():
    """CompileOptions accepts exactly `auto` and the registry's names, every built step says which
    lowerings it runs, and a batch is refused on a lowering the registry marks as one-row only."""
    from specpass.backends.lowering.registry import LOWERINGS
    from specpass.backends.options import CompileOptions
    from specpass.errors import InvalidParameterError

    for name in ("auto", *LOWERINGS):
        assert CompileOptions(lowering=name).lowering == name
    with pytest.raises(InvalidParameterError, match="must be one of .*'cudagraphs'"):
        CompileOptions(lowering="tensorrt")
    assert {name for name, lowering in LOWERINGS.items() if not lowering.batches} == {"gguf", "gguf-compiled"}
    assert LOWERINGS["cudagraphs"].devices == ("cuda",) and LOWERINGS["cudagraphs"].replays
    step = specpass.compile_program(tiny_model("llama"), {"lowering": "eager", "budget": 1}).step.run
    assert step.kinds == ("eager",)


def test_compiled_calls_get_dense_row_major_inputs():
    """A [1, T] slice of a longer row is contiguous but strided (64, 1): dynamo guards on strides (it
    would compile the step again) and AOT-compiled code reads inputs as row-major without checking,
    so such inputs are copied; dense ones pass as they are."""
    from specpass.backends.lowering.inductor import dense_row_major

    row = torch.rand(1, 64)  # dense, not a view
    for strided in (torch.empty_strided((1, 5), (64, 1)), torch.arange(128.0).view(2, 64)[:1, :5], torch.eye(4).t()):
        dense = dense_row_major(strided)
        assert dense.stride() == torch.empty(dense.shape).stride() and torch.equal(dense, strided)
    assert dense_row_major(row) is row and dense_row_major(7) == 7
