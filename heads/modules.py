"""Draft heads (Medusa, Hydra) and the draft step that runs them through the model's own LM head.

`hidden` is the final normed state of the last accepted token t; head k (k = 1..K) predicts x[t+k+1], so
head 1 proposes the children of the tree's root x[t+1]. Medusa (Cai et al.): z_k = h + SiLU(W_k h + b_k),
independent of the drafted tokens. Hydra (Ankner et al.): z_k = h + SiLU(W_k [h; e(x[t+1]); ...;
e(x[t+k])] + b_k), so a path is drafted token by token. Both start as the identity (W = 0, b = 0); the
LM head and embedding are the model's, shared. Draft vocabulary (FR-Spec, Zhao et al. 2025): heads
propose only the `draft_vocab` tokens the model emits most in the training corpus, and the draft step
multiplies by those rows of the LM head only (gathered once, never trained): a fraction of the bytes a
draft call reads, which is its cost on a CPU. Lossless all the same: the target verifies every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DESIGNS = ("medusa", "hydra")  # the heads' designs, by their papers


@dataclass(frozen=True)
class HeadsConfig:
    """What a set of trained heads is: design, K, the model it belongs to, and how accurate it measured.

    accuracy[k][r]: on held-out data, how often head k+1's rank-r token was the target's greedy token
    (given, for Hydra, the target's own earlier tokens). Static trees are built from it.
    """

    design: str
    num_heads: int
    hidden_size: int
    vocab_size: int
    model: str  # identity of the model: see heads.io.model_fingerprint
    accuracy: tuple[tuple[float, ...], ...] = ()
    draft_vocab: int = 0  # tokens the heads may propose (module docstring); 0: the whole vocabulary

    def __post_init__(self):
        if self.design not in DESIGNS:
            raise ValueError(f"unknown heads design {self.design!r}; choose one of {DESIGNS}")
        if not 0 <= self.draft_vocab < self.vocab_size:
            raise ValueError(f"draft_vocab must be in [0, vocab_size), got {self.draft_vocab}")

    @classmethod
    def from_dict(cls, data: dict) -> HeadsConfig:
        """From its JSON form (heads.json, an export's manifest); "kind" is design's name before 0.2."""
        data = dict(data, accuracy=tuple(tuple(row) for row in data.get("accuracy", ())))
        if "kind" in data and "design" not in data:
            data["design"] = data.pop("kind")
        return cls(**data)


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """hidden [N, H], embeds [N, K, H] (unused) -> every head's state [N, K, H]."""
        return torch.stack([hidden + F.silu(block(hidden)) for block in self.blocks], dim=1)


class HydraHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear((k + 2) * hidden_size, hidden_size) for k in range(num_heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """hidden [N, H], embeds [N, K, H] of x[t+1..t+K] -> every head's state [N, K, H].

        Head k reads embeds[:, :k] only, so rows whose later tokens are not drafted yet may hold anything there.
        """
        out = []
        for k, block in enumerate(self.blocks):
            inputs = torch.cat((hidden, embeds[:, : k + 1].flatten(1)), dim=-1)  # [N, (k + 2) H]
            out.append(hidden + F.silu(block(inputs)))
        return torch.stack(out, dim=1)  # [N, K, H]


def make_heads(config: HeadsConfig, draft_vocab: torch.Tensor | None = None) -> nn.Module:
    """Untrained heads for `config`; with config.draft_vocab, they hold the ids `draft_vocab`
    [config.draft_vocab] as a buffer (zeros until given or loaded)."""
    cls = MedusaHeads if config.design == "medusa" else HydraHeads
    heads = cls(config.num_heads, config.hidden_size)
    if config.draft_vocab:
        if draft_vocab is None:
            draft_vocab = torch.zeros(config.draft_vocab, dtype=torch.long)
        if draft_vocab.shape != (config.draft_vocab,):
            raise ValueError(f"draft_vocab has shape {tuple(draft_vocab.shape)}, not ({config.draft_vocab},)")
        heads.register_buffer("draft_vocab", draft_vocab.clone())
    return heads


def draft_vocabulary(sequences: list[torch.Tensor], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` token ids [size] most frequent in `sequences`; ties, and ids never seen, in id order
    (BPE ids come roughly in merge order, so low ids are the common ones)."""
    counts = torch.bincount(torch.cat(sequences), minlength=vocab_size)  # [V]
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: ties in id order
    return order[:size].clone()


class HeadsStep(nn.Module):
    """The draft graph: heads on hidden states, then `vocab_head` on the chosen head of each row:
    the model's LM head (shared) or, with a draft vocabulary, its rows of that vocabulary.

    Inputs: hidden [N, H] (the states the heads start from), tokens [N, K] (x[t+1..t+K] for Hydra:
    only the first `head` are read; Medusa ignores them), head [N] int64 (which head, 0-based, each
    row evaluates). Outputs: logits [N, D] over the draft vocabulary, and its token ids vocab [D]
    (D = V and vocab = 0..V-1 without one). Every head's block is cheap; the LM head, the costly
    part, runs once per row.
    """

    def __init__(self, heads: nn.Module, lm_head: nn.Module, embed_tokens: nn.Module):
        super().__init__()
        self.heads = heads
        self.embed_tokens = embed_tokens
        weight = lm_head.weight.detach()  # [V, H]
        vocab = getattr(heads, "draft_vocab", None)
        if vocab is None:  # the whole vocabulary: the model's LM head itself, shared
            self.vocab_head = lm_head
            vocab = torch.arange(weight.shape[0], device=weight.device)
        else:  # its rows of the draft vocabulary, gathered once (derived, not trained)
            rows = weight[vocab.to(weight.device)].clone()  # [D, H]
            self.vocab_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
            self.vocab_head.weight = nn.Parameter(rows, requires_grad=False)
        self.register_buffer("vocab", vocab.to(weight.device), persistent=False)

    def forward(
        self, hidden: torch.Tensor, tokens: torch.Tensor, head: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed_tokens(tokens)  # [N, K, H]
        states = self.heads(hidden, embeds)  # [N, K, H]
        index = head[:, None, None].expand(-1, 1, states.shape[-1])  # [N, 1, H]
        chosen = states.gather(1, index).squeeze(1)  # [N, H]
        logits = self.vocab_head(chosen)  # [N, D]
        return logits, self.vocab
