"""A decoder-only LM's decode step over a static KV cache, written as plain torch so that FX can trace it.

The module reuses the Hugging Face model's own submodules, as its family lists them (`ir.families`:
embedding, projections, norms, MLPs, LM head): weights are shared, never copied, and every
numerically relevant op follows the HF modeling code so that float32 greedy decoding matches HF
token for token. The capture assigns roles by this module's own attribute names (`q_proj`,
`input_layernorm`, `mlp`, ...), never by the HF classes' names.

Inputs of `DecodeStep.forward`:
    input_ids  [B, T]  int64   tokens to run
    positions  [B, T]  int64   rotary positions of those tokens
    kv_len     int             how many cache slots attention reads (slots [0, kv_len))
Outputs: logits [B, T, V] and the final normed hidden states [B, T, H].

The captured (un-rewritten) step is a *chain* step: token t is written into cache slot positions[0, t]
and attends to every slot <= its own position. `rewrites.TreeAttention` generalises that to trees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpass.ir.arch import ArchSpec
from specpass.ir.families import LayerParts, ModelParts


class RotaryPositions(nn.Module):
    """cos/sin tables for `positions`, computed exactly like HF's rotary embedding."""

    def __init__(self, rotary_emb: nn.Module):
        super().__init__()
        self.register_buffer("inv_freq", rotary_emb.inv_freq, persistent=False)
        self.scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].float()  # [1, D/2, 1]
        pos = positions[:, None, :].float()  # [B, 1, T]
        freqs = (inv @ pos).transpose(1, 2)  # [B, T, D/2] (the matmul broadcasts over B)
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        cos = (emb.cos() * self.scaling).to(dtype)
        sin = (emb.sin() * self.scaling).to(dtype)
        return cos, sin


class ApplyRope(nn.Module):
    def forward(self, q, k, cos, sin):  # q [B, H, T, D], k [B, KV, T, D], cos/sin [B, T, D]
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class CausalMask(nn.Module):
    """Chain mask: query t sees cache slot s iff s <= positions[b, t]."""

    def forward(self, positions: torch.Tensor, kv_len) -> torch.Tensor:
        key_slots = torch.arange(kv_len, device=positions.device)  # [S]
        visible = key_slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
        return visible.unsqueeze(1)  # [B, 1, T, S]


class CacheSlots(nn.Module):
    """Cache slots the step writes to: in a chain, the tokens' positions (shared across the batch)."""

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return positions[0]  # [T]


class CacheWrite(nn.Module):
    def forward(self, cache, slots, new):  # cache [B, KV, S_max, D], slots [T], new [B, KV, T, D]
        return cache.index_copy_(2, slots, new)


class AttentionCore(nn.Module):
    """Grouped-query attention: SDPA reads each K/V head for its group of query heads
    (`enable_gqa`), so the visible cache is never copied per query head."""

    def __init__(self, groups: int, scale: float):
        super().__init__()
        self.gqa = groups > 1
        self.scale = scale

    def forward(self, q, k, v, mask):  # q [B, H, T, D], k/v [B, KV, S, D], mask [B, 1, T, S]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.gqa)


class Attention(nn.Module):
    def __init__(self, parts: LayerParts, spec: ArchSpec):
        super().__init__()
        self.q_proj, self.k_proj = parts.q_proj, parts.k_proj
        self.v_proj, self.o_proj = parts.v_proj, parts.o_proj
        self.head_dim = spec.head_dim
        self.rope = ApplyRope()
        self.k_write = CacheWrite()
        self.v_write = CacheWrite()
        self.core = AttentionCore(spec.kv_groups, parts.attention_scale)

    def forward(self, x, cos, sin, mask, slots, kv_len, k_cache, v_cache):  # x [B, T, H*D]
        b, t = x.shape[0], x.shape[1]
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, KV, T, D]
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, KV, T, D]
        q, k = self.rope(q, k, cos, sin)
        keys = self.k_write(k_cache, slots, k)[:, :, :kv_len]  # [B, KV, S, D]
        values = self.v_write(v_cache, slots, v)[:, :, :kv_len]  # [B, KV, S, D]
        out = self.core(q, keys, values, mask)  # [B, H, T, D]
        out = out.transpose(1, 2).contiguous().reshape(b, t, -1)  # [B, T, H*D]
        return self.o_proj(out)


class DecoderBlock(nn.Module):
    def __init__(self, parts: LayerParts, spec: ArchSpec):
        super().__init__()
        self.input_layernorm = parts.input_norm
        self.self_attn = Attention(parts, spec)
        self.post_attention_layernorm = parts.post_attention_norm
        self.mlp = parts.mlp

    def forward(self, h, cos, sin, mask, slots, kv_len, k_cache, v_cache):  # h [B, T, H]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, slots, kv_len, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecodeStep(nn.Module):
    """One forward of the target model over T tokens, reading and writing a static KV cache."""

    def __init__(self, parts: ModelParts, spec: ArchSpec, k_cache: torch.Tensor, v_cache: torch.Tensor):
        super().__init__()
        self.embed_tokens = parts.embed_tokens
        self.rotary = RotaryPositions(parts.rotary_emb)
        self.mask = CausalMask()
        self.cache_slots = CacheSlots()
        self.layers = nn.ModuleList(DecoderBlock(layer, spec) for layer in parts.layers)
        self.norm = parts.norm
        self.lm_head = parts.lm_head
        self.register_buffer("k_cache", k_cache, persistent=False)  # [L, B, KV, S_max, D]
        self.register_buffer("v_cache", v_cache, persistent=False)  # [L, B, KV, S_max, D]

    def forward(self, input_ids, positions, kv_len):
        h = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rotary(positions, h.dtype)
        mask = self.mask(positions, kv_len)  # [B, 1, T, S]
        slots = self.cache_slots(positions)  # [T]
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, slots, kv_len, self.k_cache[i], self.v_cache[i])
        hidden = self.norm(h)  # [B, T, H]
        return self.lm_head(hidden), hidden  # [B, T, V], [B, T, H]
