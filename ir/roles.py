"""Semantic annotations carried by every node of a captured decode step."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch.fx

META_KEY = "specpass"


class Role(enum.Enum):
    INPUT = "input"
    OUTPUT = "output"
    EMBED = "embed"
    QKV = "qkv"  # a fused q/k/v projection
    Q = "q"
    K = "k"
    V = "v"
    O = "o"
    ROPE = "rope"
    MASK = "mask"
    CACHE = "cache"
    CACHE_INDEX = "cache_index"
    CACHE_WRITE = "cache_write"
    ATTENTION = "attention"
    MLP = "mlp"  # a dense MLP, or a mixture of experts' routing and sum (ir.mixture)
    ROUTER = "router"  # a mixture's router projection
    EXPERT = "expert"  # a mixture's routed experts
    SHARED_EXPERT = "shared_expert"  # a mixture's shared expert and its gate
    RESIDUAL = "residual"
    NORM = "norm"
    LM_HEAD = "lm_head"
    DRAFT = "draft"  # nodes of a draft graph (ir.draft) that have no more specific role
    EVICTION = "eviction"  # ops a KV-eviction pass adds (rewrites.kv_eviction)


@dataclass(frozen=True)
class NodeInfo:
    """What a node does (`role`) and which decoder layer it belongs to (None: outside the layers)."""

    role: Role
    layer: int | None = None


def info(node: torch.fx.Node) -> NodeInfo:
    return node.meta[META_KEY]


def annotate(node: torch.fx.Node, role: Role, layer: int | None = None) -> torch.fx.Node:
    node.meta[META_KEY] = NodeInfo(role, layer)
    return node


def nodes_with_role(graph: torch.fx.Graph, role: Role) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if META_KEY in n.meta and n.meta[META_KEY].role is role]


def placeholder(graph: torch.fx.Graph, name: str) -> torch.fx.Node | None:
    for node in graph.nodes:
        if node.op == "placeholder" and node.target == name:
            return node
    return None
