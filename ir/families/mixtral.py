"""Mixtral: Mistral's block with a mixture of experts for the MLP: softmax over the router's logits, the
top k renormalised, and the weights kept in float32 where they scale the experts' outputs."""

from __future__ import annotations

from .base import Family, Routing

FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    modeling_module="transformers.models.mixtral.",
    window_on_every_layer=True,
    routing=Routing(normalize=True, weights_in_float32=True),
)
