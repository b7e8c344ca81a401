import pytest
import torch
from conftest import tiny_model

from specpass.drafters import DraftTree
from specpass.common.errors import InvalidParameterError, PassMismatchError
from specpass.ir import Role, SlotLayout, capture, info, query
from specpass.ir.layout import slot_visibility
from specpass.ir.roles import placeholder
from specpass.passes import PassManager, Pipeline
from specpass.rewrites import TreeAttention

# root(0) -> 1 -> 3, root -> 2 -> 4 -> 5, 2 -> 6
PARENTS = (-1, 0, 0, 1, 2, 4, 2)


def brute_force_mask(parents, prefix: int, kv_len: int) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, kv_len, dtype=torch.bool)
    for i in range(n):
        mask[i, :prefix] = True
        node = i
        while node >= 0:
            mask[i, prefix + node] = True
            node = parents[node]
    return mask


def test_tree_mask_matches_brute_force():
    tree = DraftTree(tuple(range(7)), PARENTS, (1.0,) * 7, (None,) * 7)
    prefix, kv_len = 5, 16
    layout = SlotLayout.tree(prefix, tree.ancestor_mask())
    mask = slot_visibility(layout.ancestors, layout.step_inputs(torch.zeros(1, 7, dtype=torch.long))["cache_slots"], kv_len)
    assert mask.shape == (1, 1, 7, kv_len)
    assert torch.equal(mask[0, 0], brute_force_mask(PARENTS, prefix, kv_len))
    # two rows, each with its own prefix: each row's mask is its own brute-force mask
    rows = SlotLayout.of((layout, SlotLayout.tree(2, tree.ancestor_mask())))
    inputs = rows.step_inputs(torch.zeros(2, 7, dtype=torch.long))
    both = slot_visibility(inputs["tree_mask"], inputs["cache_slots"], kv_len)
    assert torch.equal(both[0, 0], brute_force_mask(PARENTS, prefix, kv_len))
    assert torch.equal(both[1, 0], brute_force_mask(PARENTS, 2, kv_len))
    assert tree.depths() == [0, 1, 1, 2, 2, 3, 2]
    assert layout.positions().tolist() == [[prefix + d for d in tree.depths()]] and layout.kv_len == prefix + 7


@pytest.fixture(scope="module")
def model_and_graphs():
    model = tiny_model("qwen2", seed=3)
    chain = capture(model, cache_size=64)
    tree, report = Pipeline(TreeAttention()).run(chain)
    return model, chain, tree


def test_graph_after_rewrite(model_and_graphs):
    _, chain, tree = model_and_graphs
    assert placeholder(tree.graph, "tree_mask") is not None and placeholder(tree.graph, "cache_slots") is not None
    assert not any(n.op == "call_module" and "mask" in str(n.target) for n in tree.graph.nodes)
    masks = [n for n in tree.graph.nodes if n.target is slot_visibility]
    assert len(masks) == 1 and info(masks[0]).role is Role.MASK
    writes = query.cache_writes(tree.graph)
    assert len(writes) == 4 and {w.args[1].target for w in writes} == {"cache_slots"}
    assert placeholder(chain.graph, "tree_mask") is None  # the input graph is untouched


def test_rewrite_twice_is_refused(model_and_graphs):
    _, _, tree = model_and_graphs
    code = tree.code
    with pytest.raises(PassMismatchError, match="already verifies trees"):
        PassManager([TreeAttention()]).run(tree)
    assert tree.code == code


def test_rewrite_does_not_apply_without_the_chain_mask(model_and_graphs):
    _, chain, _ = model_and_graphs
    gm = torch.fx.GraphModule(chain, __import__("copy").deepcopy(chain.graph))
    gm.meta.update(chain.meta)
    for n in gm.graph.nodes:  # pretend the mask came from somewhere else
        if info(n).role is Role.MASK:
            n.meta["specpass"] = type(info(n))(Role.ATTENTION, None)
    assert "not the captured chain mask" in TreeAttention().check(gm)


def test_invalid_parameters():
    for bad in (0, -3, 10_000, 2.5, True):
        with pytest.raises(InvalidParameterError, match="max_nodes"):
            TreeAttention(max_nodes=bad)


def _run_tree(tree_gm, tokens, parents, prefix):
    t = DraftTree(tuple(tokens), tuple(parents), (1.0,) * len(tokens), (None,) * len(tokens))
    depths = torch.tensor(t.depths())
    logits, _ = tree_gm(
        torch.tensor([tokens]), (prefix + depths)[None], prefix + len(tokens), t.ancestor_mask()[None],
        torch.arange(prefix, prefix + len(tokens))[None],
    )  # fmt: skip
    return logits[0]


@torch.no_grad()
def test_tree_verification_equals_chain_verification_branch_by_branch(model_and_graphs):
    model, chain, tree = model_and_graphs
    prompt = torch.randint(0, 96, (1, 9))
    tokens = [5, 17, 33, 41, 2, 8, 60]
    chain(prompt, torch.arange(9)[None], 9)
    tree(prompt, torch.arange(9)[None], 9, torch.ones(9, 9, dtype=torch.bool).tril()[None], torch.arange(9)[None])
    tree_logits = _run_tree(tree, tokens, PARENTS, prefix=9)
    for leaf in (3, 5, 6):
        branch, node = [], leaf
        while node >= 0:
            branch.insert(0, node)
            node = PARENTS[node]
        chain(prompt, torch.arange(9)[None], 9)  # reset the cache past the prompt
        ids = torch.tensor([[tokens[i] for i in branch]])
        chain_logits, _ = chain(ids, torch.arange(9, 9 + len(branch))[None], 9 + len(branch))
        torch.testing.assert_close(tree_logits[branch], chain_logits[0], rtol=0, atol=1e-5)
        full = torch.cat([prompt, ids], dim=1)
        torch.testing.assert_close(tree_logits[branch], model(full).logits[0, 9:], rtol=0, atol=1e-5)


@torch.no_grad()
def test_one_node_tree_is_plain_decoding(model_and_graphs):
    model, chain, tree = model_and_graphs
    prompt = torch.randint(0, 96, (1, 6))
    tree(prompt, torch.arange(6)[None], 6, torch.ones(6, 6, dtype=torch.bool).tril()[None], torch.arange(6)[None])
    logits = _run_tree(tree, [11], (-1,), prefix=6)
    torch.testing.assert_close(logits[0], model(torch.cat([prompt, torch.tensor([[11]])], 1)).logits[0, -1],
                               rtol=0, atol=1e-5)  # fmt: skip
