"""A decoder-only LM's decode step over a static KV cache, written as plain torch so that FX can trace it.

It reuses the HF model's own submodules as its family lists them (ir.families): weights shared, never
copied, every numerically relevant op following HF's code, so float32 greedy decoding matches HF token
for token. What differs between families is data in `ModelParts`: one step serves every family, and the
capture assigns roles by this module's own attribute names, never by HF class names.
`DecodeStep.forward(input_ids [B, T], positions [B, T], kv_len)` returns logits [B, T, V] and the final
normed hidden states [B, T, H], attending over cache slots [0, kv_len). The captured step is a chain
step: row b's token t writes slot positions[b, t] of cache row b and attends to every slot <= its
position; a step of B rows runs on the first B of the cache's rows. rewrites.TreeAttention generalises
that to trees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ArchSpec
from .families import AttentionParts, LayerParts, MixtureParts, ModelParts, Rotary
from .mixture import MixtureOfExperts
from .ops import sink_attention, sliding_window_visibility, softcapped_attention, write_cache


class RotaryPositions(nn.Module):
    """cos/sin tables for `positions`, computed exactly like HF's rotary embedding."""

    def __init__(self, rotary: Rotary):
        super().__init__()
        self.register_buffer("inv_freq", rotary.inv_freq, persistent=False)
        self.scaling = rotary.scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].float()  # [1, R/2, 1]
        pos = positions[:, None, :].float()  # [B, 1, T]
        freqs = (inv @ pos).transpose(1, 2)  # [B, T, R/2] (the matmul broadcasts over B)
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, R]
        cos = (emb.cos() * self.scaling).to(dtype)
        sin = (emb.sin() * self.scaling).to(dtype)
        return cos, sin


class ApplyRope(nn.Module):
    """Rotary on the first R of each head's D dims (R = D unless the rotary is partial, as in Phi-3 variants)."""

    def __init__(self, rotary_dim: int, head_dim: int):
        super().__init__()
        self.partial = rotary_dim < head_dim
        self.rotary_dim = rotary_dim

    def forward(self, q, k, cos, sin):  # q [B, H, T, D], k [B, KV, T, D], cos/sin [B, T, R]
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        if not self.partial:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        r = self.rotary_dim
        q_rot, k_rot = q[..., :r], k[..., :r]
        q = torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q[..., r:]), dim=-1)
        k = torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k[..., r:]), dim=-1)
        return q, k


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class CausalMask(nn.Module):
    """Chain mask: query t sees cache slot s iff s <= positions[b, t]."""

    def forward(self, positions: torch.Tensor, kv_len) -> torch.Tensor:
        key_slots = torch.arange(kv_len, device=positions.device)  # [S]
        visible = key_slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
        return visible.unsqueeze(1)  # [B, 1, T, S]


class EmbedScaling(nn.Module):
    """Embeddings times the family's embedding multiplier (Granite)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, h):  # [B, T, H]
        return h * self.scale


class LogitScaling(nn.Module):
    """Logits divided by the family's divisor (Granite), then soft-capped (Gemma 2)."""

    def __init__(self, divisor: float, softcap: float | None):
        super().__init__()
        self.divisor, self.softcap = divisor, softcap

    def forward(self, logits):  # [B, T, V]
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class CacheSlots(nn.Module):
    """Cache slots the step writes to: in a chain, each row's tokens' positions (a node of its own,
    annotated CACHE_INDEX, which TreeAttention replaces by its `cache_slots` input)."""

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.clone()  # [B, T]


class AttentionCore(nn.Module):
    """Grouped-query attention: SDPA reads each K/V head for its group of query heads
    (`enable_gqa`), so the visible cache is never copied per query head; soft-capped logits go
    through `softcapped_attention`, attention with sinks (gpt-oss) through `sink_attention`."""

    def __init__(self, groups: int, scale: float, softcap: float | None, sinks: nn.Parameter | None = None):
        super().__init__()
        self.gqa = groups > 1
        self.scale = scale
        self.softcap = softcap
        self.sinks = sinks  # HF's parameter [H], shared; None: no sinks

    def forward(self, q, k, v, mask):  # q [B, H, T, D], k/v [B, KV, S, D], mask [B, 1, T, S]
        if self.sinks is not None:
            return sink_attention(q, k, v, attn_mask=mask, scale=self.scale, sinks=self.sinks)
        if self.softcap is not None:
            return softcapped_attention(q, k, v, attn_mask=mask, scale=self.scale, softcap=self.softcap)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.gqa)


