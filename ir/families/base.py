"""What a model family tells the capture, as data: how its decoder block differs from Llama's.

Every supported family is a pre-norm rotary decoder. `Block` names the HF attributes of a layer's norms
by where they sit, a fused q/k/v projection, and q/k norms per head or over the whole projection;
`Scalars` names the config attributes of its multipliers (embedding, residual, logits) and clamps;
`Routing` says how a mixture-of-experts family routes (None: a dense family). Everything else
is read from the HF modules the same way for every family (`decoder_parts`: softmax scale, soft-capping,
rotary or not, sliding window, the rotary table per layer type), and ir.decode_step builds the step from
the `ModelParts` returned, never reaching into a model's attribute names itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn


QKNorm = Literal["none", "head", "projection"]


@dataclass(frozen=True)
class Rotary:
    """One rotary table: HF's inverse frequencies and cos/sin scaling, and how far they are exact.

    `exact_positions` is set for rope types whose HF frequencies change with the sequence length
    (dynamic NTK, longrope): below it HF uses the original frequencies, which the step bakes in.
    """

    inv_freq: torch.Tensor  # [D_rot / 2] float32 (D_rot < head_dim for partial rotary)
    scaling: float  # cos/sin multiplier (HF's attention_scaling)
    exact_positions: int | None = None  # None: the table holds at every position


@dataclass(frozen=True)
class AttentionParts:
    """The HF submodules of one layer's attention and the constants that shape it."""

    q_proj: nn.Module | None  # separate projections, or
    k_proj: nn.Module | None
    v_proj: nn.Module | None
    qkv_proj: nn.Module | None  # one fused projection whose output is [q | k | v]
    o_proj: nn.Module
    q_norm: nn.Module | None  # RMSNorm of the queries before rotary, if any
    k_norm: nn.Module | None
    qk_norm: QKNorm  # "head": over each head's D dims (Qwen3, Gemma 3); "projection": over all heads (OLMo 2)
    scale: float  # softmax scale
    softcap: float | None  # attention-logit soft-capping: cap * tanh(scores / cap) (Gemma 2)
    window: int | None  # sliding window: query at p sees keys at p - window < position <= p
    rotary: int | None  # index into ModelParts.rotaries; None: the layer uses no rotary (NoPE)
    clip: float | None = None  # q, k and v clamped to [-clip, clip] after the q/k norms (OLMoE's clip_qkv)
    sinks: nn.Parameter | None = None  # [H]: a learned logit per head in the softmax's denominator (gpt-oss)


@dataclass(frozen=True)
class MixtureParts:
    """The HF parameters of one mixture-of-experts MLP (ir.mixture), shared, never copied:

        out = sum over the token's top_k experts e of weight_e * down_e(glu(gate_up_e(x)))
              + sigmoid(shared_gate(x)) * shared_expert(x)      (where the family has a shared expert)

    glu: activation(gate) * up over [gate | up] (`clamp` None), or gpt-oss's clamped SwiGLU over
    interleaved gate / up columns, (up + 1) * gate * sigmoid(alpha * gate), gate <= limit and
    |up| <= limit (`clamp` = (alpha, limit)). The weights: `Routing`'s order, top_k, renormalised
    if `normalize`, in the model's dtype unless `weights_in_float32`."""

    router: nn.Parameter  # [E, H]
    router_bias: nn.Parameter | None  # [E]
    gate_up: nn.Parameter  # [E, 2I, H], or [E, H, 2I] when `transposed`
    gate_up_bias: nn.Parameter | None  # [E, 2I]
    down: nn.Parameter  # [E, H, I], or [E, I, H] when `transposed`
    down_bias: nn.Parameter | None  # [E, H]
    transposed: bool  # the experts' weights stored [E, in, out] (gpt-oss)
    activation: nn.Module | None  # HF's act_fn (None with `clamp`)
    clamp: tuple[float, float] | None  # (alpha, limit) of gpt-oss's clamped SwiGLU
    top_k: int
    softmax_first: bool
    normalize: bool
    weights_in_float32: bool
    shared_expert: nn.Module | None = None  # a dense MLP every token runs (Qwen2-MoE)
    shared_gate: nn.Module | None = None  # nn.Linear [1, H]: the shared expert's sigmoid gate


@dataclass(frozen=True)
class LayerParts:
    """The HF submodules of one decoder layer, shared (never copied) by the captured step:

        h = h + residual_scale * attention_out_norm(attention(attention_norm(h)))
        h = h + residual_scale * mlp_out_norm(mlp(mlp_norm(h)))

    with any norm that is None left out."""

    attention_norm: nn.Module | None
    attention: AttentionParts
    attention_out_norm: nn.Module | None
    mlp_norm: nn.Module | None
    mlp: nn.Module | MixtureParts  # a dense MLP (HF's module, run as it is) or a mixture of experts
    mlp_out_norm: nn.Module | None
    residual_scale: float = 1.0


