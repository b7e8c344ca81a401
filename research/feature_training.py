"""Self-distillation of a feature draft (heads.feature_draft, or Clover's: heads.clover, or Chimera's:
heads.chimera) with EAGLE-3's training-time test.

1. Corpus: as for the heads (research.heads_training.generate_corpus: the training prompts and the model's greedy
   continuations), with the residual stream at the draft's three feature layers caught from the
   generation's own forwards (`Continuation.layer_states`) beside the final normed state; a corpus
   cached as tokens gets both from one batched forward pass (`with_features`). A Clover or Chimera
   draft reads the final normed state only.
2. Teacher: the model's own sparse law at every position (research.heads_training.teacher), restricted to the draft
   vocabulary and renormalised.
3. Training: whole sequences at a time, batched by similar length (`length_batches`). Every step
   j = 0..steps-1 of the chain runs at every position at once (FeatureDraftLayer.forward_chains): step 0 reads the target's features, step j > 0 the draft's
   own step j-1 output one position back, so the draft learns from the states it will see when it
   drafts several tokens ahead, not only from the target's (the training-time test). At every
   position s and step j with s >= j, the loss is the KL divergence from the model's law over x[s+2]
   (the teacher at s + 1), averaged over steps. AdamW, cosine schedule, fixed seed, a progress bar
   with the loss and each step's top-1 agreement with the model's greedy token.
4. Accuracy table, on held-out sequences at generated positions: how often the step-j draft's rank-r
   token is the model's greedy token (the chain fed the model's own tokens: the tokens a draft path
   must match to be accepted), saved in the config; it seeds the drafter's acceptance priors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..common.errors import InvalidParameterError, require_positive_ints
from ..heads.chimera import initialise_chimera
from ..heads.clover import initialise_clover
from ..heads.feature_draft import DESIGNS, FeatureDraftConfig, FeatureDraftLayer, config_for, embed_previous
from ..heads.io import feature_draft_module, model_fingerprint
from ..heads.modules import draft_vocabulary
from .heads_training import Continuation, Teacher, _DraftVocabulary, cosine_adamw, forward_states, sparse_kl, teacher


@dataclass(frozen=True)
class FeatureTrainConfig:
    prompts: int = 1000  # the first training_prompts
    max_new_tokens: int = 128
    epochs: int = 4
    sequences: int = 8  # sequences per optimizer step
    steps: int = 4  # chain steps trained at once (the training-time test's depth)
    lr: float = 1e-3
    seed: int = 0
    held_out: int = 32
    ranks: int = 8
    draft_vocab: int = 8192
    design: str = "eagle3"  # heads.feature_draft.DESIGNS

    def __post_init__(self):
        require_positive_ints(self, ("prompts", "max_new_tokens", "epochs", "sequences", "steps", "held_out", "ranks",
                                     "draft_vocab"))  # fmt: skip
        if self.design not in DESIGNS:
            raise InvalidParameterError(f"design must be one of {DESIGNS}, got {self.design!r}")
        if not self.lr > 0:
            raise InvalidParameterError(f"lr must be positive, got {self.lr}")


@dataclass(frozen=True)
class _Batch:
    """Sequences of one step on the draft's device, `width` positions s each: the features [B, W, F]
    (3H: three layers' streams; H: the final normed state)
    (float32, zero past each one's length), the embeddings' tokens x[s+1] [B, W] and the two before
    them x[s-1], x[s] [B, W, 2] (-1: before the first), the teacher's sparse
    law over x[s+2] (probs, rows [B, W, TOP]), its greedy token [B, W], and the masks [B, W]."""

    features: torch.Tensor
    next_tokens: torch.Tensor
    previous_tokens: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor
    greedy: torch.Tensor
    valid: torch.Tensor
    generated: torch.Tensor


@dataclass(frozen=True)
class _Sequences:
    """The corpus as padded sequences, kept on the host: each one's features [L_i, 3H] (bf16, unpadded:
    the corpus's largest part), tokens [N, T + 1] (x[0..T]), the teacher's sparse law over x[s+2] at
    each s (probs, rows [N, T, TOP], on the draft vocabulary), its greedy token [N, T], and which
    positions s have a target ([N, T] bool; `generated`: also s >= start)."""

    features: list[torch.Tensor]
    tokens: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor
    greedy: torch.Tensor
    valid: torch.Tensor
    generated: torch.Tensor

    def batch(self, indices: torch.Tensor, device: torch.device) -> _Batch:
        """Sequences `indices` up to the longest one's last target, on `device`."""
        width = int(self.valid[indices].sum(1).max())
        features = torch.zeros(len(indices), width, self.features[0].shape[-1])
        for row, i in enumerate(indices.tolist()):
            length = min(width, len(self.features[i]))
            features[row, :length] = self.features[i][:length]
        tokens = self.tokens[indices]  # [B, T + 1]: x[0..T]
        previous = torch.stack((F.pad(tokens, (1, 0), value=-1)[:, :width], tokens[:, :width]), -1)  # [B, W, 2]
        parts = (features, tokens[:, 1 : width + 1], previous, self.probs[indices, :width],
                 self.rows[indices, :width], self.greedy[indices, :width], self.valid[indices, :width],
                 self.generated[indices, :width])  # fmt: skip
        return _Batch(*(part.to(device) for part in parts))


@torch.no_grad()
def with_features(model: nn.Module, corpus: list[Continuation], layers: tuple[int, ...]) -> list[Continuation]:
    """The corpus with every sequence's features: those generate_corpus caught (`layers=` the draft's), else
    (a corpus cached as tokens) from batched forwards, which give the teacher's final normed states too.
    No layers (a Clover draft): the final normed states are the features."""
    if not layers:
        missing = [seq.tokens[:-1] for seq in corpus if seq.hidden is None]
        computed = iter(forward_states(model, missing, ()))
        return [seq if seq.hidden is not None else replace(seq, hidden=next(computed)[0].cpu()) for seq in corpus]
    missing = [seq.tokens[:-1] for seq in corpus if seq.layer_states is None]
    computed = iter(forward_states(model, missing, tuple(layers)))
    out = []
    for seq in corpus:
        if seq.layer_states is None:
            hidden, states = next(computed)  # [L - 1, H], [L - 1, 3, H]
            seq = replace(seq, hidden=seq.hidden if seq.hidden is not None else hidden.cpu(), layer_states=states.cpu())
        elif seq.layer_states.shape[1] != len(layers):
            raise InvalidParameterError(f"the corpus caught {seq.layer_states.shape[1]} layers, not the draft's {layers}")
        out.append(seq)
    return out


def _sequences(corpus: list[Continuation], data: Teacher, vocab: _DraftVocabulary) -> _Sequences:
    width = max(len(seq.tokens) for seq in corpus) - 2  # positions s with x[s+2]
    n, top = len(corpus), data.probs.shape[1]
    features = []
    tokens = torch.zeros(n, width + 1, dtype=torch.long)
    probs, rows = torch.zeros(n, width, top), torch.zeros(n, width, top, dtype=torch.long)
    greedy = torch.full((n, width), -1, dtype=torch.long)
    valid, generated = torch.zeros(n, width, dtype=torch.bool), torch.zeros(n, width, dtype=torch.bool)
    for i, (seq, offset) in enumerate(zip(corpus, data.offsets)):
        length = len(seq.tokens) - 2
        states = seq.hidden if seq.layer_states is None else seq.layer_states.flatten(1)  # [L - 1, F]
        features.append(states[:length].to(torch.bfloat16))
        tokens[i, : length + 1] = seq.tokens[: length + 1]
        law = slice(offset + 1, offset + 1 + length)  # the teacher at s + 1: the law over x[s+2]
        law_probs, law_rows = vocab.law(data.probs[law], data.ids[law])
        probs[i, :length], rows[i, :length] = law_probs.cpu(), law_rows.cpu()
        greedy[i, :length] = data.ids[law, 0].cpu()
        valid[i, :length] = True
        generated[i, max(seq.start, 0) : length] = True
    return _Sequences(features, tokens, probs, rows, greedy, valid, generated)


def train_feature_draft(model: nn.Module, corpus: list[Continuation], held_out: list[Continuation],
                        config: FeatureTrainConfig, feature_layers: tuple[int, int, int] | None = None,
                        out_dir: str | None = None, progress: bool = True, start: FeatureDraftLayer | None = None,
                        ) -> tuple[FeatureDraftLayer, FeatureDraftConfig, list[float]]:  # fmt: skip
    """Train a feature draft on `corpus` and measure its accuracy table on `held_out` (module docstring);
    both were generated with `layer_states` at the draft's feature layers. `start`: a trained draft of
    this model to train further (its vocabulary and feature layers kept; a new cosine schedule), else a
    new one. Returns (draft, its config, the loss per step) and saves them to `out_dir` when given."""
    from tqdm.auto import tqdm

    from ..heads.io import save_feature_draft

    if not corpus or not held_out:
        raise InvalidParameterError(f"need training and held-out sequences, got {len(corpus)} and {len(held_out)}")
    torch.manual_seed(config.seed)
    if start is not None:
        draft, identity = start.float(), replace(start.config, accuracy=())
    else:
        heads = config.steps if config.design == "chimera" else 0
        identity = config_for(model, config.draft_vocab, model_fingerprint(model.lm_head), config.design, heads)
        if feature_layers is not None and config.design == "eagle3":
            identity = replace(identity, feature_layers=tuple(feature_layers))
        draft = make_feature_draft(model, identity, [seq.tokens for seq in corpus])
    vocab = _DraftVocabulary(model.lm_head.weight.detach(), draft.draft_vocab)
    embed = model.model.embed_tokens
    corpus = with_features(model, corpus, identity.feature_layers)
    data = _sequences(corpus, teacher(model, corpus), vocab)
    device = model.lm_head.weight.device
    draft = draft.to(device).train()
    batches = math.ceil(len(corpus) / config.sequences)
    total = config.epochs * batches
    optimizer, schedule = cosine_adamw([p for p in draft.parameters() if p.requires_grad], config.lr, total)
    generator = torch.Generator().manual_seed(config.seed)
    lengths = data.valid.sum(1)  # [N]: positions with a target
    losses: list[float] = []
    bar = tqdm(total=total, desc=f"training a feature draft ({config.steps} chain steps)", disable=not progress)
    for _ in range(config.epochs):
        for indices in length_batches(lengths, config.sequences, generator):
            batch = data.batch(indices, device)
            with torch.no_grad():
                embeds = embed(batch.next_tokens)  # [B, T, H]: e(x[s+1])
                previous = embed_previous(embed, batch.previous_tokens)  # [B, T, 2, H]: e(x[s-1]), e(x[s])
            outputs = draft.forward_chains(batch.features, embeds, previous, config.steps)
            loss, top1 = _chain_loss(draft, outputs, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}", top1=" ".join(f"{a:.2f}" for a in top1))
            bar.update()
    bar.close()
    draft.eval()
    result = replace(identity, accuracy=measure_chain_accuracy(model, draft, held_out, config.steps, config.ranks))
    draft.config = result
    if out_dir is not None:
        save_feature_draft(draft, result, out_dir)
    return draft, result, losses


def length_batches(lengths: torch.Tensor, size: int, generator: torch.Generator, window: int = 16) -> list[torch.Tensor]:
    """One epoch's batches of `size` sequences (ceil(N / size) of them, each sequence once): a random
    order, sorted by length within windows of `window` batches, so a batch pads to a length close to
    its own; the batches in random order."""
    batches = []
    for part in torch.randperm(len(lengths), generator=generator).split(window * size):
        batches += list(part[lengths[part].argsort()].split(size))
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def make_feature_draft(model: nn.Module, config: FeatureDraftConfig, sequences: list[torch.Tensor]) -> nn.Module:
    """An untrained draft for `model`: its draft vocabulary the tokens most frequent in `sequences`, its
    head initialised from those rows of the model's LM head and its final norm (where it has one) from
    the model's; a Clover or Chimera draft: its design's start too (heads.clover.initialise_clover,
    heads.chimera.initialise_chimera)."""
    draft = feature_draft_module(config)
    vocab_ids = draft_vocabulary(sequences, config.vocab_size, config.draft_vocab)
    with torch.no_grad():
        if config.design == "clover":
            initialise_clover(draft, model)
        elif config.design == "chimera":
            initialise_chimera(draft, model)
        draft.draft_vocab.copy_(vocab_ids)
        draft.head.weight.copy_(model.lm_head.weight[vocab_ids.to(model.lm_head.weight.device)].float())
        if hasattr(draft, "final_norm"):
            draft.final_norm.weight.copy_(model.model.norm.weight.float())
    return draft


def _chain_loss(draft: FeatureDraftLayer, outputs: list[torch.Tensor], batch: _Batch):
    """The mean over chain steps of the sparse KL at positions s >= j with a target; each step's top-1
    agreement with the model's greedy token."""
    losses, top1 = [], []
    for j, states in enumerate(outputs):
        where = batch.valid.clone()  # [B, T]
        where[:, :j] = False
        log_probs = F.log_softmax(draft.logits(states[where]).float(), dim=-1)  # [P, D]
        losses.append(sparse_kl(batch.probs[where], batch.rows[where], log_probs))
        chosen = draft.draft_vocab[log_probs.argmax(-1)]
        top1.append((chosen == batch.greedy[where]).float().mean().item())
    return torch.stack(losses).mean(), top1


@torch.no_grad()
def measure_chain_accuracy(model: nn.Module, draft: FeatureDraftLayer, corpus: list[Continuation], steps: int,
                           ranks: int) -> tuple[tuple[float, ...], ...]:  # fmt: skip
    """accuracy[j][r]: at generated positions, how often the step-j draft's rank-r token is the model's
    greedy token (the chain started j positions back, inside the generated text)."""
    vocab = _DraftVocabulary(model.lm_head.weight.detach(), draft.draft_vocab)
    corpus = with_features(model, corpus, draft.config.feature_layers)
    data = _sequences(corpus, teacher(model, corpus), vocab)
    hits, counts = torch.zeros(steps, ranks), torch.zeros(steps)
    embed = model.model.embed_tokens
    device = draft.draft_vocab.device
    for indices in torch.arange(len(corpus)).split(8):
        batch = data.batch(indices, device)
        outputs = draft.forward_chains(batch.features, embed(batch.next_tokens),
                                       embed_previous(embed, batch.previous_tokens), steps)  # fmt: skip
        for j, states in enumerate(outputs):
            width = batch.generated.shape[1]
            start_generated = F.pad(batch.generated, (j, 0))[:, :width]  # the chain starts at s - j
            where = batch.generated & start_generated
            where[:, :j] = False
            top = draft.draft_vocab[draft.logits(states[where]).topk(ranks, dim=-1).indices]  # [P, R]
            hits[j] += (top == batch.greedy[where][:, None]).float().sum(0).cpu()
            counts[j] += int(where.sum())
    return tuple(tuple(round(float(h) / max(float(c), 1.0), 4) for h in row) for row, c in zip(hits, counts))
