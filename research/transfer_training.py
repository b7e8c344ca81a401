"""Training Hidden Transfer's maps (heads.hidden_transfer) on the self-distilled corpus, the target frozen.

1. Corpus and teacher as for the heads (research.heads_training: the training prompts, the model's
   greedy continuations, its sparse law at every position).
2. Per sequence: the target's stream entering layer k at every position, h_k [T, H] (no gradient).
   For `positions` positions p drawn each step (all of them when measuring), every pseudo token
   j = 1..K is one more token of layers [k, L): state W_j h_k[p] at
   rotary position p + j, attending to the real positions <= p and to the pseudo tokens 1..j-1 of the
   same p (`pseudo_mask`): what one draft call sees in decoding. The real positions run beside them
   (their K/V are what the pseudo tokens attend to) and see only real positions, so they are the
   target's own. Pseudo token j's logits (final norm, LM head) learn the teacher's law over x[p+j+1]
   (sparse KL, at positions where it exists). AdamW, cosine schedule, fixed seed.
3. Accuracy table, on held-out sequences at generated positions: how often pseudo token j's rank-r
   token is the model's greedy x[p+j+1]; saved in the config, the drafter's priors.
The layers are called as the HF modules they are (hidden states, a 4-D additive mask, rotary
embeddings), which a Llama-style decoder layer takes; another family is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..common.errors import InvalidParameterError, require_positive_ints
from ..heads.hidden_transfer import HiddenTransferConfig, TransferMatrices, save_transfer
from ..heads.io import model_fingerprint
from .heads_training import Continuation, Teacher, cosine_adamw, sparse_kl, teacher

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # HF decoder layers called as (states, mask, positions, rotary)


@dataclass(frozen=True)
class TransferTrainConfig:
    prompts: int = 1000  # the first training_prompts
    max_new_tokens: int = 128
    epochs: int = 4
    sequences: int = 4  # sequences per optimizer step
    positions: int = 32  # positions p per sequence whose pseudo tokens a step trains (drawn each step)
    pseudo_tokens: int = 3  # K
    layer: int = 0  # the pseudo states enter this layer; 0: two thirds of the way up
    lr: float = 1e-3
    seed: int = 0
    held_out: int = 32
    ranks: int = 8

    def __post_init__(self):
        require_positive_ints(self, ("prompts", "max_new_tokens", "epochs", "sequences", "positions", "pseudo_tokens",
                                     "held_out", "ranks"))  # fmt: skip
        if self.layer < 0:
            raise InvalidParameterError(f"layer must be >= 0 (0: two thirds of the layers), got {self.layer}")
        if not self.lr > 0:
            raise InvalidParameterError(f"lr must be positive, got {self.lr}")


def default_layer(num_layers: int) -> int:
    """Two thirds of the way up: a third of the model decodes the pseudo states."""
    return max(1, min(num_layers - 1, round(2 * num_layers / 3)))


def pseudo_mask(length: int, owners: torch.Tensor, pseudo: int) -> torch.Tensor:
    """[T + M K, T + M K] bool (True: attend) over T real positions, then for each of owners [M] (a real
    position p) its pseudo tokens j = 1..K at T + m K + j - 1: a real position sees the real ones up to
    itself; pseudo (p, j) the real ones up to p and its own pseudo tokens 1..j."""
    t, k, device = length, pseudo, owners.device
    real = torch.arange(t, device=device)
    owner = owners.repeat_interleave(k)  # [M K]: p of each pseudo token
    group = torch.arange(len(owners), device=device).repeat_interleave(k)  # [M K]: m of each
    index = torch.arange(k, device=device).repeat(len(owners))  # [M K]: j - 1
    mask = torch.zeros(t + len(owner), t + len(owner), dtype=torch.bool, device=device)
    mask[:t, :t] = real[None, :] <= real[:, None]
    mask[t:, :t] = real[None, :] <= owner[:, None]
    mask[t:, t:] = (group[None, :] == group[:, None]) & (index[None, :] <= index[:, None])
    return mask


def pseudo_positions(length: int, owners: torch.Tensor, pseudo: int) -> torch.Tensor:
    """[T + M K] rotary positions: p for real position p, p + j for pseudo token j of owner p."""
    real = torch.arange(length, device=owners.device)
    steps = torch.arange(1, pseudo + 1, device=owners.device).repeat(len(owners))
    return torch.cat((real, owners.repeat_interleave(pseudo) + steps))


def pseudo_logits(model: nn.Module, transfer: TransferMatrices, tokens: torch.Tensor,
                  owners: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Logits [B, M, K, V] of the K pseudo tokens of positions owners [B, M] in sequences tokens [B, T]
    (right-padded: a padded position's pseudo tokens are garbage no valid one reads)."""
    k, layer = transfer.config.pseudo_tokens, transfer.config.layer
    (b, t), m = tokens.shape, owners.shape[1]
    with torch.no_grad():
        source = model.model(tokens, output_hidden_states=True).hidden_states[layer]  # [B, T, H]: entering layer k
    chosen = source.gather(1, owners[..., None].expand(-1, -1, source.shape[-1]))  # [B, M, H]
    pseudo = transfer(chosen.repeat_interleave(k, 1).reshape(b * m, k, -1)).reshape(b, m * k, -1)  # [B, M K, H]
    states = torch.cat((source, pseudo.to(source.dtype)), 1)  # [B, T + M K, H]
    positions = torch.stack([pseudo_positions(t, row, k) for row in owners])  # [B, N]
    allowed = torch.stack([pseudo_mask(t, row, k) for row in owners])[:, None]  # [B, 1, N, N]
    additive = torch.zeros(allowed.shape, dtype=states.dtype, device=states.device)
    additive.masked_fill_(~allowed, torch.finfo(states.dtype).min)
    rotary = model.model.rotary_emb(states, positions)
    for decoder_layer in model.model.layers[layer:]:
        states = decoder_layer(states, attention_mask=additive, position_ids=positions, position_embeddings=rotary)
        states = states[0] if isinstance(states, tuple) else states
    return model.lm_head(model.model.norm(states[:, t:])).reshape(b, m, k, -1)