@dataclass(frozen=True)
class ModelParts:
    """The HF submodules of a decoder-only LM, in the order the decode step runs them:

        logits = softcap(lm_head(norm(layers(embed_tokens(ids) * embed_scale))) / logit_divisor)"""

    embed_tokens: nn.Module
    rotaries: tuple[Rotary, ...]
    layers: tuple[LayerParts, ...]
    norm: nn.Module
    lm_head: nn.Module
    embed_scale: float = 1.0
    logit_divisor: float = 1.0
    logit_softcap: float | None = None


@dataclass(frozen=True)
class Block:
    """Where a family's decoder layer differs from Llama's: the HF attribute names of its norms
    (None: the layer has no such norm) and of its projections."""

    attention_norm: str | None = "input_layernorm"
    attention_out_norm: str | None = None
    mlp_norm: str | None = "post_attention_layernorm"
    mlp_out_norm: str | None = None
    fused_qkv: str | None = None  # attribute of a fused q/k/v projection (Phi-3: "qkv_proj")
    qk_norm: QKNorm = "none"


@dataclass(frozen=True)
class Scalars:
    """Config attribute names of a family's multipliers (None: the family has none)."""

    embedding_multiplier: str | None = None  # embeddings are multiplied by it (Granite)
    residual_multiplier: str | None = None  # each sub-layer's output is multiplied by it (Granite)
    logits_divisor: str | None = None  # logits are divided by it (Granite's logits_scaling)
    final_logit_softcap: str | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    qkv_clip: str | None = None  # q, k, v clamped to [-clip, clip] (OLMoE's clip_qkv)


@dataclass(frozen=True)
class Routing:
    """How a mixture-of-experts family weighs a token's experts (its HF router's code, as data).
    A layer is a mixture where HF's `layer.mlp` has `experts`; other layers stay dense (Qwen2-MoE's
    `mlp_only_layers`)."""

    normalize: bool | str = "norm_topk_prob"  # top-k weights over their sum: always, or as this config attribute says
    weights_in_float32: bool = False  # weights scale the experts' outputs in float32 (Mixtral), else in the model dtype
    softmax_first: bool = True  # softmax over all experts, then top k; False: top-k logits, then their softmax (gpt-oss)


@dataclass(frozen=True)
class Family:
    """One model family: the HF classes it covers and how its decoder differs from Llama's."""

    name: str
    architectures: tuple[str, ...]  # HF causal-LM class names
    modeling_module: str  # prefix of the HF modeling module ("transformers.models.llama.")
    block: Block = field(default_factory=Block)
    scalars: Scalars = field(default_factory=Scalars)
    window_on_every_layer: bool = False  # config.sliding_window applies to all layers (Mistral, Phi-3)
    routing: Routing | None = None  # a mixture-of-experts family (Mixtral, Qwen2/3-MoE, OLMoE)

    def parts(self, model: nn.Module) -> ModelParts:
        return decoder_parts(model, self)

    def layer_windows(self, config) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), as HF's masks apply them."""
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and not self.window_on_every_layer:
            return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
        return (window if self.window_on_every_layer else None,) * config.num_hidden_layers


def decoder_parts(model: nn.Module, family: Family) -> ModelParts:
    """The submodules of a HF decoder (`model.model.{embed_tokens, rotary_emb, layers, norm}`,
    `model.lm_head`) laid out as `family` describes."""
    inner, config, block = model.model, model.config, family.block
    rotaries, rotary_of_type = _rotaries(inner.rotary_emb, config)
    windows = family.layer_windows(config)
    layer_types = getattr(config, "layer_types", None)
    residual = _scalar(config, family.scalars.residual_multiplier, 1.0)
    layers = []
    for index, layer in enumerate(inner.layers):
        attn = layer.self_attn
        uses_rope = bool(getattr(attn, "use_rope", True))
        rotary_type = layer_types[index] if rotary_of_type and layer_types is not None else None
        attention = AttentionParts(
            q_proj=None if block.fused_qkv else attn.q_proj,
            k_proj=None if block.fused_qkv else attn.k_proj,
            v_proj=None if block.fused_qkv else attn.v_proj,
            qkv_proj=getattr(attn, block.fused_qkv) if block.fused_qkv else None,
            o_proj=attn.o_proj,
            q_norm=attn.q_norm if block.qk_norm != "none" else None,
            k_norm=attn.k_norm if block.qk_norm != "none" else None,
            qk_norm=block.qk_norm,
            scale=float(attn.scaling),
            softcap=getattr(attn, "attn_logit_softcapping", None),
            window=windows[index],
            rotary=(rotary_of_type[rotary_type] if rotary_of_type else 0) if uses_rope else None,
            clip=_scalar(config, family.scalars.qkv_clip, None),
            sinks=getattr(attn, "sinks", None),
        )
        layers.append(
            LayerParts(
                attention_norm=_norm(layer, block.attention_norm),
                attention=attention,
                attention_out_norm=_norm(layer, block.attention_out_norm),
                mlp_norm=_norm(layer, block.mlp_norm),
                mlp=_mixture(layer.mlp, config, family.routing) if hasattr(layer.mlp, "experts") else layer.mlp,
                mlp_out_norm=_norm(layer, block.mlp_out_norm),
                residual_scale=residual,
            )
        )
    scalars = family.scalars
    return ModelParts(
        embed_tokens=inner.embed_tokens,
        rotaries=rotaries,
        layers=tuple(layers),
        norm=inner.norm,
        lm_head=model.lm_head,
        embed_scale=_scalar(config, scalars.embedding_multiplier, 1.0),
        logit_divisor=_scalar(config, scalars.logits_divisor, 1.0),
        logit_softcap=_scalar(config, scalars.final_logit_softcap, None),
    )