class Attention(nn.Module):
    def __init__(self, parts: AttentionParts, spec: ArchSpec, rotary_dim: int):
        super().__init__()
        self.qkv_proj = parts.qkv_proj  # fused [q | k | v], or None
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = parts.q_proj, parts.k_proj, parts.v_proj, parts.o_proj
        self.q_norm, self.k_norm = parts.q_norm, parts.k_norm  # None: no q/k norm
        self.norm_per_head = parts.qk_norm == "head"
        self.clip = parts.clip  # None: q, k, v unclamped
        self.head_dim = spec.head_dim
        self.split = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim)
        self.rope = ApplyRope(rotary_dim, spec.head_dim) if parts.rotary is not None else None
        if parts.sinks is not None and parts.softcap is not None:
            raise AssertionError("attention with both sinks and soft-capped logits is not captured")
        self.core = AttentionCore(spec.kv_groups, parts.scale, parts.softcap, parts.sinks)

    def forward(self, x, cos, sin, mask, slots, kv_len, k_cache, v_cache):  # x [B, T, H*D]
        b, t = x.shape[0], x.shape[1]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.split, dim=-1)  # [B, T, H*D], [B, T, KV*D] x 2
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.norm_per_head:
            q = self.q_norm(q.view(b, t, -1, self.head_dim))  # [B, T, H, D]
            k = self.k_norm(k.view(b, t, -1, self.head_dim))  # [B, T, KV, D]
        elif self.q_norm is not None:  # over the whole projection (OLMo 2)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:  # OLMoE's clip_qkv
            q, k, v = q.clamp(-self.clip, self.clip), k.clamp(-self.clip, self.clip), v.clamp(-self.clip, self.clip)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, KV, T, D]
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, KV, T, D]
        if self.rope is not None:
            q, k = self.rope(q, k, cos, sin)
        keys = write_cache(k_cache, slots, k)[:, :, :kv_len]  # [B, KV, S, D]
        values = write_cache(v_cache, slots, v)[:, :, :kv_len]  # [B, KV, S, D]
        out = self.core(q, keys, values, mask)  # [B, H, T, D]
        out = out.transpose(1, 2).contiguous().reshape(b, t, -1)  # [B, T, H*D]
        return self.o_proj(out)


class DecoderBlock(nn.Module):
    """One decoder layer as `LayerParts` describes it (norms that are None are left out)."""

    def __init__(self, parts: LayerParts, spec: ArchSpec, rotary_dim: int):
        super().__init__()
        self.attention_norm = parts.attention_norm  # None: no such norm
        self.self_attn = Attention(parts.attention, spec, rotary_dim)
        self.attention_out_norm = parts.attention_out_norm
        self.mlp_norm = parts.mlp_norm
        self.mlp = MixtureOfExperts(parts.mlp) if isinstance(parts.mlp, MixtureParts) else parts.mlp
        self.mlp_out_norm = parts.mlp_out_norm
        self.residual_scale = parts.residual_scale

    def forward(self, h, cos, sin, mask, slots, kv_len, k_cache, v_cache):  # h [B, T, H]
        x = _maybe(self.attention_norm, h)
        attended = _maybe(self.attention_out_norm, self.self_attn(x, cos, sin, mask, slots, kv_len, k_cache, v_cache))
        h = h + self._scaled(attended)
        return h + self._scaled(_maybe(self.mlp_out_norm, self.mlp(_maybe(self.mlp_norm, h))))

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.residual_scale if self.residual_scale != 1.0 else x


def _maybe(module: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return x if module is None else module(x)


class DecodeStep(nn.Module):
    """One forward of the target model over T tokens, reading and writing a static KV cache."""

    def __init__(self, parts: ModelParts, spec: ArchSpec, k_cache: torch.Tensor, v_cache: torch.Tensor):
        super().__init__()
        self.embed_tokens = parts.embed_tokens
        self.embed_scaling = EmbedScaling(parts.embed_scale) if parts.embed_scale != 1.0 else None
        self.rotaries = nn.ModuleList(RotaryPositions(rotary) for rotary in parts.rotaries)
        self.mask = CausalMask()
        self.cache_slots = CacheSlots()
        self.layer_rotary = tuple(layer.attention.rotary for layer in parts.layers)
        self.layer_window = tuple(layer.attention.window for layer in parts.layers)
        self.layers = nn.ModuleList(
            DecoderBlock(layer, spec, _rotary_dim(parts, layer)) for layer in parts.layers
        )
        self.norm = parts.norm
        self.lm_head = parts.lm_head
        scaled = parts.logit_divisor != 1.0 or parts.logit_softcap is not None
        self.logit_scaling = LogitScaling(parts.logit_divisor, parts.logit_softcap) if scaled else None
        self.register_buffer("k_cache", k_cache, persistent=False)  # [L, B, KV, S_max, D]
        self.register_buffer("v_cache", v_cache, persistent=False)  # [L, B, KV, S_max, D]

    def forward(self, input_ids, positions, kv_len):
        h = self.embed_tokens(input_ids)  # [B, T, H]
        h = _maybe(self.embed_scaling, h)
        tables = [rotary(positions, h.dtype) for rotary in self.rotaries]  # (cos, sin) [B, T, R] each
        mask = self.mask(positions, kv_len)  # [B, 1, T, S]
        windowed = {w: sliding_window_visibility(mask, positions, w) for w in sorted(set(self.layer_window) - {None})}
        slots = self.cache_slots(positions)  # [B, T]
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self.layer_rotary[i]] if self.layer_rotary[i] is not None else (None, None)
            layer_mask = mask if self.layer_window[i] is None else windowed[self.layer_window[i]]
            h = layer(h, cos, sin, layer_mask, slots, kv_len, self.k_cache[i], self.v_cache[i])
        hidden = self.norm(h)  # [B, T, H]
        logits = _maybe(self.logit_scaling, self.lm_head(hidden))  # [B, T, V]
        return logits, hidden  # [B, T, V], [B, T, H]


def _rotary_dim(parts: ModelParts, layer: LayerParts) -> int:
    rotary = layer.attention.rotary
    return 0 if rotary is None else 2 * parts.rotaries[rotary].inv_freq.shape[0]
