"""An independent reference for sparse attention: HF's own model generating greedily, with an attention
function of this file's (registered through transformers' AttentionInterface) that applies the rules
as `rewrites/sparse_attention` states them from the papers:

- each query keeps its own key, then the `tokens - 1` other keys it sees of highest score; TidalDecode
  scores per query head by the logit, TokenSelect per token by the sum over heads of each head's
  softmax over what it sees;
- TidalDecode: layers before the first selecting layer attend fully; a selecting layer attends fully
  and chooses; later layers attend to the latest choice. TokenSelect: every layer chooses, then
  attends to its choice.

Nothing of specpass's graph, kernels or decoding runs here; from a pass only `tokens`, `vote` and
`selecting_layers` and `selecting_layers_attend_fully` are read.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sparse_reference"
_STATE: dict = {}


def _choose(scores: torch.Tensor, visible: torch.Tensor, tokens: int) -> torch.Tensor:
    """scores [..., T, S], visible [T, S] (the query's own key is its last visible one) -> [..., T, S]
    bool: its own key and the `tokens - 1` best others it sees. Records in _STATE["margin"] the
    smallest gap between a chosen score and the best one left out, relative to the chosen one (a
    near-tie decides by rounding)."""
    t_count, s_count = visible.shape
    chosen = torch.zeros(scores.shape, dtype=torch.bool)
    for t in range(t_count):
        own = s_count - t_count + t
        others = [s for s in range(s_count) if visible[t, s] and s != own]
        chosen[..., t, own] = True
        ordered, ranked = scores[..., t, others].sort(dim=-1, descending=True, stable=True)
        chosen[..., t, :].scatter_(-1, torch.tensor(others)[ranked[..., : tokens - 1]], True)
        if len(others) >= tokens:
            gap = ((ordered[..., tokens - 2] - ordered[..., tokens - 1]) / ordered[..., tokens - 2].abs()).min().item()
            _STATE["margin"] = min(_STATE["margin"], gap)
    return chosen


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, H, T, D], key / value [B, KV, S, D] (one row, no padding: query t sees keys <= S - T + t)."""
    sparse = _STATE["pass"]
    layer, heads, t_count, s_count = module.layer_idx, query.shape[1], query.shape[2], key.shape[2]
    key = key.repeat_interleave(heads // key.shape[1], dim=1)
    value = value.repeat_interleave(heads // value.shape[1], dim=1)
    logits = (query @ key.transpose(-1, -2)) * scaling  # [B, H, T, S]
    visible = torch.ones(t_count, s_count, dtype=torch.bool).tril(s_count - t_count)  # [T, S]
    selecting = sparse.selecting_layers(module.config.num_hidden_layers)
    attend = visible.expand_as(logits)
    if layer in selecting:
        if sparse.vote:
            scores = logits.masked_fill(~visible, float("-inf")).softmax(-1).sum(1, keepdim=True)  # [B, 1, T, S]
        else:
            scores = logits
        _STATE["chosen"] = _choose(scores, visible, sparse.tokens).expand_as(logits)
        if not sparse.selecting_layers_attend_fully:
            attend = attend & _STATE["chosen"]
    elif layer > selecting[0]:
        attend = attend & _STATE["chosen"]
    weights = logits.masked_fill(~attend, float("-inf")).softmax(-1)
    return (weights @ value).transpose(1, 2).contiguous(), None  # [B, T, H, D]


@torch.no_grad()
def sparse_greedy(model, prompt: list[int], sparse, new_tokens: int) -> tuple[list[int], float]:
    """`new_tokens` greedy tokens of `model` after `prompt`, attention as the module docstring says, and
    the smallest relative score gap that decided a selection (float32 rounding can order a smaller one otherwise)."""
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    before = model.config._attn_implementation
    _STATE.update({"pass": sparse, "margin": float("inf")})
    model.set_attn_implementation(NAME)
    try:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    finally:
        model.set_attn_implementation(before)
    return out[0, len(prompt) :].tolist(), _STATE["margin"]
