"""Tiny random-weight models of every supported family, as HF's own model tests build them: the
conformance tests (tests/) and the family benchmark (benchmarks/families.py) run on them. Adding a
family to `specpass.ir.families` means adding its tiny config here."""

from __future__ import annotations

import torch
import transformers

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
WINDOW = 18  # sliding windows in tiny configs: shorter than the test prompts, longer than the test trees
IN_VOCAB = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # where a config's defaults exceed 96 tokens
LOCAL_AND_GLOBAL = ["sliding_attention", "full_attention"]  # layer 0 slides, layer 1 sees everything

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip  (16: positions past it are rescaled)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5], "long_factor": [2.0, 3.0, 4.0, 8.0]}

# arch -> (HF causal-LM class, config class, config arguments beyond TINY): every family and variant captured
TINY_CONFIGS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "llama3-rope": ("LlamaForCausalLM", "LlamaConfig", {"rope_scaling": LLAMA3_ROPE}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "qwen2-window": ("Qwen2ForCausalLM", "Qwen2Config",
                     {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": WINDOW}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 16}),  # head_dim != hidden / heads, as in Qwen3
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               {"head_dim": 8, "query_pre_attn_scalar": 16, "sliding_window": WINDOW, "layer_types": LOCAL_AND_GLOBAL,
                "attn_logit_softcapping": 1.0, "final_logit_softcapping": 5.0}),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW, "layer_types": LOCAL_AND_GLOBAL,
                "final_logit_softcapping": 5.0}),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {**IN_VOCAB, "partial_rotary_factor": 0.5}),
    "phi3-longrope": ("Phi3ForCausalLM", "Phi3Config", {**IN_VOCAB, "rope_scaling": LONGROPE,
                                                          "original_max_position_embeddings": 128}),  # exact below 128
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", IN_VOCAB),
    "granite": ("GraniteForCausalLM", "GraniteConfig",
                {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.1,
                 "logits_scaling": 4.0}),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {**IN_VOCAB, "no_rope_layers": [1, 0]}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",  # layer 0 dense (decoder_sparse_step 2), a shared expert
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 16, "head_dim": 16}),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", {**IN_VOCAB, "num_experts": 4, "num_experts_per_tok": 2,
                                                   "clip_qkv": 0.5}),
    "gpt-oss": ("GptOssForCausalLM", "GptOssConfig",  # sinks, alternating windows, clamped SwiGLU experts
                {**IN_VOCAB, "head_dim": 8, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "sliding_window": WINDOW, "layer_types": LOCAL_AND_GLOBAL,
                 "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 8}}),  # 256 / 8
}  # fmt: skip
TINY_ARCHS = tuple(TINY_CONFIGS)


def tiny_model(arch: str = "llama", seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random-weight model of `arch` (one of TINY_ARCHS), as HF's own model tests build them."""
    model_class, config_class, extra = TINY_CONFIGS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**(TINY | extra))
    return getattr(transformers, model_class)(config).eval()
