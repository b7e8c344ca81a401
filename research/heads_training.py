"""Self-distillation of draft heads: the model labels its own data, the heads learn its distribution.

1. Corpus: the training prompts (`training_prompts`: standard-library, networkx and sympy functions,
   apart from every evaluation prompt) and the model's greedy continuations of them, generated in batches;
   a hook on the final norm keeps the normed hidden state h[t] of every position from those same
   forwards.
2. Teacher: the LM head on h[t] gives the model's own next-token law at every position, kept
   sparse: its top-32 probabilities, renormalised (computed once per position; every head that
   targets the position reuses them). A corpus without states (one loaded from a cache) gets them
   from batched forwards over the finished sequences.
3. Training: at every position t (prompt positions included: more data, and the law there is the
   model's all the same), head k (k = 1..K) learns the model's distribution of x[t+k+1] (cross-
   entropy to the sparse teacher at t+k; the loss shown is the KL divergence); Hydra heads read the
   embeddings of the sequence's own tokens x[t+1..t+k] (teacher forcing). The LM head and the
   embedding stay frozen and shared. AdamW, cosine schedule, fixed seed; a progress bar shows the
   loss and each head's top-1 agreement with the model's greedy token.
4. Draft vocabulary: the `draft_vocab` tokens most frequent in the training sequences (prompts and
   continuations), saved with the heads; the heads propose only those (heads.modules docstring).
   Training uses the same rows: a head's softmax runs over the draft vocabulary's rows of the LM
   head, against the teacher's law restricted to those tokens and renormalised. That is exactly the
   distribution the draft step ranks, and a step costs a sixth of one over all 49152 tokens for
   8192 of them, so the same time buys several times more epochs (held-out top-1 rose with them).
5. Accuracy table: on held-out sequences (`held_out_prompts`: functions of other modules than the
   training ones, so no held-out docstring is trained on in either format), at generated positions
   only (where x[t+1..] is the model's greedy text, as in decoding), how often head k's rank-r
   token (within the draft vocabulary) is the model's greedy x[t+k+1]; saved in heads.json, it
   seeds the drafter's static trees and acceptance priors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..common.errors import InvalidParameterError, require_positive_ints
from ..heads.io import model_fingerprint, save_heads
from ..heads.modules import DESIGNS, HeadsConfig, draft_vocabulary, make_heads

TEACHER_TOP = 32  # the teacher's law is kept as its top-32 probabilities (renormalised)


@dataclass(frozen=True)
class TrainConfig:
    design: str = "medusa"
    num_heads: int = 4
    prompts: int = 2000  # the first training_prompts (of 14298 under Python 3.11, networkx 3.6, sympy 1.14)
    max_new_tokens: int = 128
    epochs: int = 2
    batch_size: int = 128  # positions per step
    lr: float = 2e-3
    seed: int = 0
    held_out: int = 32  # held-out prompts (training_prompts.held_out_prompts) for the accuracy table
    ranks: int = 8  # ranks in the accuracy table
    draft_vocab: int = 8192  # tokens the heads may propose (0, or the vocabulary's size or more: all)

    def __post_init__(self):
        if self.design not in DESIGNS:
            raise InvalidParameterError(f"design must be one of {DESIGNS}, got {self.design!r}")
        require_positive_ints(self, ("num_heads", "prompts", "max_new_tokens", "epochs", "batch_size", "ranks", "held_out"))
        if not isinstance(self.draft_vocab, int) or self.draft_vocab < 0:
            raise InvalidParameterError(f"draft_vocab must be an int >= 0, got {self.draft_vocab!r}")
        if not self.lr > 0:
            raise InvalidParameterError(f"lr must be positive, got {self.lr}")


@dataclass(frozen=True)
class Continuation:
    tokens: torch.Tensor  # [L] int64: prompt + greedy continuation
    start: int  # first position t whose x[t+1] the model generated (prompt length - 1)
    hidden: torch.Tensor | None = None  # [L - 1, H] float32: final normed states of all but the last token
    layer_states: torch.Tensor | None = None  # [L - 1, n, H] float32: the same positions' inputs to n layers


class _StateCapture:
    """Forward hooks catching the states [B, S, H] of every forward: the output of the model's final
    norm (what the LM head reads; generate computes it anyway, the teacher reuses it) and the inputs of
    the decoder layers `layers` (the residual stream entering layer i: HF's hidden_states[i]; what an
    exit adapter after layers [0, i) or a feature draft reads)."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...] = ()):
        self.final: list[torch.Tensor] = []
        self.inputs: list[list[torch.Tensor]] = [[] for _ in layers]
        self.handles = [model.model.norm.register_forward_hook(lambda _m, _i, out: self.final.append(out.float().cpu()))]
        for caught, layer in zip(self.inputs, layers):
            def catch(_module, args, kwargs, caught=caught):
                caught.append((args[0] if args else kwargs["hidden_states"]).float().cpu())

            self.handles.append(model.model.layers[layer].register_forward_pre_hook(catch, with_kwargs=True))

    def take(self) -> list[list[torch.Tensor]]:
        """Each forward's states since the last take: the final norm's, then each layer's input."""
        taken = [self.final, *self.inputs]
        self.final, self.inputs = [], [[] for _ in self.inputs]
        return taken

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def generate_corpus(model: nn.Module, prompts: list[torch.Tensor], max_new_tokens: int, batch_size: int | None = None,
                    progress: bool = True, layers: tuple[int, ...] = ()) -> list[Continuation]:  # fmt: skip
    """The model's greedy continuations of `prompts` [1, P] each, up to EOS, `batch_size` at a time
    (default 48 on the CPU, 256 on a GPU), with the final normed hidden state of every position but
    the last (`Continuation.hidden`) and the residual stream entering each decoder layer of `layers`
    (`Continuation.layer_states`, in that order; none without `layers`).

    The states come from the generation's own forwards (prefill, then one token per step), caught on
    the final norm, so the teacher needs no second forward over the corpus. Batches group prompts of
    similar length, left-padded. A batched forward can round differently from a single one, so a
    near-tie may resolve otherwise than unbatched greedy: harmless here, since the training targets
    are the model's law at these states, whichever way the tie went.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    batch_size = batch_size or (48 if device.type == "cpu" else 256)
    depth = len(model.model.layers)
    if any(not 0 <= layer < depth for layer in layers):
        raise InvalidParameterError(f"layers {layers} must be decoder layers of the model, in [0, {depth})")
    config = model.generation_config
    eos = config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    pad = config.pad_token_id if config.pad_token_id is not None else min(eos, default=0)
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].shape[1])
    out: dict[int, Continuation] = {}
    capture = _StateCapture(model, tuple(layers))
    bar = tqdm(total=len(prompts), desc="self-distillation corpus", disable=not progress)
    try:
        for first in range(0, len(order), batch_size):
            chunk = order[first : first + batch_size]
            width = max(prompts[i].shape[1] for i in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, i in enumerate(chunk):
                length = prompts[i].shape[1]
                ids[row, width - length :], mask[row, width - length :] = prompts[i][0], 1
            generated = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=pad)[:, width:].cpu()  # fmt: skip
            caught = [_concat_steps(calls, width) for calls in capture.take() if calls]  # [B, width + new - 1, H]
            for row, i in enumerate(chunk):
                new = generated[row].tolist()
                stop = next((j + 1 for j, token in enumerate(new) if token in eos), len(new))
                length = prompts[i].shape[1]
                tokens = torch.cat((prompts[i][0].cpu(), torch.tensor(new[:stop], dtype=torch.long)))
                hidden, *inputs = (c[row, width - length : width + stop - 1].clone() for c in caught)  # [L - 1, H] each
                out[i] = Continuation(tokens, length - 1, hidden, torch.stack(inputs, 1) if inputs else None)
            bar.update(len(chunk))
    finally:
        capture.close()
        bar.close()
    return [out[i] for i in range(len(prompts))]


def _concat_steps(calls: list[torch.Tensor], width: int) -> torch.Tensor:
    """One generate call's states [B, width + new - 1, H] from its forwards: the prefill [B, width, H],
    then [B, 1, H] per generated token but the last."""
    prefill, *steps = calls
    if prefill.shape[1] != width or any(step.shape[1] != 1 for step in steps):
        raise RuntimeError("generate did not run one prefill and then one token per forward")
    return torch.cat([prefill, *steps], dim=1)


@dataclass(frozen=True)
class Teacher:
    """The corpus flattened: position f of the concatenated sequences has hidden[f] [H], tokens[f],
    and the model's sparse law over x[f+1]: probs[f], ids[f] [TEACHER_TOP], and the share of the
    whole law those top tokens hold (mass[f]; probs are renormalised to sum to 1)."""

    hidden: torch.Tensor  # [F, H] float32
    tokens: torch.Tensor  # [F] int64
    probs: torch.Tensor  # [F, TEACHER_TOP] float32
    ids: torch.Tensor  # [F, TEACHER_TOP] int64
    offsets: list[int]  # where each sequence starts
    mass: torch.Tensor  # [F] float32


@torch.no_grad()
def teacher(model: nn.Module, corpus: list[Continuation], chunk: int = 2048) -> Teacher:
    """The corpus's states and the model's sparse law at each. States come from the corpus when it has
    them (generate_corpus), else from batched forwards (_forward_states). The last position's state, which
    generation never computes, is left zero: no training position reads it or its law (a position t
    needs x[t+K+1], so t + K <= L - 2)."""
    device = next(model.parameters()).device
    missing = iter(_forward_states(model, [seq.tokens for seq in corpus if seq.hidden is None]))
    states = [next(missing) if seq.hidden is None else F.pad(seq.hidden.to(device), (0, 0, 0, 1)) for seq in corpus]
    hidden = torch.cat(states)  # [F, H]: each sequence's [L, H], a zero last row where generation caught them
    probs, ids, mass = [], [], []
    for part in hidden.split(chunk):
        logits = F.linear(part, model.lm_head.weight.float())  # [chunk, V]
        top = logits.softmax(-1).topk(min(TEACHER_TOP, logits.shape[-1]), dim=-1)
        mass.append(top.values.sum(-1))
        probs.append(top.values / mass[-1][:, None])
        ids.append(top.indices)
    offsets = [0]
    for seq in corpus:
        offsets.append(offsets[-1] + len(seq.tokens))
    tokens = torch.cat([seq.tokens for seq in corpus]).to(device)
    return Teacher(hidden, tokens, torch.cat(probs), torch.cat(ids), offsets[:-1], torch.cat(mass))


def _forward_states(model: nn.Module, sequences: list[torch.Tensor], tokens_per_batch: int = 16384):
    """The final normed states [L, H] of each of `sequences` [L], in order (forward_states)."""
    return [hidden for hidden, _ in forward_states(model, sequences, (), tokens_per_batch)]


@torch.no_grad()
def forward_states(model: nn.Module, sequences: list[torch.Tensor], layers: tuple[int, ...] = (),
                   tokens_per_batch: int = 16384) -> list[tuple[torch.Tensor, torch.Tensor | None]]:  # fmt: skip
    """For each of `sequences` [L], in order: its final normed states [L, H] and the residual stream
    entering each decoder layer of `layers` [L, n, H] (None without `layers`), from forwards over
    right-padded batches of similar length: causal attention never lets a position see the padding
    after it, so padding changes no state (batching may round differently, like generate_corpus's)."""
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor] = [None] * len(sequences)
    first = 0
    while first < len(order):
        last = first + 1  # grow the batch while its padded size stays within tokens_per_batch
        while last < len(order) and (last + 1 - first) * len(sequences[order[last]]) <= tokens_per_batch:
            last += 1
        chunk = order[first:last]
        ids = torch.nn.utils.rnn.pad_sequence([sequences[i] for i in chunk], batch_first=True)  # [B, W]
        output = model.model(ids.to(device), output_hidden_states=bool(layers))
        states = output.last_hidden_state.float()  # [B, W, H]
        inputs = torch.stack([output.hidden_states[i] for i in layers], 2).float() if layers else None  # [B, W, n, H]
        for row, i in enumerate(chunk):
            length = len(sequences[i])
            out[i] = (states[row, :length].clone(), inputs[row, :length].clone() if layers else None)
        first = last
    return out


