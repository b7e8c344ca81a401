"""Graph rewrites inside the lowerings: sibling projections as one GEMM (backends.lowering.fuse_projections:
oneDNN, CUDA graphs, inductor) and the inductor step's in-place cache writes (backends.lowering.inductor)."""

import re

import pytest
import torch
from conftest import needs_cxx, tiny_model
from torch import nn

import specpass
from specpass.backends.lowering.eager import EagerStep
from specpass.backends.lowering.fuse_projections import fuse_projections, sibling_linears
from specpass.backends.lowering.inductor import inplace_cache_writes, write_cache_in_place
from specpass.drafters import DraftTree
from specpass.ir import Role, SlotLayout, arch_spec, capture, info, query


def _tree_step(arch: str):
    gm, _ = specpass.Pipeline(specpass.rewrites.TreeAttention(16)).run(capture(tiny_model(arch), cache_size=128))
    return gm


def _linears(gm) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear)]


def _prefix_and_tree(step, gm):
    """Prefill 30 tokens, then a 5-node tree: (the tree's logits, the K and V caches after it)."""
    gm.k_cache.zero_()
    gm.v_cache.zero_()
    prompt = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(1))
    step(prompt, SlotLayout.chain(0, 30))
    tree = DraftTree((5, 6, 7, 8, 9), (-1, 0, 0, 1, 3), (1.0,) * 5, (None,) * 5)
    logits, _ = step(torch.from_numpy(tree.tokens)[None], SlotLayout.tree(30, tree.ancestor_mask()))
    return logits, gm.k_cache.clone(), gm.v_cache.clone()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_fused_projections_graph_and_equivalence(arch):
    model = tiny_model(arch)
    gm, _ = specpass.Pipeline(specpass.rewrites.TreeAttention(16)).run(capture(model, cache_size=128))
    spec = arch_spec(model)
    n, q, kv = spec.num_layers, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    before = _linears(gm)
    fused = fuse_projections(gm)
    assert len(before) == 7 * n + 1
    assert len(_linears(fused)) == 4 * n + 1  # q|k|v, o, gate|up, down per layer, and the LM head
    assert _linears(gm) == before  # the source graph is not modified
    qkv = [n for n in fused.graph.nodes if n.op == "call_module" and info(n).role == Role.QKV]
    assert len(qkv) == n and all(fused.get_submodule(x.target).out_features == q + 2 * kv for x in qkv)
    assert all((fused.get_submodule(x.target).bias is not None) == (arch == "qwen2") for x in qkv)
    splits = [x.args[1] for x in fused.graph.nodes if x.op == "call_method" and x.target == "split"]
    inner = model.config.intermediate_size
    assert splits == [[q, kv, kv], [inner, inner]] * n
    expected = _prefix_and_tree(EagerStep(gm), gm)
    got = _prefix_and_tree(EagerStep(fused), gm)  # same cache buffers (copy_step shares them)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_fusion_does_not_apply_where_it_must_not():
    # Phi-3: q/k/v already one projection and gate/up one linear inside its MLP: nothing to fuse
    phi3 = _tree_step("phi3")
    assert sibling_linears(phi3) == []
    assert _linears(fuse_projections(phi3)) == _linears(phi3)
    # applied twice: the second finds no siblings left
    once = fuse_projections(_tree_step("llama"))
    assert sibling_linears(once) == []
    assert _linears(fuse_projections(once)) == _linears(once)
    # a Linear subclass (it may compute otherwise) is not fused with its siblings
    gm = _tree_step("llama")

    class Custom(nn.Linear):
        pass

    q = gm.get_submodule("layers.0.self_attn.q_proj")
    custom = Custom(q.in_features, q.out_features, bias=False)
    custom.weight = q.weight
    gm.get_submodule("layers.0.self_attn").q_proj = custom
    groups = sibling_linears(gm)
    assert [[n.target for n in g] for g in groups][0] == ["layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj"]


def test_fused_weights_are_shared_by_programs_and_follow_in_place_changes():
    """Two lowerings of one model share each fused weight (so oneDNN packs it once per process); a
    member changed in place gives the next lowering a new fused weight that holds the change."""
    gm = _tree_step("llama")

    def fused_of(graph):
        return [m for name, m in graph.named_modules() if name.startswith("fused.") and type(m) is nn.Linear]

    fused, again = fused_of(fuse_projections(gm)), fused_of(fuse_projections(gm))
    assert len(fused) == 4 and all(a is b for a, b in zip(fused, again))  # q|k|v, gate|up of 2 layers
    q = gm.get_submodule("layers.0.self_attn.q_proj")
    with torch.no_grad():
        q.weight.mul_(2.0)
    changed = fused_of(fuse_projections(gm))
    assert changed[0] is not fused[0] and all(a is b for a, b in zip(changed[1:], fused[1:]))
    torch.testing.assert_close(changed[0].weight[: q.out_features], q.weight, rtol=0, atol=0)


def test_inplace_cache_writes_graph_and_equivalence():
    gm = _tree_step("llama")
    rewritten = inplace_cache_writes(gm)
    writes = [n for n in rewritten.graph.nodes if n.target is write_cache_in_place]
    assert len(writes) == 2 * 2  # K and V of each of the tiny model's 2 layers
    assert all(w.args[0].op == "get_attr" and w.args[0].target in ("k_cache", "v_cache") for w in writes)
    assert not query.cache_writes(rewritten.graph)
    assert len(query.cache_writes(gm.graph)) == 4  # source kept
    expected = _prefix_and_tree(EagerStep(gm), gm)
    got = _prefix_and_tree(EagerStep(rewritten), gm)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)  # the same ops in eager mode: bit for bit


@needs_cxx
@torch.no_grad()
def test_compiled_step_copies_no_cache_slice():
    """Compiled by inductor, the step with in-place cache writes has no loop over a layer's cache
    slice (B * KV * S * D elements), which the scatter-through-a-view form compiles to (a clone of
    the slice per write and a copy of the whole buffer back): the control."""
    from torch._inductor.utils import run_and_get_code

    gm, _ = specpass.Pipeline(specpass.rewrites.TreeAttention(16)).run(capture(tiny_model("llama"), cache_size=328))
    _, batch, kv, slots, dim = gm.k_cache.shape  # [L, B, KV, S, D]
    # a C++ loop over 2 * 328 * 8 = 5248 elements, a bound no other loop has
    slice_loop = re.compile(rf"x\d+<static_cast<int64_t>\({batch * kv * slots * dim}L\)")
    ids = torch.randint(0, 96, (1, 3))
    codes = {}
    for name, graph in (("in place", inplace_cache_writes(gm)), ("through a view", gm)):
        compiled = torch.compile(graph, fullgraph=True, dynamic=True)
        inputs = SlotLayout.chain(10, 3).step_inputs(ids)
        names = [n.target for n in graph.graph.nodes if n.op == "placeholder"]
        _, code = run_and_get_code(compiled, **{k: inputs[k] for k in names})
        codes[name] = "\n".join(code)
    assert slice_loop.search(codes["through a view"])
    assert not slice_loop.search(codes["in place"])
