"""Invariants of a captured decode-step graph, checked after capture and after every pass.

`verify` checks what every step keeps whatever rewrites ran; a pass checks its own invariants in
`Pass.verify`, which the pass manager runs after this one (passes.manager).
"""

from __future__ import annotations

import collections

import torch.fx

from ..common.errors import GraphVerificationError
from . import query
from .draft import EARLY_EXIT_KIND, draft_graph, draft_spec, resume_graph
from .roles import META_KEY, Role, info, placeholder

REQUIRED_INPUTS = ("input_ids", "positions", "kv_len")
TREE_INPUTS = ("tree_mask", "cache_slots")


def _fail(message: str) -> None:
    raise GraphVerificationError(message)


def verify(gm: torch.fx.GraphModule) -> None:
    """Lint the graph and check specpass's invariants; raises GraphVerificationError."""
    graph = gm.graph
    _lint(graph, "graph")
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
    _verify_draft(gm)


def _lint(graph: torch.fx.Graph, what: str) -> None:
    try:
        graph.lint()
    except Exception as exc:  # fx raises plain RuntimeError/AssertionError on lint failures
        _fail(f"{what} lint failed: {exc}")


def _verify_draft(gm: torch.fx.GraphModule) -> None:
    """A draft graph (ir.draft) and its spec come together; the graph lints, is annotated and takes
    exactly the spec's inputs, in order; a resume graph (linted, annotated) comes only with a cache-sharing
    one, and always with a self-draft's."""
    draft, spec = draft_graph(gm), draft_spec(gm)
    if draft is None and spec is None:
        return
    if draft is None or spec is None:
        _fail("a draft graph and its DraftGraphSpec must come together")
    _lint(draft.graph, "draft graph")
    for node in draft.graph.nodes:
        if META_KEY not in node.meta:
            _fail(f"draft node {node.name} has no specpass annotation")
    inputs = tuple(n.target for n in draft.graph.nodes if n.op == "placeholder")
    if inputs != spec.input_names:
        _fail(f"the draft graph's inputs are {list(inputs)}, its spec declares {list(spec.input_names)}")
    resume = resume_graph(gm)
    if resume is not None and not spec.shares_cache:
        _fail("a resume graph comes only with a draft graph that shares the KV cache")
    if resume is None and spec.kind == EARLY_EXIT_KIND:
        _fail("a self-draft's draft graph comes with a resume graph (the verify step resumes from its states)")
    if resume is not None:
        _lint(resume.graph, "resume graph")
        if any(META_KEY not in node.meta for node in resume.graph.nodes):
            _fail("a resume graph node has no specpass annotation")


def _verify_layers(graph: torch.fx.Graph, num_layers: int) -> None:
    per_layer: dict[tuple[int | None, Role], int] = collections.Counter()
    for node in graph.nodes:
        if node.op == "call_module":
            per_layer[info(node).layer, info(node).role] += 1
    for node in query.cache_writes(graph):
        per_layer[info(node).layer, Role.CACHE_WRITE] += 1
    for layer in range(num_layers):
        fused = per_layer[layer, Role.QKV]
        for role in (Role.O,) if fused else (Role.Q, Role.K, Role.V, Role.O):
            if per_layer[layer, role] != 1:
                _fail(f"layer {layer} has {per_layer[layer, role]} {role.value} projections, expected 1")
        if fused and (fused != 1 or any(per_layer[layer, r] for r in (Role.Q, Role.K, Role.V))):
            _fail(f"layer {layer} has {fused} fused qkv projections besides q/k/v ones, expected one fused or three")
        if per_layer[layer, Role.CACHE_WRITE] != 2:
            _fail(f"layer {layer} has {per_layer[layer, Role.CACHE_WRITE]} cache writes, expected 2 (k, v)")


def _verify_attention(graph: torch.fx.Graph, num_layers: int) -> None:
    sdpa = query.attention_ops(graph)
    if len(sdpa) != num_layers:
        _fail(f"expected one attention per layer ({num_layers}), found {len(sdpa)}")
    mask = query.shared_mask(graph)
    if mask is None:
        _fail("every attention must read the same attention mask")
    if info(mask).role is not Role.MASK:
        _fail(f"attention mask {mask.name} is not annotated as a mask")
    if query.shared_write_slots(graph) is None:
        _fail("every cache write must use the same slot index")