def _mixture(mlp: nn.Module, config, routing: Routing | None) -> MixtureParts:
    """A HF mixture-of-experts block (its router `gate` or `router`; `experts` with stacked weights as
    HF's experts implementations describe them: `is_transposed`, `is_concatenated`, `has_bias`; an
    optional `shared_expert` with its `shared_expert_gate`) as MixtureParts."""
    if routing is None:
        raise AssertionError(f"{type(mlp).__name__} has experts, but its family names no routing")
    router = mlp.gate if hasattr(mlp, "gate") else mlp.router
    experts = mlp.experts
    clamped = hasattr(experts, "limit")  # gpt-oss's clamped SwiGLU (older transformers lack the layout flags)
    clamp = (float(experts.alpha), float(experts.limit)) if clamped else None
    if getattr(experts, "is_concatenated", not clamped) == clamped:
        raise AssertionError(f"{type(experts).__name__}: a gate layout the capture does not know")
    biased = hasattr(experts, "gate_up_proj_bias")
    normalize = routing.normalize if isinstance(routing.normalize, bool) else bool(getattr(config, routing.normalize))
    return MixtureParts(
        router=router.weight,
        router_bias=getattr(router, "bias", None),
        gate_up=experts.gate_up_proj,
        gate_up_bias=experts.gate_up_proj_bias if biased else None,
        down=experts.down_proj,
        down_bias=experts.down_proj_bias if biased else None,
        transposed=getattr(experts, "is_transposed", clamped),
        activation=getattr(experts, "act_fn", None) if clamp is None else None,
        clamp=clamp,
        top_k=int(router.top_k),
        softmax_first=routing.softmax_first,
        normalize=normalize,
        weights_in_float32=routing.weights_in_float32,
        shared_expert=getattr(mlp, "shared_expert", None),
        shared_gate=getattr(mlp, "shared_expert_gate", None),
    )


def _norm(layer: nn.Module, name: str | None) -> nn.Module | None:
    return None if name is None else getattr(layer, name)


def _scalar(config, name: str | None, default):
    value = getattr(config, name, None) if name is not None else None
    return default if value is None else float(value)


def _rotaries(rotary_emb: nn.Module, config) -> tuple[tuple[Rotary, ...], dict[str, int]]:
    """The rotary tables of a HF rotary embedding: one (`inv_freq`), or one per layer type
    (`{type}_inv_freq`, Gemma 3's local and global tables) with the index of each type."""
    kinds = getattr(rotary_emb, "layer_types", None)
    if kinds is None:
        return (_rotary(rotary_emb, config, rotary_emb.rope_type, ""),), {}
    tables = tuple(_rotary(rotary_emb, config, rotary_emb.rope_type[kind], f"{kind}_") for kind in kinds)
    return tables, {kind: i for i, kind in enumerate(kinds)}


def _rotary(rotary_emb: nn.Module, config, rope_type: str, prefix: str) -> Rotary:
    params = config.rope_parameters or {}
    params = params.get(prefix[:-1]) or {} if prefix else params  # per layer type (Gemma 3)
    exact = None
    if "longrope" in rope_type:  # HF switches to the long factors past the original length
        exact = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
    elif "dynamic" in rope_type:  # HF rescales past max_position_embeddings
        exact = config.max_position_embeddings
    inv_freq = getattr(rotary_emb, f"{prefix}original_inv_freq", None)  # never the length-updated table
    if inv_freq is None:
        inv_freq = getattr(rotary_emb, f"{prefix}inv_freq")
    scaling = getattr(rotary_emb, f"{prefix}attention_scaling", None)
    scaling = getattr(rotary_emb, "attention_scaling", 1.0) if scaling is None else scaling
    return Rotary(inv_freq, float(scaling), exact)
