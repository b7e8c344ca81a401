"""Qwen2: the Llama block with q/k/v biases (inside HF's projections). With `use_sliding_window` the
layers from `max_window_layers` on attend through a sliding window (`config.layer_types`)."""

from __future__ import annotations

from .base import Family

FAMILY = Family(name="qwen2", architectures=("Qwen2ForCausalLM",), modeling_module="transformers.models.qwen2.")
