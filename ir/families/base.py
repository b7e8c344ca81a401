"""What a model family tells the capture: which submodules make up the decoder, and how its config reads.

A family is registered by one module in this package (`llama.py`, `qwen2.py`, `mistral.py`) that
builds a `Family` value; `families/__init__.py` lists them, and every support list (the capture's,
the torch.compile backend's) is derived from that list. `ir.decode_step` builds the static-cache
step from the `ModelParts` a family returns and never reaches into a model's attribute names itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LayerParts:
    """The HF submodules of one decoder layer, shared (never copied) by the captured step."""

    input_norm: nn.Module
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    post_attention_norm: nn.Module
    mlp: nn.Module
    attention_scale: float  # the softmax scale of the layer's attention


@dataclass(frozen=True)
class ModelParts:
    """The HF submodules of a decoder-only LM, in the order the decode step runs them."""

    embed_tokens: nn.Module
    rotary_emb: nn.Module  # provides inv_freq and attention_scaling (HF's rotary embedding)
    layers: tuple[LayerParts, ...]
    norm: nn.Module
    lm_head: nn.Module


@dataclass(frozen=True)
class Family:
    """One model family: the HF classes it covers and how to read them."""

    name: str
    architectures: tuple[str, ...]  # HF causal-LM class names
    modeling_module: str  # prefix of the HF modeling module ("transformers.models.llama.")
    parts: Callable[[nn.Module], ModelParts]  # the model's submodules
    sliding_window: Callable[[object], int | None]  # the config's attention window (None: full attention)
