"""Invariants of a captured decode-step graph, checked after capture and after every pass."""

from __future__ import annotations

import collections

import torch.fx

from specpass.errors import GraphVerificationError
from specpass.ir.roles import DRAFT_MODULE, META_KEY, Role, info, nodes_with_role, placeholder

REQUIRED_INPUTS = ("input_ids", "positions", "kv_len")
DRAFT_INPUTS = ("hidden", "tokens", "head")
TREE_INPUTS = ("tree_mask", "cache_slots")


def _fail(message: str) -> None:
    raise GraphVerificationError(message)


def _sdpa_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [
        n
        for n in nodes_with_role(graph, Role.ATTENTION)
        if n.op == "call_function" and n.target is torch.nn.functional.scaled_dot_product_attention
    ]


def verify(gm: torch.fx.GraphModule) -> None:
    """Lint the graph and check specpass's invariants; raises GraphVerificationError."""
    graph = gm.graph
    try:
        graph.lint()
    except Exception as exc:  # fx raises plain RuntimeError/AssertionError on lint failures
        _fail(f"graph lint failed: {exc}")
    num_layers = gm.meta["specpass_arch"].num_layers
    for node in graph.nodes:
        if META_KEY not in node.meta:
            _fail(f"node {node.name} has no specpass annotation")
        layer = info(node).layer
        if layer is not None and not 0 <= layer < num_layers:
            _fail(f"node {node.name} claims layer {layer}, model has {num_layers}")
    for name in REQUIRED_INPUTS:
        if placeholder(graph, name) is None:
            _fail(f"missing graph input {name!r}")
    tree_inputs = [placeholder(graph, name) for name in TREE_INPUTS]
    if any(tree_inputs) and not all(tree_inputs):
        _fail(f"tree inputs must come together: {TREE_INPUTS}")
    for node in tree_inputs:
        if node is not None and not node.users:
            _fail(f"graph input {node.target!r} is unused")
    _verify_layers(graph, num_layers)
    _verify_attention(graph, num_layers)
    outputs = [n for n in graph.nodes if n.op == "output"]
    if len(outputs) != 1 or not isinstance(outputs[0].args[0], tuple) or len(outputs[0].args[0]) < 2:
        _fail("the step must return (logits, hidden, ...)")
    if hasattr(gm, DRAFT_MODULE):
        _verify_draft(getattr(gm, DRAFT_MODULE), gm)


def _verify_draft(draft: torch.fx.GraphModule, gm: torch.fx.GraphModule) -> None:
    """The draft graph: linted, annotated, reading (hidden, tokens, head), sharing the step's LM head,
    or holding exactly its rows of the draft vocabulary."""
    try:
        draft.graph.lint()
    except Exception as exc:
        _fail(f"draft graph lint failed: {exc}")
    for node in draft.graph.nodes:
        if META_KEY not in node.meta:
            _fail(f"draft node {node.name} has no specpass annotation")
    inputs = [n.target for n in draft.graph.nodes if n.op == "placeholder"]
    if inputs != list(DRAFT_INPUTS):
        _fail(f"the draft graph's inputs are {inputs}, expected {list(DRAFT_INPUTS)}")
    lm_head = gm.get_submodule("lm_head")
    vocab_head, vocab = draft.get_submodule("vocab_head"), draft.vocab
    whole = len(vocab) == lm_head.weight.shape[0] and torch.equal(vocab, torch.arange(len(vocab), device=vocab.device))
    if vocab_head is lm_head:
        if not whole:
            _fail("the draft graph reads the whole LM head but its vocabulary is not the whole vocabulary")
    elif whole:
        _fail("without a draft vocabulary the draft graph must share the step's LM head, not a copy")
    elif not torch.equal(vocab_head.weight, lm_head.weight[vocab]):
        _fail("the draft graph's vocabulary head is not the LM head's rows of its draft vocabulary")


def _verify_layers(graph: torch.fx.Graph, num_layers: int) -> None:
    per_layer: dict[tuple[int | None, Role], int] = collections.Counter()
    for node in graph.nodes:
        node_info = info(node)
        if node.op == "call_module" or (node_info.role is Role.CACHE_WRITE and node.op == "call_method"):
            per_layer[node_info.layer, node_info.role] += 1
    for layer in range(num_layers):
        for role in (Role.Q, Role.K, Role.V, Role.O):
            if per_layer[layer, role] != 1:
                _fail(f"layer {layer} has {per_layer[layer, role]} {role.value} projections, expected 1")
        if per_layer[layer, Role.CACHE_WRITE] != 2:
            _fail(f"layer {layer} has {per_layer[layer, Role.CACHE_WRITE]} cache writes, expected 2 (k, v)")


def _verify_attention(graph: torch.fx.Graph, num_layers: int) -> None:
    sdpa = _sdpa_nodes(graph)
    if len(sdpa) != num_layers:
        _fail(f"expected one attention per layer ({num_layers}), found {len(sdpa)}")
    masks = {n.kwargs.get("attn_mask") for n in sdpa}
    if len(masks) != 1 or None in masks:
        _fail("every attention must read the same attention mask")
    (mask,) = masks
    if info(mask).role is not Role.MASK:
        _fail(f"attention mask {mask.name} is not annotated as a mask")
    writes = [n for n in nodes_with_role(graph, Role.CACHE_WRITE) if n.op == "call_method"]
    indices = {n.args[2] for n in writes}
    if len(indices) != 1:
        _fail("every cache write must use the same slot index")