def _owners(corpus: list[Continuation], sequences: list[int], count: int | None, generator: torch.Generator | None,
            generated: bool) -> torch.Tensor:  # fmt: skip
    """[B, M] positions p whose pseudo tokens a batch computes: up to `count` of each sequence's positions
    with a target for pseudo token 1 (p <= L - 3; with `generated`, p >= start), drawn without
    replacement (all of them when count is None); a shorter row repeats its first."""
    rows = []
    for i in sequences:
        seq = corpus[i]
        first = max(seq.start, 0) if generated else 0
        candidates = torch.arange(first, max(len(seq.tokens) - 2, first + 1))
        if count is not None and len(candidates) > count:
            candidates = candidates[torch.randperm(len(candidates), generator=generator)[:count]].sort().values
        rows.append(candidates)
    width = max(len(r) for r in rows)
    return torch.stack([torch.cat((r, r[:1].expand(width - len(r)))) for r in rows])


def _targets(data: Teacher, sequences: list[int], corpus: list[Continuation], owners: torch.Tensor, k: int,
             generated: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Where pseudo token j of owner p has a target (x[p+j+1] exists; with `generated`, p >= start; each
    owner once) [B, M, K] bool, and the teacher's rows there (flat indices into data, [B, M, K], 0 where none)."""
    steps = torch.arange(1, k + 1)
    where = torch.zeros(*owners.shape, k, dtype=torch.bool)
    rows = torch.zeros(*owners.shape, k, dtype=torch.long)
    for row, i in enumerate(sequences):
        seq, offset = corpus[i], data.offsets[i]
        p = owners[row]
        first = max(seq.start, 0) if generated else 0
        once = torch.ones_like(p, dtype=torch.bool)
        once[1:] = p[1:] != p[:1]  # a padding repeat of the first owner is not counted again
        where[row] = (p[:, None] + steps <= len(seq.tokens) - 2) & (p[:, None] >= first) & once[:, None]
        rows[row] = torch.where(where[row], offset + p[:, None] + steps, 0)
    return where, rows


def _padded(corpus: list[Continuation], sequences: list[int], device) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([corpus[i].tokens for i in sequences], batch_first=True).to(device)


def train_transfer(model: nn.Module, corpus: list[Continuation], held_out: list[Continuation],
                   config: TransferTrainConfig, out_dir: str | None = None, progress: bool = True,
                   ) -> tuple[TransferMatrices, HiddenTransferConfig, list[float]]:  # fmt: skip
    """Train the transfer on `corpus` and measure its accuracy table on `held_out` (module docstring);
    returns (transfer, its config, the loss per step) and saves them to `out_dir` when given."""
    if not corpus or not held_out:
        raise InvalidParameterError(f"need training and held-out sequences, got {len(corpus)} and {len(held_out)}")
    family = getattr(model.config, "model_type", "")
    if family not in FAMILIES:
        raise InvalidParameterError(f"training a hidden transfer calls the decoder layers as Llama-style layers; "
                                    f"{family!r} is not one of {FAMILIES}")  # fmt: skip
    layers = model.config.num_hidden_layers
    layer = config.layer or default_layer(layers)
    if not 1 <= layer < layers:
        raise InvalidParameterError(f"the pseudo states enter a layer in [1, {layers}), got {layer}")
    torch.manual_seed(config.seed)
    identity = HiddenTransferConfig(layer=layer, num_layers=layers, pseudo_tokens=config.pseudo_tokens,
                                    hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
                                    model=model_fingerprint(model.lm_head))  # fmt: skip
    device = model.lm_head.weight.device
    transfer = TransferMatrices(identity).to(device).train()
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:  # the target stays as it is: no gradient of its own
        p.requires_grad_(False)
    try:
        losses = _train(model, transfer, corpus, config, layer, progress)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    transfer.eval()
    result = replace(identity, accuracy=measure_transfer_accuracy(model, transfer, held_out, config.ranks))
    transfer.config = result
    if out_dir is not None:
        save_transfer(transfer, result, out_dir)
    return transfer, result, losses


def _train(model: nn.Module, transfer: TransferMatrices, corpus: list[Continuation], config: TransferTrainConfig,
           layer: int, progress: bool) -> list[float]:  # fmt: skip
    from tqdm.auto import tqdm

    device = model.lm_head.weight.device
    data = teacher(model, corpus)
    batches = math.ceil(len(corpus) / config.sequences)
    optimizer, schedule = cosine_adamw(list(transfer.parameters()), config.lr, config.epochs * batches)
    generator = torch.Generator().manual_seed(config.seed)
    positions = torch.Generator().manual_seed(config.seed + 1)
    losses: list[float] = []
    bar = tqdm(total=config.epochs * batches, desc=f"training a hidden transfer into layer {layer}",
               disable=not progress)  # fmt: skip
    for _ in range(config.epochs):
        for chunk in torch.randperm(len(corpus), generator=generator).split(config.sequences):
            sequences = chunk.tolist()
            tokens = _padded(corpus, sequences, device)
            owners = _owners(corpus, sequences, config.positions, positions, generated=False)
            where, rows = _targets(data, sequences, corpus, owners, config.pseudo_tokens, generated=False)
            logits = pseudo_logits(model, transfer, tokens, owners.to(device))[where.to(device)]  # [P, V]
            law = rows[where].to(device)
            loss = sparse_kl(data.probs[law], data.ids[law], F.log_softmax(logits.float(), -1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update()
    bar.close()
    return losses


@torch.no_grad()
def measure_transfer_accuracy(model: nn.Module, transfer: TransferMatrices, corpus: list[Continuation],
                              ranks: int) -> tuple[tuple[float, ...], ...]:  # fmt: skip
    """accuracy[j - 1][r]: at generated positions, how often pseudo token j's rank-r token is the
    model's greedy x[p+j+1]."""
    k = transfer.config.pseudo_tokens
    data = teacher(model, corpus)
    device = model.lm_head.weight.device
    hits, counts = torch.zeros(k, ranks), torch.zeros(k)
    for chunk in torch.arange(len(corpus)).split(2):
        sequences = chunk.tolist()
        tokens = _padded(corpus, sequences, device)
        owners = _owners(corpus, sequences, None, None, generated=True)
        where, rows = _targets(data, sequences, corpus, owners, k, generated=True)
        logits = pseudo_logits(model, transfer, tokens, owners.to(device))  # [B, M, K, V]
        top = logits.topk(ranks, dim=-1).indices.cpu()  # [B, M, K, R]
        greedy = data.ids[rows, 0].cpu()  # [B, M, K]: the teacher's argmax
        for j in range(k):
            at = where[..., j]
            hits[j] += (top[..., j, :][at] == greedy[..., j][at][:, None]).float().sum(0)
            counts[j] += int(at.sum())
    return tuple(tuple(round(float(h) / max(float(c), 1.0), 4) for h in row) for row, c in zip(hits, counts))
