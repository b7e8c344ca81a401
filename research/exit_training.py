"""Self-distillation of an exit adapter (heads.exit_adapter): the stream after layer k learns to say
what the whole model will say next.

The same machinery as the draft heads' (research.heads_training): the training prompts and the model's greedy
continuations of them (generate_corpus, which here also catches the residual stream entering layer k
at every position), the model's sparse next-token law at every position (the LM head on the final
normed state, top-32 renormalised), the draft vocabulary (the tokens most frequent in the corpus,
the teacher's law restricted to them and renormalised), AdamW with a cosine schedule and a fixed
seed, a progress bar with the loss and the top-1 agreement.

At every position t the adapter reads the stream after layers [0, k) at t and learns the model's law
of x[t+1] (the KL divergence from the model's law; its gradient is the cross-entropy's). It starts as
the plain exit (the model's final norm and LM-head rows), so training only ever improves on it.
Held-out agreement: on held-out sequences (training_prompts.held_out_prompts), at generated
positions, how often the adapter's top token is the model's greedy token; saved in the adapter's
JSON (`agreement`), beside the plain exit's on the same positions in the returned report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..common.errors import InvalidParameterError, require_positive_ints
from ..heads.exit_adapter import ExitAdapter, ExitAdapterConfig, plain_exit_adapter, save_exit_adapter
from ..heads.io import model_fingerprint
from ..heads.modules import draft_vocabulary
from .heads_training import TEACHER_TOP, Continuation, _DraftVocabulary, cosine_adamw, sparse_kl


@dataclass(frozen=True)
class ExitTrainConfig:
    layer: int = 4  # the adapter reads the stream after layers [0, layer)
    blocks: int = 1
    inner_size: int = 1536
    prompts: int = 2000  # the first training_prompts
    max_new_tokens: int = 128
    epochs: int = 2
    batch_size: int = 256  # positions per step
    lr: float = 1e-3
    seed: int = 0
    held_out: int = 32
    draft_vocab: int = 8192

    def __post_init__(self):
        require_positive_ints(self, ("layer", "blocks", "inner_size", "prompts", "max_new_tokens", "epochs",
                                     "batch_size", "held_out", "draft_vocab"))  # fmt: skip
        if not self.lr > 0:
            raise InvalidParameterError(f"lr must be positive, got {self.lr}")


@dataclass(frozen=True)
class ExitData:
    """Positions of a corpus, flattened: the stream entering the exit layer, the model's sparse law
    of the next token there, and whether the model generated that next token."""

    exit_hidden: torch.Tensor  # [F, H] float32
    probs: torch.Tensor  # [F, TEACHER_TOP]
    ids: torch.Tensor  # [F, TEACHER_TOP] int64; ids[:, 0] is the model's greedy token
    generated: torch.Tensor  # [F] bool


@torch.no_grad()
def exit_data(model: nn.Module, corpus: list[Continuation], layer: int, chunk: int = 2048) -> ExitData:
    """Every position t < L - 1 of every sequence: its exit state and the model's law of x[t+1]. States
    come from the corpus when generate_corpus caught them for this layer, else from batched forwards."""
    missing = iter(_states(model, [seq.tokens for seq in corpus if seq.layer_states is None], layer))
    exit_states, final_states, generated = [], [], []
    for seq in corpus:
        final, exit = (seq.hidden, seq.layer_states[:, 0]) if seq.layer_states is not None else next(missing)
        exit_states.append(exit)
        final_states.append(final)
        generated.append(torch.arange(len(seq.tokens) - 1) >= seq.start)
    weight = model.lm_head.weight.detach().float()
    probs, ids = [], []
    for part in torch.cat(final_states).split(chunk):
        top = F.linear(part.to(weight.device), weight).softmax(-1).topk(min(TEACHER_TOP, weight.shape[0]), dim=-1)
        probs.append(top.values / top.values.sum(-1, keepdim=True))
        ids.append(top.indices)
    device = weight.device
    return ExitData(torch.cat(exit_states).to(device), torch.cat(probs), torch.cat(ids), torch.cat(generated).to(device))


def _states(model: nn.Module, sequences: list[torch.Tensor], layer: int):
    """(final normed states, the stream entering `layer`), each [L - 1, H], of each sequence, one forward each."""
    device = next(model.parameters()).device
    for tokens in sequences:
        out = model.model(tokens[None, :-1].to(device), output_hidden_states=True)
        yield out.last_hidden_state[0].float().cpu(), out.hidden_states[layer][0].float().cpu()


def train_exit_adapter(model: nn.Module, corpus: list[Continuation], held_out: list[Continuation],
                       config: ExitTrainConfig, out_dir: str | None = None,
                       progress: bool = True) -> tuple[ExitAdapter, ExitAdapterConfig, dict]:  # fmt: skip
    """Train an exit adapter on `corpus`, measure it on `held_out` (module docstring) and save it to
    `out_dir` when given. Returns (adapter, its config, report: losses per step and the held-out
    agreement of the plain exit and the adapter)."""
    from tqdm.auto import tqdm

    num_layers = len(model.model.layers)
    if not 1 <= config.layer < num_layers:
        raise InvalidParameterError(f"an exit after layer {config.layer} needs 1 <= layer < {num_layers} (the model's "
                                    "layers)")  # fmt: skip
    if not corpus or not held_out:
        raise InvalidParameterError(f"need training and held-out sequences, got {len(corpus)} and {len(held_out)}")
    torch.manual_seed(config.seed)
    lm_weight = model.lm_head.weight.detach()
    vocab_size, hidden_size = lm_weight.shape
    draft_vocab = min(config.draft_vocab, vocab_size)
    vocab_ids = draft_vocabulary([seq.tokens for seq in corpus], vocab_size, draft_vocab)
    identity = ExitAdapterConfig(config.layer, hidden_size, config.inner_size, config.blocks, vocab_size, draft_vocab,
                                 float(model.config.rms_norm_eps), model_fingerprint(model.lm_head))  # fmt: skip
    adapter = plain_exit_adapter(identity, model.model.norm.weight.detach(), lm_weight, vocab_ids).float().train()
    data = exit_data(model, corpus, config.layer)
    held = exit_data(model, held_out, config.layer)
    plain = agreement(adapter, held)
    target, rows = _DraftVocabulary(lm_weight, vocab_ids).law(data.probs, data.ids)  # [F, TOP]
    steps = config.epochs * math.ceil(len(target) / config.batch_size)
    optimizer, schedule = cosine_adamw(adapter.parameters(), config.lr, steps)
    generator = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []
    bar = tqdm(total=steps, desc=f"training an exit adapter after layer {config.layer}", disable=not progress)
    for _ in range(config.epochs):
        for batch in torch.randperm(len(target), generator=generator).split(config.batch_size):
            batch = batch.to(target.device)
            log_probs = F.log_softmax(adapter(data.exit_hidden[batch]).float(), dim=-1)  # [B, D]
            loss = sparse_kl(target[batch], rows[batch], log_probs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            top1 = (adapter.vocab[log_probs.argmax(-1)] == data.ids[batch, 0]).float().mean().item()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", top1=f"{top1:.2f}")
            bar.update()
    bar.close()
    adapter.eval()
    trained = agreement(adapter, held)
    result = replace(identity, agreement=round(trained, 4))
    if out_dir is not None:
        save_exit_adapter(adapter, result, out_dir)
    return adapter, result, {"losses": losses, "plain_exit_agreement": plain, "adapter_agreement": trained}


@torch.no_grad()
def agreement(adapter: ExitAdapter, data: ExitData) -> float:
    """How often the adapter's top token is the model's greedy token, at the generated positions of `data`."""
    states, greedy = data.exit_hidden[data.generated], data.ids[data.generated, 0]
    hits = sum(int((adapter.vocab[adapter(part).argmax(-1)] == want).sum())
               for part, want in zip(states.split(1024), greedy.split(1024)))  # fmt: skip
    return hits / max(len(greedy), 1)
