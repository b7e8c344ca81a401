"""Capture a HF causal LM into one annotated FX graph of a static-cache decode step."""

from __future__ import annotations

import copy

import torch
import torch.fx
from torch import nn

from ..common.errors import InvalidParameterError
from . import decode_step as ds
from . import mixture, ops
from .arch import ArchSpec, arch_spec
from .draft import SIDE_GRAPHS
from .families import ModelParts, family_of
from .roles import META_KEY, NodeInfo, Role
from .verify import verify

ARCH_META = "specpass_arch"
GGUF_META = "specpass_gguf"  # the GGUF file the model was loaded from (specpass.models), or None
GGUF_ATTRIBUTE = "specpass_gguf_file"  # where specpass.models records that file on a loaded model
PARTS_META = "specpass_parts"  # the model's own submodules (ir.families.ModelParts), for passes that reuse them

_MODULE_ROLES: dict[type, Role] = {
    ds.RotaryPositions: Role.ROPE,
    ds.ApplyRope: Role.ROPE,
    ds.CausalMask: Role.MASK,
    ds.EmbedScaling: Role.EMBED,
    ds.LogitScaling: Role.LM_HEAD,
    ds.CacheSlots: Role.CACHE_INDEX,
    ds.AttentionCore: Role.ATTENTION,
    ds.Attention: Role.ATTENTION,
    ds.DecoderBlock: Role.RESIDUAL,
    mixture.Expert: Role.EXPERT,
}
_FUNCTION_ROLES = {  # ir.ops functions, kept as single nodes
    ops.sliding_window_visibility: Role.MASK,
    ops.softcapped_attention: Role.ATTENTION,
    ops.sink_attention: Role.ATTENTION,
    ops.write_cache: Role.CACHE_WRITE,
}
_NAMED_ROLES = {  # attribute names of the family's submodules in ds.DecodeStep
    "embed_tokens": Role.EMBED,
    "qkv_proj": Role.QKV,
    "q_proj": Role.Q,
    "k_proj": Role.K,
    "v_proj": Role.V,
    "o_proj": Role.O,
    "q_norm": Role.NORM,
    "k_norm": Role.NORM,
    "attention_norm": Role.NORM,
    "attention_out_norm": Role.NORM,
    "mlp_norm": Role.NORM,
    "mlp_out_norm": Role.NORM,
    "norm": Role.NORM,
    "mlp": Role.MLP,
    "router": Role.ROUTER,
    "shared_expert": Role.SHARED_EXPERT,
    "shared_expert_gate": Role.SHARED_EXPERT,
    "lm_head": Role.LM_HEAD,
}


def _role_of_module(name: str, module_type: type) -> Role | None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _NAMED_ROLES:
        return _NAMED_ROLES[leaf]
    return _MODULE_ROLES.get(module_type)


def _layer_of(path: str) -> int | None:
    parts = path.split(".")
    if "layers" in parts:
        return int(parts[parts.index("layers") + 1])
    return None


def _node_info(node: torch.fx.Node) -> NodeInfo:
    if node.op == "placeholder":
        return NodeInfo(Role.INPUT)
    if node.op == "output":
        return NodeInfo(Role.OUTPUT)
    if node.op == "get_attr" and node.target in ("k_cache", "v_cache"):
        return NodeInfo(Role.CACHE)
    stack = node.meta.get("nn_module_stack", {})
    layer, role = None, None
    for name, module_type in reversed(list(stack.values())):  # innermost first
        role = role or _role_of_module(name, module_type)
        layer = layer if layer is not None else _layer_of(name)
    if node.op == "call_function" and node.target in _FUNCTION_ROLES:
        role = _FUNCTION_ROLES[node.target]
    if role is None and node.op == "call_function" and any(
        isinstance(a, torch.fx.Node) and a.meta[META_KEY].role is Role.CACHE for a in node.args
    ):
        role = Role.CACHE  # self.k_cache[i]: the layer's view of the stacked cache
    if role is None:
        raise AssertionError(f"capture left node {node.format_node()} without a role")
    return NodeInfo(role, layer)


