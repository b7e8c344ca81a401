"""A Llama-style decoder layer over a draft's own KV cache: Clover's Augmenting Block and Chimera's
full-context decoder are one each. Rotary positions at the target's base; it can start as a copy of
one of the target's layers with its two output projections zeroed, so it begins as the identity on its
residual stream (`copy_target_layer`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .feature_draft import FeatureDraftConfig, RMSNorm, rotary
from ..ir.decode_step import ApplyRope


class DraftDecoderLayer(nn.Module):
    """Pre-norm causal self-attention over the draft's cache, then a gated-SiLU MLP, both residual."""

    def __init__(self, config: FeatureDraftConfig):
        super().__init__()
        self.config = config
        h, heads, kv, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.input_norm = RMSNorm(h, config.rms_eps)
        self.q_proj = nn.Linear(h, heads * dim, bias=False)
        self.k_proj = nn.Linear(h, kv * dim, bias=False)
        self.v_proj = nn.Linear(h, kv * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, h, bias=False)
        self.mlp_norm = RMSNorm(h, config.rms_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.rope = ApplyRope(dim, dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, past_keys: torch.Tensor, past_values: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """x [B, T, H] at positions [B, T] after a cache past_keys, past_values [B, nkv, S, d], attending
        where mask [B or 1, T, S + T] -> (outputs [B, T, H], keys, values [B, nkv, S + T, d])."""
        c = self.config
        b, t, _ = x.shape
        normed = self.input_norm(x)
        q = self.q_proj(normed).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)  # [B, nh, T, d]
        k = self.k_proj(normed).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, nkv, T, d]
        v = self.v_proj(normed).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rotary(positions, c.head_dim, c.rope_theta, q.dtype)  # [B, T, d]
        q, k = self.rope(q, k, cos, sin)
        keys, values = torch.cat((past_keys, k), 2), torch.cat((past_values, v), 2)
        groups = c.num_heads // c.num_kv_heads
        attended = F.scaled_dot_product_attention(q, keys.repeat_interleave(groups, 1),
                                                  values.repeat_interleave(groups, 1), attn_mask=mask[:, None])  # fmt: skip
        hidden = x + self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        mlp_in = self.mlp_norm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in)), keys, values


@torch.no_grad()
def copy_target_layer(layer: DraftDecoderLayer, model: nn.Module, index: int) -> None:
    """`layer` from the target's decoder layer `index` where their weights have the same shapes (a
    Llama-style layer), then its attention and MLP output projections zeroed: the identity to start."""
    sources = {"input_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
               **{f"{p}.weight": f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
               **{f"{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}}  # fmt: skip
    target = model.model.layers[index].state_dict()
    for name, param in layer.named_parameters():
        source = target.get(sources.get(name, ""))
        if source is not None and source.shape == param.shape:
            param.copy_(source.float())
    layer.o_proj.weight.zero_()
    layer.down_proj.weight.zero_()
