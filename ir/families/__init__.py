"""The family registry: every model family specpass captures, one module each.

Adding a family = one new module describing it as a `Family` (how its block differs from Llama's)
and one entry in FAMILIES; the support lists below (and the error messages naming them) follow.
"""

from __future__ import annotations

from torch import nn

from ...common.errors import UnsupportedArchitectureError
from . import (
    gemma2, gemma3, gpt_oss, granite, llama, mistral, mixtral, olmo2, olmoe, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, smollm3,
)  # fmt: skip
from .base import (
    AttentionParts, Block, Family, LayerParts, MixtureParts, ModelParts, Rotary, Routing, Scalars,
)  # fmt: skip

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    mistral.FAMILY,
    qwen3.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    olmo2.FAMILY,
    granite.FAMILY,
    smollm3.FAMILY,
    mixtral.FAMILY,
    qwen2_moe.FAMILY,
    qwen3_moe.FAMILY,
    olmoe.FAMILY,
    gpt_oss.FAMILY,
)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.architectures)
MODELING_MODULES: tuple[str, ...] = tuple(f.modeling_module for f in FAMILIES)


def family_named(architecture: str) -> Family:
    """The family of a HF causal-LM class name; UnsupportedArchitectureError names the supported ones."""
    for family in FAMILIES:
        if architecture in family.architectures:
            return family
    raise UnsupportedArchitectureError(
        f"specpass cannot capture {architecture!r}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def family_of(model: nn.Module) -> Family:
    return family_named(type(model).__name__)


__all__ = ["FAMILIES", "MODELING_MODULES", "SUPPORTED_ARCHITECTURES", "AttentionParts", "Block", "Family",
           "LayerParts", "MixtureParts", "ModelParts", "Rotary", "Routing", "Scalars", "family_named", "family_of"]
