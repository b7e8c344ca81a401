"""Qwen2-MoE: Qwen2's block (q/k/v biases, sliding-window layers) with a mixture of experts on the layers
HF makes sparse (`decoder_sparse_step`, `mlp_only_layers`; the others keep a dense MLP), each beside a
shared expert scaled by a sigmoid gate; top-k weights renormalised as `norm_topk_prob` says."""

from __future__ import annotations

from .base import Family, Routing

FAMILY = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    modeling_module="transformers.models.qwen2_moe.",
    routing=Routing(),
)
