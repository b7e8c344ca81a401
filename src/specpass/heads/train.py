"""Self-distillation of draft heads: the model labels its own data, the heads learn its distribution.

1. Corpus: the model's greedy continuations of the training prompts (`training_prompts`: standard
   library functions, apart from every evaluation prompt), generated losslessly with specpass.
2. Hidden states: one forward of the model over each sequence gives the final normed hidden state
   h[t] of every position.
3. Training: at a generated position t, head k (k = 1..K) is trained towards the model's own
   distribution of x[t+k+1], softmax(lm_head(h[t+k])) (KL divergence from it); Hydra heads read the
   embeddings of the sequence's tokens x[t+1..t+k] (teacher forcing). The LM head and the embedding
   stay frozen and shared. AdamW, cosine schedule, fixed seed; a progress bar shows the loss and each
   head's top-1 accuracy.
4. Accuracy table: on held-out sequences, how often head k's rank-r token is the model's greedy
   x[t+k+1]; saved in heads.json, it seeds the drafter's static trees and acceptance priors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from specpass.errors import InvalidParameterError
from specpass.heads.io import model_fingerprint, save_heads
from specpass.heads.modules import KINDS, HeadsConfig, make_heads


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "medusa"
    num_heads: int = 4
    prompts: int = 240  # training prompts (the first ones of training_prompts)
    max_new_tokens: int = 128
    epochs: int = 2
    batch_size: int = 64  # positions per step
    lr: float = 1e-3
    seed: int = 0
    held_out: int = 16  # sequences kept apart for the accuracy table
    ranks: int = 8  # ranks in the accuracy table

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidParameterError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("num_heads", "prompts", "max_new_tokens", "epochs", "batch_size", "ranks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name} must be a positive int, got {value!r}")
        if not 0 <= self.held_out < self.prompts:
            raise InvalidParameterError(f"held_out must be in [0, prompts), got {self.held_out}")
        if not self.lr > 0:
            raise InvalidParameterError(f"lr must be positive, got {self.lr}")


@dataclass(frozen=True)
class Continuation:
    tokens: torch.Tensor  # [L] int64: prompt + greedy continuation
    start: int  # first position whose head targets lie in the continuation (prompt length - 1)


def generate_corpus(model: nn.Module, prompts: list[torch.Tensor], max_new_tokens: int, progress: bool = True):
    """The model's greedy continuations of `prompts` (specpass decoding: the same tokens, faster)."""
    from tqdm.auto import tqdm

    import specpass

    device = next(model.parameters()).device
    out = []
    for ids in tqdm(prompts, desc="self-distillation corpus", disable=not progress):
        sequence = specpass.generate(model, ids.to(device), max_new_tokens=max_new_tokens).sequences[0].cpu()
        out.append(Continuation(sequence, ids.shape[1] - 1))
    return out


@torch.no_grad()
def hidden_states(model: nn.Module, corpus: list[Continuation]) -> list[torch.Tensor]:
    """Final normed hidden states [L, H] of every sequence (float32, on the model's device)."""
    device = next(model.parameters()).device
    return [model.model(seq.tokens[None].to(device)).last_hidden_state[0].float() for seq in corpus]


def _positions(corpus: list[Continuation], k: int) -> torch.Tensor:
    """[N, 2] (sequence, t): positions whose K targets x[t+2..t+K+1] all exist."""
    rows = [(i, t) for i, seq in enumerate(corpus) for t in range(seq.start, len(seq.tokens) - k - 1)]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 2)


def _batch(corpus, hidden, positions, k):
    """hidden [B, H] at t, teacher states [B, K, H] at t+1..t+K, tokens x[t+1..t+K] [B, K], targets x[t+2..t+K+1]."""
    h, teacher, tokens, targets = [], [], [], []
    for i, t in positions.tolist():
        h.append(hidden[i][t])
        teacher.append(hidden[i][t + 1 : t + k + 1])
        tokens.append(corpus[i].tokens[t + 1 : t + k + 1])
        targets.append(corpus[i].tokens[t + 2 : t + k + 2])
    device = hidden[0].device
    return torch.stack(h), torch.stack(teacher), torch.stack(tokens).to(device), torch.stack(targets).to(device)


def train_heads(model: nn.Module, corpus: list[Continuation], config: TrainConfig, out_dir: str | None = None,
                progress: bool = True) -> tuple[nn.Module, HeadsConfig, list[float]]:  # fmt: skip
    """Train heads on `corpus` (see module docstring); returns (heads, config, loss per step) and
    saves them to `out_dir` when given."""
    from tqdm.auto import tqdm

    if len(corpus) <= config.held_out:
        raise InvalidParameterError(f"the corpus has {len(corpus)} sequences, held_out is {config.held_out}")
    torch.manual_seed(config.seed)
    lm_head, embed = model.lm_head, model.model.embed_tokens
    device = lm_head.weight.device
    k = config.num_heads
    train_set, held_out = corpus[config.held_out :], corpus[: config.held_out]
    hidden = hidden_states(model, train_set)
    positions = _positions(train_set, k)
    if len(positions) == 0:
        raise InvalidParameterError("the corpus has no position with all head targets; generate longer sequences")
    identity = HeadsConfig(config.kind, k, lm_head.in_features, lm_head.out_features, model_fingerprint(lm_head))
    heads = make_heads(identity).to(device).train()
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=0.0)
    steps = config.epochs * math.ceil(len(positions) / config.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    generator = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []
    bar = tqdm(total=steps, desc=f"training {k} {config.kind} heads", disable=not progress)
    for _ in range(config.epochs):
        order = positions[torch.randperm(len(positions), generator=generator)]
        for batch in order.split(config.batch_size):
            h, teacher, tokens, targets = _batch(train_set, hidden, batch, k)
            with torch.no_grad():
                target_log_probs = F.log_softmax(lm_head(teacher).float(), dim=-1)  # [B, K, V]: the model's own law
            states = heads(h, embed(tokens).detach())  # [B, K, H]
            log_probs = F.log_softmax(lm_head(states).float(), dim=-1)  # [B, K, V]
            loss = F.kl_div(log_probs, target_log_probs, log_target=True, reduction="none").sum(-1).mean()  # KL(model || head)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            top1 = (log_probs.argmax(-1) == targets).float().mean(0).tolist()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", top1=" ".join(f"{a:.2f}" for a in top1))
            bar.update()
    bar.close()
    heads.eval()
    result = replace(identity, accuracy=measure_accuracy(model, heads, held_out or train_set[:1], k, config.ranks))
    if out_dir is not None:
        save_heads(heads, result, out_dir)
    return heads, result, losses


@torch.no_grad()
def measure_accuracy(model: nn.Module, heads: nn.Module, corpus: list[Continuation], k: int, ranks: int):
    """accuracy[d][r]: how often head d+1's rank-r token is the model's greedy x[t+d+2]."""
    hidden = hidden_states(model, corpus)
    positions = _positions(corpus, k)
    hits = torch.zeros(k, ranks)
    for batch in positions.split(256):
        h, _, tokens, targets = _batch(corpus, hidden, batch, k)
        logits = model.lm_head(heads(h, model.model.embed_tokens(tokens)))  # [B, K, V]
        top = logits.topk(ranks, dim=-1).indices  # [B, K, R]
        hits += (top == targets[..., None]).float().sum(0).cpu()
    total = max(len(positions), 1)
    return tuple(tuple(round(float(v) / total, 4) for v in row) for row in hits)
