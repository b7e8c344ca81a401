"""Llama: the reference block. Pre-norm (RMSNorm before attention and before the MLP), rotary
attention with separate q/k/v/o projections (grouped-query when there are fewer K/V heads), a gated
MLP, full attention on every layer. Llama 3.x rope scaling lives in HF's rotary table, read as is."""

from __future__ import annotations

from .base import Family

FAMILY = Family(name="llama", architectures=("LlamaForCausalLM",), modeling_module="transformers.models.llama.")