class _AnnotatingTracer(torch.fx.Tracer):
    """Traces through every module except torch.nn leaves (Linear, Embedding, activations).

    Buffers (the KV cache, rotary frequencies) become get_attr nodes, never baked-in constants.
    """

    proxy_buffer_attributes = True

    def __init__(self):
        super().__init__(autowrap_functions=ops.GRAPH_FUNCTIONS)


def capture(model: nn.Module, cache_size: int = 2048, batch_size: int = 1) -> torch.fx.GraphModule:
    """Capture `model` (a supported HF causal LM) as an annotated decode-step GraphModule.

    The static KV cache ([L, B, KV, cache_size, D] for keys and for values) lives in the module's
    buffers `k_cache` / `v_cache`; `gm.meta["specpass_arch"]` holds the model's ArchSpec and
    `gm.meta["specpass_parts"]` its family's ModelParts (`model_parts`); `gm.meta["specpass_gguf"]`
    the GGUF file specpass.models loaded the model from (None otherwise; the `gguf` lowering reads it).
    """
    spec = arch_spec(model)
    if cache_size < 2:
        raise InvalidParameterError(f"cache_size must be >= 2, got {cache_size}")
    if batch_size < 1:
        raise InvalidParameterError(f"batch_size must be >= 1, got {batch_size}")
    param = next(model.parameters())
    shape = (spec.num_layers, batch_size, spec.num_kv_heads, cache_size, spec.head_dim)
    k_cache = torch.zeros(shape, dtype=param.dtype, device=param.device)
    v_cache = torch.zeros(shape, dtype=param.dtype, device=param.device)
    parts = family_of(model).parts(model)
    for rotary in parts.rotaries:
        if rotary.exact_positions is not None and cache_size > rotary.exact_positions:
            raise InvalidParameterError(
                f"cache_size {cache_size} exceeds {rotary.exact_positions} positions, past which the model's "
                "rotary scaling changes its frequencies with the sequence length; use cache_size <= "
                f"{rotary.exact_positions}"
            )
    step = ds.DecodeStep(parts, spec, k_cache, v_cache).eval()
    tracer = _AnnotatingTracer()
    graph = tracer.trace(step)
    gm = torch.fx.GraphModule(step, graph, class_name="DecodeStepGraph")
    for node in gm.graph.nodes:
        node.meta[META_KEY] = _node_info(node)
    gm.meta[ARCH_META] = spec
    gm.meta[PARTS_META] = parts
    gm.meta[GGUF_META] = getattr(model, GGUF_ATTRIBUTE, None)
    verify(gm)
    return gm


def arch_of(gm: torch.fx.GraphModule) -> ArchSpec:
    return gm.meta[ARCH_META]


def model_parts(gm: torch.fx.GraphModule) -> ModelParts:
    """The captured model's own submodules (the step's graph inlines them; a draft graph that runs part
    of the model, e.g. its first layers, builds on these, so its weights are the model's)."""
    return gm.meta[PARTS_META]


def is_captured_step(gm: torch.fx.GraphModule) -> bool:
    return ARCH_META in getattr(gm, "meta", {})


def replace_node(node: torch.fx.Node, result: torch.fx.Node, added: tuple[torch.fx.Node | None, ...]) -> None:
    """Replace `node` by `result` in its graph, uses included; the nodes `added` for it (None skipped)
    take its annotations (meta)."""
    for new in added:
        if new is not None:
            new.meta.update(node.meta)
    node.replace_all_uses_with(result)
    node.graph.erase_node(node)


def copy_step(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule with a copied graph (node meta included) sharing gm's parameters, buffers
    and side graphs (draft, resume)."""
    new = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    new.meta.update(gm.meta)
    for name in SIDE_GRAPHS:  # not referenced by the verify graph, so GraphModule would drop them
        if hasattr(gm, name):
            new.add_submodule(name, getattr(gm, name))
    return new
