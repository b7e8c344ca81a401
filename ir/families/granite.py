"""Granite: the Llama block with multipliers: embeddings times `embedding_multiplier`, each
sub-layer's output times `residual_multiplier`, the softmax scale `attention_multiplier` (HF's
`scaling`), logits divided by `logits_scaling`."""

from __future__ import annotations

from .base import Family, Scalars

FAMILY = Family(
    name="granite",
    architectures=("GraniteForCausalLM",),
    modeling_module="transformers.models.granite.",
    scalars=Scalars(
        embedding_multiplier="embedding_multiplier",
        residual_multiplier="residual_multiplier",
        logits_divisor="logits_scaling",
    ),
)
