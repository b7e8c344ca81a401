"""Gemma 2: (1 + w) RMSNorms before and after both attention and the MLP, embeddings scaled by
sqrt(hidden) (inside HF's embedding), attention logits soft-capped (`attn_logit_softcapping`, the
softmax scale from `query_pre_attn_scalar`), final logits soft-capped, and sliding-window layers
interleaved with global ones (`config.layer_types`)."""

from __future__ import annotations

from .base import Block, Family, Scalars

GEMMA_BLOCK = Block(
    attention_norm="input_layernorm",
    attention_out_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    mlp_out_norm="post_feedforward_layernorm",
)

FAMILY = Family(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    modeling_module="transformers.models.gemma2.",
    block=GEMMA_BLOCK,
    scalars=Scalars(final_logit_softcap="final_logit_softcapping"),
)
