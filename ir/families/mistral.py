"""Mistral: the Llama block; `config.sliding_window` (None: full attention) applies to every layer."""

from __future__ import annotations

from .base import Family

FAMILY = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    modeling_module="transformers.models.mistral.",
    window_on_every_layer=True,
)
