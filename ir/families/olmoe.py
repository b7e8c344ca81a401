"""OLMoE: the Llama block with RMSNorms of queries and keys over the whole projection, q/k/v clamped
to `clip_qkv` where the config sets it, and a mixture of experts for the MLP (top-k weights as
`norm_topk_prob` says)."""

from __future__ import annotations

from .base import Block, Family, Routing, Scalars

FAMILY = Family(
    name="olmoe",
    architectures=("OlmoeForCausalLM",),
    modeling_module="transformers.models.olmoe.",
    block=Block(qk_norm="projection"),
    scalars=Scalars(qkv_clip="clip_qkv"),
    window_on_every_layer=True,
    routing=Routing(),
)
