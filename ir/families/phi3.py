"""Phi-3: the Llama block with one fused q/k/v projection (`qkv_proj`, split [q | k | v]) and a
fused gate/up MLP (inside HF's MLP), partial rotary where the config asks for it; su/longrope
scaling is exact up to the original context length (past it HF switches tables mid-sequence);
`config.sliding_window` applies to every layer."""

from __future__ import annotations

from .base import Block, Family

FAMILY = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    modeling_module="transformers.models.phi3.",
    block=Block(fused_qkv="qkv_proj"),
    window_on_every_layer=True,
)
