"""CPU lowerings: each is one function on the CPU's kernel set (backends.kernels); the oneDNN lowering
computes the eager step's function on packed weights."""

import operator

import pytest
import torch
from conftest import needs_cxx, needs_onednn, tiny_model
from torch import nn

import specpass
from specpass.backends.kernels.attention import ordered_attention
from specpass.backends.kernels.kernel_set import use_kernels
from specpass.backends.kernels.linear import rows_linear
from specpass.backends.lowering import onednn
from specpass.backends.lowering.registry import lower, resolve_lowering
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
    logits, _ = step(torch.from_numpy(tree.tokens)[None], SlotLayout.tree(30, tree.ancestor_mask()))
    return logits


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_onednn_step_equals_eager_step(arch, onednn_linears):
    _, gm = _tree_step(arch)
    expected = _run_prefix_and_tree(lower(gm, "eager", torch.device("cpu"), 16, 128)[0])
    gm.k_cache.zero_()
    gm.v_cache.zero_()
    got = _run_prefix_and_tree(lower(gm, "onednn", torch.device("cpu"), 16, 128)[0])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_the_kernel_set_replaces_every_linear_and_attention_and_keeps_annotations():
    model, gm = _tree_step("qwen2")  # qwen2 has q/k/v biases
    before = gm.graph.python_code("self").src
    lowered = use_kernels(gm, packed={})
    assert gm.graph.python_code("self").src == before  # the source graph is untouched
    modules = [n for n in lowered.graph.nodes if n.op == "call_module"]
    assert not any(isinstance(lowered.get_submodule(n.target), nn.Linear) for n in modules)
    linears = [n for n in lowered.graph.nodes if n.target is rows_linear]
    layers = model.config.num_hidden_layers
    assert len(linears) == 7 * layers + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    roles = {info(n).role.value for n in linears}
    assert roles == {"q", "k", "v", "o", "mlp", "lm_head"}
    assert sum(n.args[2] is not None for n in linears) == 3 * layers  # the q/k/v biases are kept
    attention = [n for n in lowered.graph.nodes if n.target is ordered_attention]
    assert len(attention) == layers and {info(n).role.value for n in attention} == {"attention"}
    assert not any(n.target is torch.nn.functional.scaled_dot_product_attention for n in lowered.graph.nodes)
    assert all(n.args[1].target is not operator.getitem for n in attention)  # the cache rows, not a sliced copy
    assert lowered.k_cache is gm.k_cache  # the KV cache is shared, not copied
    unpacked = use_kernels(gm)  # the eager lowering's: the weights as they are
    assert all(n.args[1].op == "get_attr" and n.args[1].target.endswith(".weight")
               for n in unpacked.graph.nodes if n.target is rows_linear)  # fmt: skip
    # a tiny model's weights are small: ATen's mm on the weights as they are, packed or not
    assert all(n.args[3] is False and n.args[1].target.endswith(".weight") for n in linears)