def _positions(corpus: list[Continuation], offsets: list[int], k: int, generated_only: bool) -> torch.Tensor:
    """Flat positions f = offset + t whose K targets x[t+2..t+K+1] exist (t >= start if generated_only)."""
    rows = [offset + t for seq, offset in zip(corpus, offsets)
            for t in range(seq.start if generated_only else 0, len(seq.tokens) - k - 1)]  # fmt: skip
    return torch.tensor(rows, dtype=torch.long)


def _batch(data: Teacher, positions: torch.Tensor, k: int):
    """hidden [B, H] at t; tokens x[t+1..t+K] [B, K]; the teacher's law at t+1..t+K [B, K, TOP] (probs, ids)."""
    positions = positions.to(data.hidden.device)
    ahead = positions[:, None] + torch.arange(1, k + 1, device=positions.device)  # [B, K]
    return data.hidden[positions], data.tokens[ahead], data.probs[ahead], data.ids[ahead]


class _DraftVocabulary:
    """The heads' output space in training: the LM head's rows of the draft vocabulary (or all of it)."""

    def __init__(self, lm_weight: torch.Tensor, vocab_ids: torch.Tensor | None):
        device = lm_weight.device
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(device)  # [D]
        if self.vocab_ids is None:
            self.weight, self.row_of = lm_weight, None  # [V, H]
            return
        self.weight = lm_weight[self.vocab_ids]  # [D, H]
        self.row_of = torch.full((lm_weight.shape[0],), -1, dtype=torch.long, device=device)  # [V]
        self.row_of[self.vocab_ids] = torch.arange(len(self.vocab_ids), device=device)

    def law(self, probs: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's sparse law (probs, token ids [..., TOP]) restricted to the draft vocabulary and
        renormalised, with ids as its rows; a position with no mass there gets an all-zero law (no loss)."""
        if self.row_of is None:
            return probs, ids
        rows = self.row_of[ids]
        probs = probs * (rows >= 0)
        return probs / probs.sum(-1, keepdim=True).clamp_min(1e-12), rows.clamp_min(0)

    def tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """Token ids of output rows."""
        return rows if self.vocab_ids is None else self.vocab_ids[rows]


def cosine_adamw(parameters, lr: float, steps: int):
    """AdamW (no weight decay) and a cosine schedule from `lr` to 0 over `steps` steps."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    return optimizer, schedule


def sparse_kl(target: torch.Tensor, rows: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """KL(model || student), averaged over positions, on the model's sparse law: `target` [..., TOP]
    probabilities on output rows `rows` [..., TOP], against the student's `log_probs` [..., D] (its
    gradient is the cross-entropy's)."""
    return (target * (target.clamp_min(1e-12).log() - log_probs.gather(-1, rows))).sum(-1).mean()


def train_heads(model: nn.Module, corpus: list[Continuation], held_out: list[Continuation], config: TrainConfig,
                out_dir: str | None = None, progress: bool = True) -> tuple[nn.Module, HeadsConfig, list[float]]:  # fmt: skip
    """Train heads on `corpus` and measure their accuracy table on `held_out` (see module docstring);
    returns (heads, config, loss per step) and saves them to `out_dir` when given."""
    from tqdm.auto import tqdm

    if not corpus or not held_out:
        raise InvalidParameterError(f"need training and held-out sequences, got {len(corpus)} and {len(held_out)}")
    torch.manual_seed(config.seed)
    lm_weight, embed = model.lm_head.weight.detach(), model.model.embed_tokens
    device = lm_weight.device
    k = config.num_heads
    data = teacher(model, corpus)
    positions = _positions(corpus, data.offsets, k, generated_only=False)
    if len(positions) == 0:
        raise InvalidParameterError("the corpus has no position with all head targets; generate longer sequences")
    vocab, hidden_size = lm_weight.shape
    draft_vocab = config.draft_vocab if config.draft_vocab < vocab else 0
    identity = HeadsConfig(config.design, k, hidden_size, vocab, model_fingerprint(model.lm_head),
                           draft_vocab=draft_vocab)  # fmt: skip
    vocab_ids = draft_vocabulary([seq.tokens for seq in corpus], vocab, draft_vocab) if draft_vocab else None
    heads = make_heads(identity, vocab_ids).to(device).train()
    outputs = _DraftVocabulary(lm_weight, vocab_ids)
    steps = config.epochs * math.ceil(len(positions) / config.batch_size)
    optimizer, schedule = cosine_adamw(heads.parameters(), config.lr, steps)
    generator = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []
    bar = tqdm(total=steps, desc=f"training {k} {config.design} heads", disable=not progress)
    for _ in range(config.epochs):
        order = positions[torch.randperm(len(positions), generator=generator)]
        for batch in order.split(config.batch_size):
            h, tokens, probs, ids = _batch(data, batch, k)
            with torch.no_grad():
                embeds = embed(tokens)  # [B, K, H]
            states = heads(h, embeds)  # [B, K, H]
            log_probs = F.log_softmax(F.linear(states, outputs.weight).float(), dim=-1)  # [B, K, D]
            target, rows = outputs.law(probs, ids)  # [B, K, TOP]: the teacher on the draft vocabulary
            loss = sparse_kl(target, rows, log_probs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            top1 = (outputs.tokens(log_probs.argmax(-1)) == ids[..., 0]).float().mean(0).tolist()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", top1=" ".join(f"{a:.2f}" for a in top1))
            bar.update()
    bar.close()
    heads.eval()
    result = replace(identity, accuracy=measure_accuracy(model, heads, held_out, k, config.ranks))
    if out_dir is not None:
        save_heads(heads, result, out_dir)
    return heads, result, losses


@torch.no_grad()
def measure_accuracy(model: nn.Module, heads: nn.Module, corpus: list[Continuation], k: int, ranks: int):
    """accuracy[d][r]: how often head d+1's rank-r token (in the draft vocabulary) is the model's greedy
    x[t+d+2], at generated t."""
    data = teacher(model, corpus)
    positions = _positions(corpus, data.offsets, k, generated_only=True)
    outputs = _DraftVocabulary(model.lm_head.weight, getattr(heads, "draft_vocab", None))
    hits = torch.zeros(k, ranks)
    for batch in positions.split(256):
        h, tokens, _, ids = _batch(data, batch, k)
        logits = F.linear(heads(h, model.model.embed_tokens(tokens)), outputs.weight)  # [B, K, D]
        top = outputs.tokens(logits.topk(ranks, dim=-1).indices)  # [B, K, R]
        hits += (top == ids[..., :1]).float().sum(0).cpu()  # ids[..., 0]: the model's greedy token
    total = max(len(positions), 1)
    return tuple(tuple(round(float(v) / total, 4) for v in row) for row in hits)
