"""OLMo 2: norms after attention and after the MLP instead of before (`post_attention_layernorm`,
`post_feedforward_layernorm` on the sub-layer outputs), and RMSNorms of queries and keys over the
whole projection (all heads at once) before rotary."""

from __future__ import annotations

from .base import Block, Family

FAMILY = Family(
    name="olmo2",
    architectures=("Olmo2ForCausalLM",),
    modeling_module="transformers.models.olmo2.",
    block=Block(
        attention_norm=None,
        attention_out_norm="post_attention_layernorm",
        mlp_norm=None,
        mlp_out_norm="post_feedforward_layernorm",
        qk_norm="projection",
    ),
)
