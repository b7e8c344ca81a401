"""Every invariant `ir.verify` checks, and those passes check in `Pass.verify`, rejects a graph that
breaks it (and only that invariant's message names it)."""

import operator

import pytest
import torch
from conftest import tiny_model

from specpass.common.errors import GraphVerificationError
from specpass.ir import Role, capture, copy_step, info, query, verify
from specpass.ir.draft import DRAFT_META, DraftGraphSpec, DraftTensor, attach_draft, trace_draft
from specpass.ir.layout import slot_visibility
from specpass.ir.roles import META_KEY, NodeInfo, annotate, placeholder
from specpass.passes import Pipeline
from specpass.rewrites import TreeAttention


@pytest.fixture(scope="module")
def steps():
    chain = capture(tiny_model("llama"), cache_size=32)
    tree, _ = Pipeline(TreeAttention(8)).run(chain)
    return chain, tree


def _first(gm, role: Role, layer: int | None = None, op: str | None = None) -> torch.fx.Node:
    return next(
        n for n in gm.graph.nodes
        if info(n).role is role and (layer is None or info(n).layer == layer) and (op is None or n.op == op)
    )  # fmt: skip


def _broken(gm, match: str, verifier=verify) -> None:
    gm.recompile()
    with pytest.raises(GraphVerificationError, match=match):
        verifier(gm)


def test_captured_and_rewritten_steps_verify(steps):
    chain, tree = steps
    verify(chain)
    verify(tree)
    TreeAttention(8).verify(tree)


def test_lint_failure(steps):
    gm = copy_step(steps[0])
    q = _first(gm, Role.Q, op="call_module")
    q.target = "no_such_module"
    with pytest.raises(GraphVerificationError, match="lint failed"):
        verify(gm)


def test_missing_annotation(steps):
    gm = copy_step(steps[0])
    del _first(gm, Role.MLP).meta[META_KEY]
    _broken(gm, "has no specpass annotation")


def test_layer_out_of_range(steps):
    gm = copy_step(steps[0])
    node = _first(gm, Role.MLP)
    node.meta[META_KEY] = NodeInfo(Role.MLP, 7)
    _broken(gm, "claims layer 7, model has 2")


def test_missing_required_input(steps):
    gm = copy_step(steps[0])
    kv_len = placeholder(gm.graph, "kv_len")
    kv_len.target = kv_len.name = "slots_read"
    _broken(gm, "missing graph input 'kv_len'")


def test_tree_inputs_come_together_and_are_used(steps):
    gm = copy_step(steps[0])
    with gm.graph.inserting_after(placeholder(gm.graph, "kv_len")):
        annotate(gm.graph.placeholder("tree_mask"), Role.INPUT)
    _broken(gm, "tree inputs must come together")
    with gm.graph.inserting_after(placeholder(gm.graph, "tree_mask")):
        annotate(gm.graph.placeholder("cache_slots"), Role.INPUT)
    _broken(gm, "graph input 'tree_mask' is unused")


def test_one_projection_of_each_kind_per_layer(steps):
    gm = copy_step(steps[0])
    _first(gm, Role.K, layer=1, op="call_module").meta[META_KEY] = NodeInfo(Role.Q, 1)
    _broken(gm, "layer 1 has 2 q projections, expected 1")


def test_two_cache_writes_per_layer(steps):
    gm = copy_step(steps[0])
    write = query.cache_writes(gm.graph)[0]
    write.meta[META_KEY] = NodeInfo(Role.CACHE_WRITE, 1)  # layer 0's key write claims layer 1
    _broken(gm, "layer 0 has 1 cache writes, expected 2")


def test_one_attention_per_layer(steps):
    gm = copy_step(steps[0])
    query.attention_ops(gm.graph)[1].meta[META_KEY] = NodeInfo(Role.MLP, 1)
    _broken(gm, "expected one attention per layer")


def test_every_attention_reads_the_same_mask(steps):
    gm = copy_step(steps[0])
    sdpa = query.attention_ops(gm.graph)[1]
    mask = sdpa.kwargs["attn_mask"]
    with gm.graph.inserting_after(mask):
        copy = annotate(gm.graph.call_function(operator.and_, (mask, mask)), Role.MASK)
    sdpa.update_kwarg("attn_mask", copy)
    _broken(gm, "every attention must read the same attention mask")


def test_the_mask_is_annotated(steps):
    gm = copy_step(steps[0])
    mask = query.shared_mask(gm.graph)
    mask.meta[META_KEY] = NodeInfo(Role.ATTENTION)
    _broken(gm, "is not annotated as a mask")


def test_every_cache_write_uses_the_same_slots(steps):
    gm = copy_step(steps[0])
    write = query.cache_writes(gm.graph)[3]
    slots = write.args[1]
    with gm.graph.inserting_after(slots):
        other = annotate(gm.graph.call_function(operator.add, (slots, 0)), Role.CACHE_INDEX)
    write.update_arg(1, other)
    _broken(gm, "every cache write must use the same slot index")


def test_the_step_returns_logits_and_hidden(steps):
    gm = copy_step(steps[0])
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = ((output.args[0][0],),)
    _broken(gm, r"must return \(logits, hidden, ...\)")


class _Identity(torch.nn.Module):
    def forward(self, hidden):
        return (hidden * 2,)


def _with_draft(gm, inputs=("hidden",)):
    spec = DraftGraphSpec("toy", "Toy", tuple(DraftTensor(n, ("N", 32), "model") for n in inputs),
                          (DraftTensor("out", ("N", 32), "model"),), None)  # fmt: skip
    attach_draft(gm, trace_draft(_Identity(), {}), spec)
    return gm


def test_draft_graph_and_spec(steps):
    verify(_with_draft(copy_step(steps[0])))
    gm = _with_draft(copy_step(steps[0]))
    del gm.meta[DRAFT_META]
    _broken(gm, "must come together")
    gm = _with_draft(copy_step(steps[0]), inputs=("hidden", "tokens"))
    _broken(gm, r"draft graph's inputs are \['hidden'\], its spec declares \['hidden', 'tokens'\]")
    gm = _with_draft(copy_step(steps[0]))
    del next(iter(gm.draft.graph.nodes)).meta[META_KEY]
    _broken(gm, "draft node hidden has no specpass annotation")
    gm = _with_draft(copy_step(steps[0]))
    hidden = next(iter(gm.draft.graph.nodes))
    with gm.draft.graph.inserting_before(hidden):  # uses hidden before it is defined
        annotate(gm.draft.graph.call_function(operator.neg, (hidden,)), Role.DRAFT)
    _broken(gm, "draft graph lint failed")


def test_tree_attention_invariants(steps):
    tree_pass = TreeAttention(8)
    gm = copy_step(steps[1])
    mask = query.shared_mask(gm.graph)
    mask.target = torch.logical_or  # still a shared, annotated mask: only the pass's own check sees it
    gm.recompile()
    verify(gm)
    _broken(gm, "does not read the tree's slot-visibility mask", tree_pass.verify)
    gm = copy_step(steps[1])
    write = query.cache_writes(gm.graph)
    positions = placeholder(gm.graph, "positions")
    with gm.graph.inserting_after(positions):
        slots = annotate(gm.graph.call_function(torch.clone, (positions,)), Role.CACHE_INDEX)
    for w in write:
        w.update_arg(1, slots)
    verify(gm)
    _broken(gm, "do not index with cache_slots", tree_pass.verify)
    assert query.shared_mask(steps[1].graph).target is slot_visibility  # the fixture is untouched
