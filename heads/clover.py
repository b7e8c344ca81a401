"""Clover's draft (Xiao et al. 2024, "Clover: Regressive Lightweight Speculative Decoding with
Sequential Knowledge"), in the feature draft's interface (heads.feature_draft), so the same drafter,
draft graph, ONNX export and batching run it.

Its three parts, as the authors' public code builds them (Clover-2's repository; the v1 paper's method
section was not reachable here):
- Attention Decoder cell (`GatedFusion`): fuses a state x with a token's embedding y per position:
  q = Wq norm(x) + b, k = Wk y + b, v = Wv y + b, split into attention heads; each head's gate is
  cos(q_h, k_h); out = x + v * gate.
- Augmenting Block: a decoder layer (causal self-attention over the draft's own KV cache of the
  prefix, then a gated-SiLU MLP) over the fused states of the committed positions, initialised from
  the target's last layer with its two output projections zeroed (so it starts as the identity), then
  a norm: S0[s] = norm(Augment(Fuse0(h[s], e(x[s+1])))). It runs at committed positions only; head 0
  reads it: o0 = W0 S0 (predicts x[s+2]).
- Regressive Connection: every later head runs one shared cell on the previous head's state and the
  token that head drafted: S_j = Fuse(S_{j-1}, e(token)), o_j = W [S_j; e(token)] (predicts the next
  token), so a path is drafted token by token without attention.
Every o_j goes through a final norm and a head over the draft vocabulary (the LM head's rows).
h[s] is the target's final normed state (what Medusa and Hydra heads read; the public code reads the
last layer's output before that norm: the same stream up to the norm's scaling). A call's `depth`
input says which part each token takes: 0 at committed positions, j > 0 for a drafted token at depth
j; chain tokens get keys too (the interface appends them) but no Clover computation reads them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .feature_draft import FeatureDraftConfig, RMSNorm, rotary
from ..ir.decode_step import ApplyRope


class GatedFusion(nn.Module):
    """Clover's Attention Decoder cell (module docstring): x, y [..., H] -> [..., H]."""

    def __init__(self, hidden_size: int, heads: int, eps: float):
        super().__init__()
        self.heads, self.eps = heads, eps
        self.norm = RMSNorm(hidden_size, eps)
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(self.norm(x)).unflatten(-1, (self.heads, -1))  # [..., nh, H / nh]
        k = self.k_proj(y).unflatten(-1, (self.heads, -1))
        v = self.v_proj(y).unflatten(-1, (self.heads, -1))
        gate = F.cosine_similarity(q, k, dim=-1, eps=self.eps)[..., None]  # [..., nh, 1]
        return x + (v * gate).flatten(-2)


class AugmentingBlock(nn.Module):
    """A Llama-style decoder layer over the draft's own KV cache (rotary at the target's base)."""

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


class CloverDraft(nn.Module):
    """Clover's draft (module docstring). `draft_vocab` [D] buffer: the token id of each head row."""

    def __init__(self, config: FeatureDraftConfig):
        super().__init__()
        self.config = config
        h, heads, eps = config.hidden_size, config.num_heads, config.rms_eps
        self.root_fusion = GatedFusion(h, heads, eps)
        self.augment = AugmentingBlock(config)
        self.augment_norm = RMSNorm(h, eps)
        self.root_out = nn.Linear(h, h, bias=False)
        self.chain_fusion = GatedFusion(h, heads, eps)
        self.chain_out = nn.Linear(2 * h, h, bias=False)
        self.final_norm = RMSNorm(h, eps)
        self.head = nn.Linear(h, config.draft_vocab, bias=False)
        self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab, dtype=torch.long))

    def draft_step(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, past_keys: torch.Tensor,
                   past_values: torch.Tensor, mask: torch.Tensor, depth: torch.Tensor):  # fmt: skip
        """One draft call (FeatureDraftStep): embeds, states [B, T, H] (the target's h at depth 0, else
        the parent's state), depth [B, T] -> (states [B, T, H], logits [B, T, D], keys, values [B, nkv, S + T, d]).
        Both parts run on every token (one static graph); `depth` picks each token's."""
        augmented, keys, values = self.augment(self.root_fusion(states, embeds), positions, past_keys, past_values, mask)
        root = self.augment_norm(augmented)  # [B, T, H]: S0
        chained = self.chain_fusion(states, embeds)  # [B, T, H]: S_j
        first = (depth == 0)[..., None]  # [B, T, 1]
        out = torch.where(first, self.root_out(root), self.chain_out(torch.cat((chained, embeds), -1)))
        return torch.where(first, root, chained), self.logits(out), keys, values

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., D] of head outputs o [..., H]."""
        return self.head(self.final_norm(out))

    def forward_chains(self, features: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time chains: features [B, T, H] (the target's h at positions 0..T-1), embeds
        [B, T, H] (of x[1..T]) -> each depth's head outputs o_j [B, T, H] (depth j at position s reads
        depth j-1's state at s - 1; positions s < j hold garbage no valid position reads)."""
        b, t, _ = features.shape
        positions = torch.arange(t, device=features.device).expand(b, t)
        empty = features.new_zeros(b, self.config.num_kv_heads, 0, self.config.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=features.device).tril()[None]  # [1, T, T]
        augmented, _, _ = self.augment(self.root_fusion(features, embeds), positions, empty, empty, causal)
        state = self.augment_norm(augmented)
        outputs = [self.root_out(state)]
        for _ in range(1, steps):
            state = self.chain_fusion(F.pad(state[:, :-1], (0, 0, 1, 0)), embeds)  # S_{j-1}[s-1] at s
            outputs.append(self.chain_out(torch.cat((state, embeds), -1)))
        return outputs


@torch.no_grad()
def initialise_clover(draft: CloverDraft, model: nn.Module) -> None:
    """Clover's start: fusion gates near the identity (q, k = I + small noise, v small), the head-0
    projection near the identity and the chain's on the state's half, the Augmenting Block copied from
    the target's last decoder layer where its weights have the same shapes (a Llama-style layer) with
    its attention and MLP output projections zeroed, its output norm from the target's final norm (the
    head and the final norm: as for any feature draft). The zeroed projections are this package's
    choice (the public code copies the layer as it is, which feeds head 0 the last layer applied to
    states it never sees: head 0 learned several times slower; docs/experiments.md, "Clover")."""
    h = draft.config.hidden_size
    eye = torch.eye(h)
    for fusion in (draft.root_fusion, draft.chain_fusion):
        for proj in (fusion.q_proj, fusion.k_proj):
            proj.weight.copy_(eye + 0.01 * torch.rand(h, h))
        fusion.v_proj.weight.copy_(0.01 * torch.rand(h, h))
        for proj in (fusion.q_proj, fusion.k_proj, fusion.v_proj):
            proj.bias.zero_()
    draft.root_out.weight.copy_(eye + 0.01 * torch.rand(h, h))
    draft.chain_out.weight.copy_(torch.cat((eye, torch.zeros(h, h)), 1) + 0.01 * torch.rand(h, 2 * h))
    last = model.model.layers[-1]
    sources = {"input_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
               **{f"{p}.weight": f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
               **{f"{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}}  # fmt: skip
    target = last.state_dict()
    for name, param in draft.augment.named_parameters():
        source = target.get(sources.get(name, ""))
        if source is not None and source.shape == param.shape:
            param.copy_(source.float())
    draft.augment.o_proj.weight.zero_()  # the block starts as the identity on its residual stream
    draft.augment.down_proj.weight.zero_()
    draft.augment_norm.weight.copy_(model.model.norm.weight.float())
