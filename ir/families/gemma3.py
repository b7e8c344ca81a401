"""Gemma 3 (text): the Gemma 2 block with per-head (1 + w) RMSNorms of queries and keys instead of
attention soft-capping, and two rotary tables: the local one on sliding-window layers, the global
one (possibly scaled) on full-attention layers."""

from __future__ import annotations

from dataclasses import replace

from .base import Family, Scalars
from .gemma2 import GEMMA_BLOCK

FAMILY = Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    modeling_module="transformers.models.gemma3.",
    block=replace(GEMMA_BLOCK, qk_norm="head"),
    scalars=Scalars(final_logit_softcap="final_logit_softcapping"),
)
