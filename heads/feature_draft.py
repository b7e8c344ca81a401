"""The feature-level draft (EAGLE-3, Li et al. 2025): one small decoder layer that drafts autoregressively
over the target's own features.

Position s of the target has features g[s] = [h_low[s]; h_mid[s]; h_high[s]] [3H], the residual stream
after three of its layers (`feature_layers`, HF `hidden_states` indices). Step 0 at s reads (fuse(g[s]),
e(x[s+1])) and predicts x[s+2]; step j at s reads (a_{j-1}[s-1], e(x[s+1])), its previous step's output
state, so the draft runs on its own states down a path. Attention: step j at s sees the step-0 keys of
positions <= s - j and one key per earlier step of its chain (`chain_mask` in training; the draft's
cache and a drafted path's keys in decoding). The layer: q, k, v over [norm(e); norm(state)] [2H], the
state as residual stream, a gated-SiLU MLP, a final norm and a head over the draft vocabulary
(initialised from the LM head's rows); rotary positions and the token embedding are the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..common.errors import InvalidParameterError, require_positive_ints
from ..ir.decode_step import ApplyRope

DESIGNS = ("eagle3", "clover", "chimera")  # this interface's drafts: this module's, heads.clover's, heads.chimera's


@dataclass(frozen=True)
class FeatureDraftConfig:
    """What a feature draft is, the model it belongs to, and how accurate it measured.

    design: "eagle3" (this module's layer, over three feature layers), "clover" (heads.clover) or
    "chimera" (heads.chimera), both over the final normed state: no feature layers. parallel_heads:
    Chimera's residual decoding heads, one per depth (0 for the others). accuracy[d][r]: on held-out
    data, how often the draft's rank-r token at depth d + 1 of a chain (drafted from its own states, the
    target's tokens fed back) was the target's greedy token."""

    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    feature_layers: tuple[int, int, int]  # indices into HF's hidden_states (0: embeddings)
    draft_vocab: int
    rope_theta: float
    rms_eps: float
    model: str  # identity of the model: heads.io.model_fingerprint
    accuracy: tuple[tuple[float, ...], ...] = ()
    design: str = "eagle3"
    parallel_heads: int = 0

    def __post_init__(self):
        require_positive_ints(self, ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim",
                                     "intermediate_size", "draft_vocab"))  # fmt: skip
        if self.design not in DESIGNS:
            raise InvalidParameterError(f"unknown feature draft design {self.design!r}; choose one of {DESIGNS}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidParameterError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                                        f"({self.num_kv_heads})")  # fmt: skip
        if (self.design == "chimera") != (self.parallel_heads > 0):
            raise InvalidParameterError(f"parallel_heads ({self.parallel_heads}) is Chimera's head count: positive "
                                        f"for a Chimera draft, 0 for a {self.design} one")  # fmt: skip
        if self.design != "eagle3":
            if self.feature_layers:
                raise InvalidParameterError(f"a {self.design} draft reads the final normed state, not layers "
                                            f"{self.feature_layers}")  # fmt: skip
            if self.design == "clover" and self.hidden_size % self.num_heads:
                raise InvalidParameterError(f"Clover's fusion splits hidden_size ({self.hidden_size}) into num_heads "
                                            f"({self.num_heads}) parts")  # fmt: skip
        elif len(self.feature_layers) != 3 or len(set(self.feature_layers)) != 3:
            raise InvalidParameterError(f"feature_layers must be three distinct layer indices, got {self.feature_layers}")
        if self.draft_vocab > self.vocab_size:
            raise InvalidParameterError(f"draft_vocab ({self.draft_vocab}) exceeds the vocabulary ({self.vocab_size})")


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice: a low, a middle and a high layer's output (indices into HF's hidden_states)."""
    if num_layers < 3:
        raise InvalidParameterError(f"a feature draft reads three layers; the model has {num_layers}")
    low = min(2, num_layers // 4)
    middle = max(num_layers // 2, low + 1)
    return low, middle, max(num_layers - 3, middle + 1)


def config_for(model: nn.Module, draft_vocab: int, model_id: str, design: str = "eagle3",
               parallel_heads: int = 0) -> FeatureDraftConfig:  # fmt: skip
    """The draft's config for a HF causal LM: the target's attention shape and rotary base, its MLP width."""
    c = model.config
    params = getattr(c, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    heads = c.num_attention_heads
    return FeatureDraftConfig(
        hidden_size=c.hidden_size,
        vocab_size=c.vocab_size,
        num_heads=heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        intermediate_size=c.intermediate_size,
        feature_layers=default_feature_layers(c.num_hidden_layers) if design == "eagle3" else (),
        draft_vocab=min(draft_vocab, c.vocab_size),
        rope_theta=float(theta),
        rms_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        model=model_id,
        design=design,
        parallel_heads=parallel_heads,
    )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rotary(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, dim] of HF's half-split rotary embedding (base `theta`) at positions [B, T]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)  # [D/2]
    angles = positions[..., None].float() * inv_freq  # [B, T, D/2]
    angles = torch.cat((angles, angles), -1)  # [B, T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class FeatureDraftLayer(nn.Module):
    """The draft layer (module docstring). `draft_vocab` [D] buffer: the token id of each head row."""

    def __init__(self, config: FeatureDraftConfig):
        super().__init__()
        self.config = config
        h, heads, kv, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.fuse = nn.Linear(3 * h, h, bias=False)
        self.embed_norm = RMSNorm(h, config.rms_eps)
        self.state_norm = RMSNorm(h, config.rms_eps)
        self.q_proj = nn.Linear(2 * h, heads * dim, bias=False)
        self.k_proj = nn.Linear(2 * h, kv * dim, bias=False)
        self.v_proj = nn.Linear(2 * h, kv * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, h, bias=False)
        self.mlp_norm = RMSNorm(h, config.rms_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.final_norm = RMSNorm(h, config.rms_eps)
        self.head = nn.Linear(h, config.draft_vocab, bias=False)
        self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab, dtype=torch.long))
        self.rope = ApplyRope(dim, dim)

    def project(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor):
        """Queries [B, nh, T, d] and keys, values [B, nkv, T, d] of inputs embeds, states [B, T, H] at
        positions [B, T]."""
        b, t, _ = states.shape
        c = self.config
        x = torch.cat((self.embed_norm(embeds), self.state_norm(states)), -1)  # [B, T, 2H]
        q = self.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rotary(positions, c.head_dim, c.rope_theta, q.dtype)  # [B, T, d] each, once for q and k
        q, k = self.rope(q, k, cos, sin)
        return q, k, v

    def finish(self, states: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The layer's output a [B, T, H] for residual states [B, T, H], queries q [B, nh, T, d] over
        keys, values [B, nkv, S, d] where mask [B or 1, T, S] (True: attend)."""
        groups = self.config.num_heads // self.config.num_kv_heads
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])  # [B, nh, T, d]
        b, _, t, _ = attended.shape
        hidden = states + self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        mlp_in = self.mlp_norm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in))

    def extend(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, past_keys: torch.Tensor,
               past_values: torch.Tensor, mask: torch.Tensor):  # fmt: skip
        """One draft forward in decoding: inputs embeds, states [B, T, H] at positions [B, T] after a cache
        past_keys, past_values [B, nkv, S, d], attending where mask [B, T, S + T] -> (outputs [B, T, H],
        keys, values [B, nkv, S + T, d]: the cache with these tokens appended)."""
        q, k, v = self.project(embeds, states, positions)
        keys, values = torch.cat((past_keys, k), 2), torch.cat((past_values, v), 2)
        return self.finish(states, q, keys, values, mask), keys, values

    def draft_step(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, past_keys: torch.Tensor,
                   past_values: torch.Tensor, mask: torch.Tensor, depth: torch.Tensor, previous: torch.Tensor):  # fmt: skip
        """One draft call (FeatureDraftStep): `extend` and its logits; every token is one step of this
        layer whatever its depth [B, T]; it reads no earlier tokens' embeddings (`previous`, [B, T, 2, H])
        -> (states [B, T, H], logits [B, T, D], keys, values)."""
        out, keys, values = self.extend(embeds, states, positions, past_keys, past_values, mask)
        return out, self.logits(out), keys, values

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., D] of output states [..., H]."""
        return self.head(self.final_norm(states))

    def forward_chains(self, features: torch.Tensor, embeds: torch.Tensor, previous: torch.Tensor,
                       steps: int) -> list[torch.Tensor]:  # fmt: skip
        """The training-time test: features [B, T, 3H] (the target's at positions 0..T-1), embeds
        [B, T, H] (of x[1..T]; `previous` [B, T, 2, H], of x[s-1], x[s]: unread here) -> each step's
        output states [B, T, H] (step j at position s reads step j-1's output at s - 1; positions s < j
        hold garbage no valid position reads)."""
        b, t, _ = features.shape
        positions = torch.arange(t, device=features.device).expand(b, t)
        states = self.fuse(features)  # [B, T, H]
        keys, values, outputs = [], [], []
        for j in range(steps):
            if j:
                states = F.pad(outputs[-1][:, :-1], (0, 0, 1, 0))  # a_{j-1}[s-1] at s
            q, k, v = self.project(embeds, states, positions)
            keys.append(k)
            values.append(v)
            mask = chain_mask(t, j, features.device)[None]  # [1, T, (j+1) T]
            outputs.append(self.finish(states, q, torch.cat(keys, 2), torch.cat(values, 2), mask))
        return outputs


def chain_mask(length: int, step: int, device=None) -> torch.Tensor:
    """[T, (step + 1) T] bool: what step `step`'s query at position s sees among the keys of steps
    0..step (T each, in order): step-0 keys of positions <= s - step, and the step-i key of position
    s - step + i (i = 1..step). A position s < step sees its own step-0 key only (never read)."""
    s = torch.arange(length, device=device)
    blocks = [s[None, :] <= (s[:, None] - step).clamp_min(0) if step else s[None, :] <= s[:, None]]
    for i in range(1, step + 1):
        blocks.append(s[None, :] == s[:, None] - step + i)
    return torch.cat(blocks, 1)


def embed_previous(embed_tokens: nn.Module, previous: torch.Tensor) -> torch.Tensor:
    """The embeddings [..., 2, H] of token ids previous [..., 2], zeros where an id is -1 (before the first token)."""
    embeds = embed_tokens(previous.clamp_min(0))
    return torch.where((previous >= 0)[..., None], embeds, torch.zeros_like(embeds))


class FeatureDraftStep(nn.Module):
    """The draft graph (rewrites.feature_draft): one `draft_step` of the draft (this module's layer,
    heads.clover's or heads.chimera's).

    Inputs: tokens [N, T] (x[s+1] of each position s), states [N, T, H] (the target's fused features for
    step 0, else the previous step's outputs), positions [N, T], the draft's own cache past_keys,
    past_values [N, nkv, S, d], mask [N, T, S + T] (True: attend), depth [N, T] (0: a committed
    position, j: a token drafted at depth j) and previous [N, T, 2] (the two tokens before each token
    of `tokens`, committed or drafted; -1 before the first). Outputs: states [N, T, H], logits
    [N, T, D] over the draft vocabulary, its token ids vocab [D], and the cache with these tokens
    appended, keys, values [N, nkv, S + T, d]. The token embedding is the target's (shared)."""

    def __init__(self, layer: FeatureDraftLayer, embed_tokens: nn.Module):
        super().__init__()
        self.layer = layer
        self.embed_tokens = embed_tokens

    def forward(self, tokens, states, positions, past_keys, past_values, mask, depth, previous):
        out, logits, keys, values = self.layer.draft_step(
            self.embed_tokens(tokens), states, positions, past_keys, past_values, mask, depth,
            embed_previous(self.embed_tokens, previous))  # fmt: skip
        return out, logits, self.layer.draft_vocab, keys, values
