"""CPU lowerings: the oneDNN lowering computes the eager step's function on packed weights."""

import pytest
import torch
from conftest import tiny_model
from torch import nn

import specpass
from specpass.backends import onednn
from specpass.backends.lowering import lower, resolve_lowering
from specpass.drafters import DraftTree
from specpass.ir import capture, info

needs_onednn = pytest.mark.skipif(
    not onednn.available(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN"
)


def _tree_step(arch: str):
    model = tiny_model(arch)
    gm, _ = specpass.Pipeline(specpass.rewrites.TreeAttention(16)).run(capture(model, cache_size=128))
    return model, gm


def _run_prefix_and_tree(step):
    """Prefill 30 tokens, then verify a 5-node tree; returns the tree's logits."""
    torch.manual_seed(1)
    prompt = torch.randint(0, 96, (1, 30))
    step(input_ids=prompt, positions=torch.arange(30)[None], kv_len=30,
         tree_mask=torch.ones(30, 30, dtype=torch.bool).tril()[None], cache_slots=torch.arange(30))  # fmt: skip
    tree = DraftTree((5, 6, 7, 8, 9), (-1, 0, 0, 1, 3), (1.0,) * 5, (None,) * 5)
    logits, _ = step(input_ids=torch.tensor([tree.tokens]), positions=(30 + torch.tensor(tree.depths()))[None],
                     kv_len=35, tree_mask=tree.ancestor_mask()[None], cache_slots=torch.arange(30, 35))  # fmt: skip
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


def test_auto_lowering_and_its_refusals():
    cpu = torch.device("cpu")
    expected = "onednn" if onednn.available(cpu, torch.float32) else "eager"
    assert resolve_lowering("auto", cpu, torch.float32) == expected
    assert resolve_lowering("auto", cpu, torch.bfloat16) == "eager"
    model = tiny_model().to(torch.bfloat16)
    gm = capture(model, cache_size=64)
    with pytest.raises(specpass.InvalidParameterError, match="'onednn' needs float32"):
        lower(gm, "onednn", cpu, 8, 64)
    with pytest.raises(specpass.InvalidParameterError, match="needs the model on a CUDA device"):
        lower(gm, "cudagraphs", cpu, 8, 64)
