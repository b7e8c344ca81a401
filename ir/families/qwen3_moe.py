"""Qwen3-MoE: Qwen3's block (per-head q/k RMSNorms) with a mixture of experts for the MLP and no shared
expert; `config.sliding_window` (None unless `use_sliding_window`) applies to every layer."""

from __future__ import annotations

from .base import Block, Family, Routing

FAMILY = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    modeling_module="transformers.models.qwen3_moe.",
    block=Block(qk_norm="head"),
    window_on_every_layer=True,
    routing=Routing(),
)
