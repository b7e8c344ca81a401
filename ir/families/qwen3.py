"""Qwen3: the Llama block plus an RMSNorm of each query and key head before rotary (`q_norm`,
`k_norm` over the head dimension), no q/k/v biases; sliding-window layers as in Qwen2."""

from __future__ import annotations

from .base import Block, Family

FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    modeling_module="transformers.models.qwen3.",
    block=Block(qk_norm="head"),
)
