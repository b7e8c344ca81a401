"""Qwen2: the Llama layout with q/k/v biases (carried by the projections themselves); a sliding
window only when the config turns it on (`use_sliding_window`)."""

from __future__ import annotations

from specpass.ir.families.base import Family
from specpass.ir.families.llama import llama_layout


def qwen2_window(config) -> int | None:
    return config.sliding_window if getattr(config, "use_sliding_window", False) else None


FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    modeling_module="transformers.models.qwen2.",
    parts=llama_layout,
    sliding_window=qwen2_window,
)
