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

from .decoder_layer import DraftDecoderLayer, copy_target_layer
from .feature_draft import FeatureDraftConfig, RMSNorm


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


class CloverDraft(nn.Module):
    """Clover's draft (module docstring). `draft_vocab` [D] buffer: the token id of each head row."""

    def __init__(self, config: FeatureDraftConfig):
        super().__init__()
        self.config = config
        h, heads, eps = config.hidden_size, config.num_heads, config.rms_eps
        self.root_fusion = GatedFusion(h, heads, eps)
        self.augment = DraftDecoderLayer(config)
        self.augment_norm = RMSNorm(h, eps)
        self.root_out = nn.Linear(h, h, bias=False)
        self.chain_fusion = GatedFusion(h, heads, eps)
        self.chain_out = nn.Linear(2 * h, h, bias=False)
        self.final_norm = RMSNorm(h, eps)
        self.head = nn.Linear(h, config.draft_vocab, bias=False)
        self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab, dtype=torch.long))

    def draft_step(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, past_keys: torch.Tensor,
                   past_values: torch.Tensor, mask: torch.Tensor, depth: torch.Tensor, previous: torch.Tensor):  # fmt: skip
        """One draft call (FeatureDraftStep): embeds, states [B, T, H] (the target's h at depth 0, else
        the parent's state), depth [B, T] (`previous`: unread) -> (states [B, T, H], logits [B, T, D],
        keys, values [B, nkv, S + T, d]). Both parts run on every token (one static graph); `depth`
        picks each token's."""
        augmented, keys, values = self.augment(self.root_fusion(states, embeds), positions, past_keys, past_values, mask)
        root = self.augment_norm(augmented)  # [B, T, H]: S0
        chained = self.chain_fusion(states, embeds)  # [B, T, H]: S_j
        first = (depth == 0)[..., None]  # [B, T, 1]
        out = torch.where(first, self.root_out(root), self.chain_out(torch.cat((chained, embeds), -1)))
        return torch.where(first, root, chained), self.logits(out), keys, values

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., D] of head outputs o [..., H]."""
        return self.head(self.final_norm(out))

    def forward_chains(self, features: torch.Tensor, embeds: torch.Tensor, previous: torch.Tensor,
                       steps: int) -> list[torch.Tensor]:  # fmt: skip
        """The training-time chains: features [B, T, H] (the target's h at positions 0..T-1), embeds
        [B, T, H] (of x[1..T]; `previous`: unread) -> each depth's head outputs o_j [B, T, H] (depth j at
        position s reads depth j-1's state at s - 1; positions s < j hold garbage no valid position reads)."""
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
    copy_target_layer(draft.augment, model, -1)  # zeroed output projections: the identity to start
    draft.augment_norm.weight.copy_(model.model.norm.weight.float())