@needs_onednn
def test_programs_of_one_model_share_its_packed_weights_until_a_weight_changes(onednn_linears):
    model = tiny_model("llama")

    def step():
        return specpass.Pipeline(specpass.rewrites.TreeAttention(8)).run(capture(model, cache_size=64))[0]

    def packed(gm) -> dict[str, torch.Tensor]:  # oneDNN tensors have no storage pointer: compared by identity
        return {name: b for name, b in gm.named_buffers() if name.startswith("packed_")}

    first, second = (packed(use_kernels(step(), packed={})) for _ in range(2))
    assert len(first) == 7 * model.config.num_hidden_layers + 1
    assert all(second[name] is weight for name, weight in first.items())  # packed once, shared
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # changed in place: its version moves, so it is packed again
    lowered = use_kernels(step(), packed={})
    assert [name for name, w in packed(lowered).items() if w is not first[name]] == [f"packed_{len(first) - 1}"]
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    inputs = SlotLayout.chain(0, 5).step_inputs(ids)
    expected = step()(**inputs)[0]  # the changed model, eager
    torch.testing.assert_close(lowered(**inputs)[0], expected, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_a_program_runs_one_lowering_and_reports_its_kernels_and_the_check():
    model = tiny_model()
    program = specpass.compile_program(model, {"pipeline": specpass.Pipeline(specpass.rewrites.TreeAttention(2))})
    assert program.step.run.lowering == "onednn"
    report = str(program.report)
    assert "lowering onednn (cpu: ordered attention, rows pointwise, rows linear): one function, bit for bit on" in report
    assert program.report.invariance.passed and program.report.invariance.compared > 40
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
    step = lower(gm, "inductor", torch.device("cpu"), 16, 128).step
    assert step.lowering == "inductor"
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
    assert specpass.compile_program(fast).step.run.lowering == "inductor"


def test_auto_lowering_and_its_refusals():
    cpu = torch.device("cpu")
    assert resolve_lowering("auto", cpu, torch.float32) == ("onednn" if onednn.available(cpu, torch.float32) else "eager")
    assert resolve_lowering("auto", cpu, torch.bfloat16) == ("onednn" if onednn.available(cpu, torch.bfloat16) else "eager")
    assert resolve_lowering("auto", cpu, torch.float16) == "eager"
    assert resolve_lowering("onednn", cpu, torch.float32) == "onednn"
    assert resolve_lowering("auto", torch.device("cuda"), torch.bfloat16) == "inductor"
    model = tiny_model().to(torch.float16)
    gm = capture(model, cache_size=64)
    with pytest.raises(specpass.InvalidParameterError, match="'onednn' needs float32 or bfloat16"):
        lower(gm, "onednn", cpu, 8, 64)
    with pytest.raises(specpass.InvalidParameterError, match="needs the model on a CUDA device"):
        lower(gm, "cudagraphs", cpu, 8, 64)


@pytest.mark.parametrize("tree_step", [True, False])
def test_padding_to_a_bucket_leaves_the_real_nodes_and_the_cache_unchanged(tree_step):
    """What the CUDA-graph lowerings replay (ir.layout.SlotLayout.padded), run on the CPU: a step padded
    to its bucket gives the real nodes' logits of the unpadded step and writes no slot a real node
    reads, for a tree step and for a chain step (which writes each token at its position)."""
    model = tiny_model("llama")
    pipeline = specpass.Pipeline(specpass.rewrites.TreeAttention(16)) if tree_step else specpass.Pipeline()
    gm, _ = pipeline.run(capture(model, cache_size=128))
    step = lower(gm, "eager", torch.device("cpu"), 16, 128).step
    step(torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2)), SlotLayout.chain(0, 30))
    prefix = gm.k_cache[:, :, :, :30].clone()
    tree = DraftTree((5, 6, 7, 8, 9), (-1, 0, 0, 1, 3), (1.0,) * 5, (None,) * 5)
    if not tree_step:
        tree = DraftTree.chain((5, 6, 7, 8, 9))
    ids, layout = torch.from_numpy(tree.tokens)[None], SlotLayout.tree(30, tree.ancestor_mask())
    expected, _ = step(ids, layout)
    real_kv = gm.k_cache[:, :, :, 30:35].clone()
    inputs = layout.padded(8, 1).step_inputs(ids)
    positions = inputs["positions"]
    inputs.update(kv_len=64)  # a bucket's attended length: past the tree, hidden
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
    from specpass.common.errors import InvalidParameterError

    for name in ("auto", *LOWERINGS):
        assert CompileOptions(lowering=name).lowering == name
    with pytest.raises(InvalidParameterError, match="must be one of .*'cudagraphs'"):
        CompileOptions(lowering="tensorrt")
    assert {name for name, lowering in LOWERINGS.items() if not lowering.batches} == {"gguf", "gguf-compiled"}
    assert LOWERINGS["cudagraphs"].devices == ("cuda",) and LOWERINGS["cudagraphs"].replays
    step = specpass.compile_program(tiny_model("llama"), {"lowering": "eager", "budget": 1}).step.run
    assert step.lowering == "eager"


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
