"""Llama: pre-norm decoder blocks (RMSNorm), rotary attention with separate q/k/v/o projections
(grouped-query when num_key_value_heads < num_attention_heads), a gated MLP, full attention."""

from __future__ import annotations

from torch import nn

from specpass.ir.families.base import Family, LayerParts, ModelParts


def llama_layout(model: nn.Module) -> ModelParts:
    """The submodules of a Llama-layout model (`model.model.{embed_tokens, rotary_emb, layers, norm}`,
    `model.lm_head`); Qwen2 and Mistral share this layout."""
    inner = model.model
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    layers = tuple(
        LayerParts(
            input_norm=layer.input_layernorm,
            q_proj=layer.self_attn.q_proj,
            k_proj=layer.self_attn.k_proj,
            v_proj=layer.self_attn.v_proj,
            o_proj=layer.self_attn.o_proj,
            post_attention_norm=layer.post_attention_layernorm,
            mlp=layer.mlp,
            attention_scale=float(getattr(layer.self_attn, "scaling", head_dim**-0.5)),
        )
        for layer in inner.layers
    )
    return ModelParts(inner.embed_tokens, inner.rotary_emb, layers, inner.norm, model.lm_head)


def full_attention(config) -> int | None:
    return None


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    modeling_module="transformers.models.llama.",
    parts=llama_layout,
    sliding_window=full_attention,
)
