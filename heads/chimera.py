"""Chimera's draft (Zeng et al. 2024, "Chimera: A Lossless Decoding Method for Accelerating Large Language
Models Inference by Fusing all Tokens"), in the feature draft's interface (heads.feature_draft), so the
same drafter, draft graph, ONNX export and batching run it.

Its three parts (the paper's method section was not reachable here: built from its abstract, its
summaries and the parts' names; the choices below are this package's where those say nothing):
- Trigram Encoder (short-range dependencies at the bottom): u[s] = W_t [e(x[s-1]); e(x[s]); e(x[s+1])]
  (3H -> H) for the token x[s+1] a committed position s hands the draft; a missing token (before the
  first) embeds as zeros.
- Full Context Decoder: one Llama-style decoder layer (heads.decoder_layer) over the trigram
  encodings of every committed position, with the draft's own KV cache, then a norm: d[s].
- Residual Decoding Heads, fed with the representation the target already has: the root state
  z[s] = W_f [h[s]; d[s]] (2H -> H, h the target's final normed state), and K parallel heads, Medusa's
  residual blocks o_j = z + SiLU(W_j z + b_j) for j = 0..K-1; o_j predicts x[s+2+j] through a head over
  the draft vocabulary (the LM head's rows; h is already normed: no norm before it).
The heads are parallel: a token drafted at depth j > 0 hands its parent's z on unchanged and takes head
j, so every node at one depth gets the same distribution (Medusa's tree, grown best-first by the
drafter). A call's `depth` input says which part each token takes; the drafter drafts at most K levels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .decoder_layer import DraftDecoderLayer, copy_target_layer
from .feature_draft import FeatureDraftConfig, RMSNorm
from ..common.errors import InvalidParameterError


class ChimeraDraft(nn.Module):
    """Chimera's draft (module docstring). `draft_vocab` [D] buffer: the token id of each head row."""

    def __init__(self, config: FeatureDraftConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.trigram = nn.Linear(3 * h, h, bias=False)
        self.decoder = DraftDecoderLayer(config)
        self.decoder_norm = RMSNorm(h, config.rms_eps)
        self.fuse = nn.Linear(2 * h, h, bias=False)
        self.heads = nn.ModuleList(nn.Linear(h, h) for _ in range(config.parallel_heads))
        self.head = nn.Linear(h, config.draft_vocab, bias=False)
        self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab, dtype=torch.long))

    def root_states(self, states: torch.Tensor, embeds: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor,
                    past_keys: torch.Tensor, past_values: torch.Tensor, mask: torch.Tensor):  # fmt: skip
        """z [B, T, H] of committed positions: the target's h states [B, T, H], the tokens they hand on
        embeds [B, T, H] and the two before them previous [B, T, 2, H], at positions [B, T] after the
        draft's cache past_keys, past_values [B, nkv, S, d] (mask [B or 1, T, S + T]) -> (z, keys, values)."""
        trigram = self.trigram(torch.cat((previous[..., 0, :], previous[..., 1, :], embeds), -1))  # [B, T, H]
        decoded, keys, values = self.decoder(trigram, positions, past_keys, past_values, mask)
        return self.fuse(torch.cat((states, self.decoder_norm(decoded)), -1)), keys, values

    def head_output(self, z: torch.Tensor, head: int) -> torch.Tensor:
        """o_j [..., H] of head j on root states z [..., H]."""
        return z + F.silu(self.heads[head](z))

    def draft_step(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, past_keys: torch.Tensor,
                   past_values: torch.Tensor, mask: torch.Tensor, depth: torch.Tensor, previous: torch.Tensor):  # fmt: skip
        """One draft call (FeatureDraftStep): embeds, states [B, T, H] (the target's h at depth 0, else
        the parent's z), depth [B, T], previous [B, T, 2, H] -> (states [B, T, H]: z, logits [B, T, D]
        of head `depth`, keys, values [B, nkv, S + T, d]). Every token runs the encoder and decoder and
        every head (one static graph); `depth` picks its state and head."""
        fused, keys, values = self.root_states(states, embeds, previous, positions, past_keys, past_values, mask)
        z = torch.where((depth == 0)[..., None], fused, states)  # [B, T, H]
        outputs = torch.stack([self.head_output(z, j) for j in range(len(self.heads))], -2)  # [B, T, K, H]
        which = depth.clamp(max=len(self.heads) - 1)[..., None, None].expand_as(outputs[..., :1, :])  # [B, T, 1, H]
        return z, self.logits(outputs.gather(-2, which).squeeze(-2)), keys, values

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., D] of head outputs o [..., H]."""
        return self.head(out)

    def forward_chains(self, features: torch.Tensor, embeds: torch.Tensor, previous: torch.Tensor,
                       steps: int) -> list[torch.Tensor]:  # fmt: skip
        """The training-time chains: features [B, T, H] (the target's h at positions 0..T-1), embeds
        [B, T, H] (of x[1..T]), previous [B, T, 2, H] (of x[s-1], x[s]) -> each depth's head outputs
        o_j [B, T, H] (depth j at position s: head j on z[s - j]; positions s < j hold garbage no valid
        position reads)."""
        if steps > len(self.heads):
            raise InvalidParameterError(f"this Chimera draft has {len(self.heads)} heads; {steps} chain steps asked")
        b, t, _ = features.shape
        positions = torch.arange(t, device=features.device).expand(b, t)
        empty = features.new_zeros(b, self.config.num_kv_heads, 0, self.config.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=features.device).tril()[None]  # [1, T, T]
        z, _, _ = self.root_states(features, embeds, previous, positions, empty, empty, causal)
        return [self.head_output(F.pad(z[:, : t - j], (0, 0, j, 0)), j) for j in range(steps)]  # z[s - j] at s


@torch.no_grad()
def initialise_chimera(draft: ChimeraDraft, model: nn.Module) -> None:
    """Chimera's start: the trigram encoder near e(x[s+1]) alone, the decoder copied from the target's
    first layer (it reads embedding-like inputs) with its output projections zeroed (the identity), the
    fusion near z = h, and the heads' blocks zero (Medusa's start: every head begins as the LM head on h)."""
    h = draft.config.hidden_size
    eye = torch.eye(h)
    draft.trigram.weight.copy_(torch.cat((torch.zeros(h, 2 * h), eye), 1) + 0.01 * torch.rand(h, 3 * h))
    copy_target_layer(draft.decoder, model, 0)
    draft.fuse.weight.copy_(torch.cat((eye, torch.zeros(h, h)), 1) + 0.01 * torch.rand(h, 2 * h))
    for block in draft.heads:
        block.weight.zero_()
        block.bias.zero_()
