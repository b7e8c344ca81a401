"""gpt-oss: biased q/k/v/o projections, attention sinks (a learned logit per head in the softmax's
denominator, `self_attn.sinks`), sliding-window layers alternating with full ones (`config.layer_types`),
YaRN rotary, and a mixture of experts whose router (biased) takes the top k logits before its softmax,
whose experts are biased, stored [E, in, out] with interleaved gate / up columns and gated by a clamped
SwiGLU (read from HF's experts module)."""

from __future__ import annotations

from .base import Family, Routing

FAMILY = Family(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    modeling_module="transformers.models.gpt_oss.",
    routing=Routing(normalize=False, softmax_first=False),
)
