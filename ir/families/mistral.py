"""Mistral: the Llama layout with a sliding attention window (`config.sliding_window`, None for
full attention). specpass captures caches no longer than the window, so attention stays full."""

from __future__ import annotations

from specpass.ir.families.base import Family
from specpass.ir.families.llama import llama_layout


def mistral_window(config) -> int | None:
    return getattr(config, "sliding_window", None)


FAMILY = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    modeling_module="transformers.models.mistral.",
    parts=llama_layout,
    sliding_window=mistral_window,
)
