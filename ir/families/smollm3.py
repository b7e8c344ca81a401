"""SmolLM3: the Llama block where some layers use no rotary at all (`config.no_rope_layers`, read
from HF's `self_attn.use_rope`: by default every fourth layer is NoPE); sliding-window layers as in
Qwen2 when the config turns them on."""

from __future__ import annotations

from .base import Family

FAMILY = Family(name="smollm3", architectures=("SmolLM3ForCausalLM",), modeling_module="transformers.models.smollm3.")
