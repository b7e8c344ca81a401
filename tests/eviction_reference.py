"""An independent reference for KV eviction: greedy decoding of a Llama one token at a time over a full
cache that is never compacted, where each policy's definition decides, per layer and KV head, which
earlier tokens a token's attention sees.

Nothing of specpass's decoding runs here: HF's own modules (embedding, norms, projections, rotary, MLP,
LM head) and this file's attention and bookkeeping. From a policy only its parameters are read (budget,
chunk, kept, the protected slots, decay, temperature, window, kernel), and Keyformer's fixed noise hash
(`scores.gumbel_noise`, the policy's definition of its noise). The rules, from the papers as
`rewrites/kv_eviction` states them:

- A (layer, KV head) holds at most `budget` tokens; when the committed tokens fill it, `kept =
  budget - chunk` stay: the protected slots (sinks, a recent or observation window), then the highest
  priorities, in sequence order.
- Scores come from each committed token's attention over the tokens it saw (itself included), the
  mean over the KV head's query heads: H2O sums them; A2SF decays the old sum by `decay` per token;
  TOVA keeps the latest token's and ranks by the mean over the layer's KV heads; Keyformer sums a
  softmax of the logits plus Gumbel noise at `temperature`; SnapKV ranks, at each eviction, by the
  last `window` tokens' attention summed and averaged over `kernel` neighbouring slots. TrimKV scores
  a token once, when it is created: its gates' log retention (from the layer's normed input), and ranks
  by log retention times (next position - its position). EMS sums like H2O and ranks by that sum
  and the window's attention (SnapKV's, unpooled), each divided by its total over the head's tokens.
- EMS merges: each token not kept joins the kept token whose key, centred on the mean of the head's
  held keys, is nearest by cosine similarity, if that similarity reaches `similarity`; a kept token
  with members becomes their priority-weighted mean key and value, with their summed score; the
  rest are dropped. A merged token's key and value replace its own from then on.
- Positions stay the original ones (rotary at each token's own position).
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specpass.rewrites import A2SF, EMS, H2O, TOVA, Keyformer, SinksWindow, SnapKV, TrimKV
from specpass.rewrites.kv_eviction.scores import gumbel_noise


class _Cache:
    """One layer's full cache (every token's K, V and query, never dropped) and, per KV head, the
    positions it still holds (its slots, in order) with their scores."""

    def __init__(self, kv_heads: int):
        self.keys: list[torch.Tensor] = []  # per position: [KV, D]
        self.values: list[torch.Tensor] = []  # per position: [KV, D]
        self.queries: list[torch.Tensor] = []  # per position: [H, D]
        self.held: list[list[int]] = [[] for _ in range(kv_heads)]
        self.scores: list[dict[int, torch.Tensor]] = [{} for _ in range(kv_heads)]
        self.scale = 1.0  # the attention's softmax scale (set by the forward)
        self.retention: dict[int, torch.Tensor] = {}  # TrimKV: position -> log retention [KV]
        self.merged: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(kv_heads)]  # EMS

    def key(self, kv_head: int, position: int) -> torch.Tensor:
        """[D]: the key the head holds for the token (merged, if it absorbed others)."""
        merged = self.merged[kv_head].get(position)
        return merged[0] if merged is not None else self.keys[position][kv_head]

    def value(self, kv_head: int, position: int) -> torch.Tensor:
        merged = self.merged[kv_head].get(position)
        return merged[1] if merged is not None else self.values[position][kv_head]


@torch.no_grad()
def evicting_greedy(model, prompt: list[int], policy, new_tokens: int) -> list[int]:
    """The `new_tokens` greedy tokens after `prompt` of the Llama `model` under `policy` (module docstring)."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    caches = [_Cache(kv_heads) for _ in model.model.layers]
    gates = policy.gates() if isinstance(policy, TrimKV) else None
    tokens, position, out = list(prompt), 0, []
    while len(out) < new_tokens:
        logits = _forward(model, caches, tokens[position], position, policy, heads // kv_heads, gates)
        for layer, cache in enumerate(caches):
            if len(cache.held[0]) == policy.budget:
                _evict(policy, cache, layer, heads // kv_heads)
        position += 1
        if position == len(tokens):
            tokens.append(int(logits.argmax()))
            out.append(tokens[-1])
    return out


def _forward(model, caches: list[_Cache], token: int, position: int, policy, group: int, gates) -> torch.Tensor:
    """One token through the model; each layer's cache takes its K/V/query and, per KV head, holds it and
    scores it. Returns the logits [V]."""
    x = model.model.embed_tokens(torch.tensor([[token]]))  # [1, 1, hidden]
    cos, sin = model.model.rotary_emb(x, torch.tensor([[position]]))
    for layer, (block, cache) in enumerate(zip(model.model.layers, caches)):
        attention = block.self_attn
        h = block.input_layernorm(x)
        if gates is not None:
            cache.retention[position] = gates(layer, h)[0, 0]  # [KV]
        d, cache.scale = attention.head_dim, attention.scaling
        q = attention.q_proj(h).view(1, 1, -1, d).transpose(1, 2)  # [1, H, 1, D]
        k = attention.k_proj(h).view(1, 1, -1, d).transpose(1, 2)  # [1, KV, 1, D]
        v = attention.v_proj(h).view(1, 1, -1, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        cache.keys.append(k[0, :, 0])
        cache.values.append(v[0, :, 0])
        cache.queries.append(q[0, :, 0])
        outputs = []
        for kv_head, held in enumerate(cache.held):
            held.append(position)  # a token sees itself
            keys = torch.stack([cache.key(kv_head, p) for p in held])  # [S, D]
            values = torch.stack([cache.value(kv_head, p) for p in held])  # [S, D]
            heads = range(kv_head * group, (kv_head + 1) * group)  # HF's repeat_kv order
            logits = torch.stack([keys @ q[0, j, 0] * attention.scaling for j in heads])  # [G, S]
            outputs += list(logits.softmax(-1) @ values)  # G x [D]
            _score(policy, cache, layer, kv_head, logits, heads, position)
        o = attention.o_proj(torch.cat(outputs).view(1, 1, -1))
        x = x + o
        x = x + block.mlp(block.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))[0, 0].float()


def _score(policy, cache: _Cache, layer: int, kv_head: int, logits: torch.Tensor, heads: range, position: int) -> None:
    """Fold the token's attention over its KV head's slots (logits [G, S], scaled) into their scores."""
    if isinstance(policy, (SinksWindow, SnapKV, TrimKV)):
        return
    held, scores = cache.held[kv_head], cache.scores[kv_head]
    if isinstance(policy, Keyformer):
        noise = gumbel_noise(layer, heads.stop, torch.tensor([position]), policy.budget)[0, heads.start :, 0]  # [G, budget]
        probs = ((logits + noise[:, : len(held)]) / policy.temperature).softmax(-1).mean(0)  # [S]
    else:
        probs = logits.softmax(-1).mean(0)  # [S]
    zero = torch.zeros(())
    for slot, p in enumerate(held):
        old = scores.get(p, zero)
        if isinstance(policy, TOVA):
            scores[p] = probs[slot]
        elif isinstance(policy, A2SF):
            scores[p] = policy.decay * old + probs[slot]
        else:  # H2O, Keyformer, EMS
            scores[p] = old + probs[slot]


def _evict(policy, cache: _Cache, layer: int, group: int) -> None:
    """Keep `kept` of the `budget` held tokens of every KV head of the layer."""
    protected = [slot for slot in range(policy.budget) if policy.protected(policy.budget)[slot]]
    priorities = [_priority(policy, cache, kv_head, group) for kv_head in range(len(cache.held))]  # [budget] each
    for kv_head, (held, priority) in enumerate(zip(list(cache.held), priorities)):
        free = sorted((s for s in range(policy.budget) if s not in protected), key=lambda s: -float(priority[s]))
        keep = sorted(protected + free[: policy.kept - len(protected)])
        if isinstance(policy, EMS):
            _merge(policy, cache, kv_head, keep, priority)
        cache.held[kv_head] = [held[s] for s in keep]
        cache.scores[kv_head] = {held[s]: cache.scores[kv_head][held[s]] for s in keep if held[s] in cache.scores[kv_head]}


def _priority(policy, cache: _Cache, kv_head: int, group: int) -> torch.Tensor:
    """[budget] by slot: what the policy keeps first."""
    held = cache.held[kv_head]
    if isinstance(policy, SinksWindow):
        return torch.zeros(len(held))
    if isinstance(policy, TOVA):  # one choice for the layer: every KV head holds the same tokens
        return torch.stack([torch.stack([cache.scores[h][p] for p in cache.held[h]]) for h in range(len(cache.held))]).mean(0)
    if isinstance(policy, (SnapKV, EMS)):
        keys = torch.stack([cache.key(kv_head, p) for p in held])  # [S, D]
        first = len(held) - policy.window  # the window's tokens are the last `window` held
        attention = torch.zeros(len(held))
        for i, p in enumerate(held[first:]):
            for j in range(kv_head * group, (kv_head + 1) * group):
                seen = first + i + 1
                attention[:seen] += (keys[:seen] @ cache.queries[p][j] * cache.scale).softmax(-1) / group
        if isinstance(policy, EMS):
            accumulated = torch.stack([cache.scores[kv_head][p] for p in held])
            return accumulated / accumulated.sum() + attention / attention.sum()
        half = policy.kernel // 2
        return torch.stack([attention[max(0, s - half) : s + half + 1].mean() for s in range(len(held))])
    if isinstance(policy, TrimKV):
        now = max(held) + 1
        return torch.stack([cache.retention[p][kv_head] * (now - p) for p in held])
    assert isinstance(policy, (H2O, A2SF, Keyformer))
    return torch.stack([cache.scores[kv_head][p] for p in held])


def _merge(policy, cache: _Cache, kv_head: int, keep: list[int], priority: torch.Tensor) -> None:
    """EMS: fold the head's tokens not in `keep` (slots) into their nearest kept token or drop them."""
    held, scores = cache.held[kv_head], cache.scores[kv_head]
    keys = torch.stack([cache.key(kv_head, p) for p in held])  # [S, D]
    centred = keys - keys.mean(0)
    members: dict[int, list[int]] = {s: [s] for s in keep}
    for s in range(len(held)):
        if s in members:
            continue
        similarity = {c: float(centred[s] @ centred[c] / (centred[s].norm() * centred[c].norm())) for c in keep}
        nearest = max(keep, key=lambda c: similarity[c])
        if similarity[nearest] >= policy.similarity:
            members[nearest].append(s)
    for c, group in members.items():
        if len(group) == 1:
            continue
        weights = torch.stack([priority[s] for s in group])  # [m]
        mean = lambda rows: (weights[:, None] * torch.stack(rows)).sum(0) / weights.sum()  # noqa: E731
        cache.merged[kv_head][held[c]] = (mean([cache.key(kv_head, held[s]) for s in group]),
                                          mean([cache.value(kv_head, held[s]) for s in group]))  # fmt: skip
        scores[held[c]] = sum(scores[held[s]] for s in group)
