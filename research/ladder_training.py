"""Recovery fine-tune of a laddered model by self-distillation from the original (issue 26).

A ladder (rewrites.LadderResidual) makes the same weights compute another function: untrained, two
laddered layers of 30 already change every greedy output of the default model (docs/experiments.md,
"Ladder residual"). The ladder authors restore a laddered Llama-3.1-8B by retraining; this is the
short version of that, with the machinery the draft heads train with:

1. Corpus: the original model's greedy continuations of the training prompts (research.heads_training.
   generate_corpus, apart from every evaluation prompt) and the original's sparse law at every
   position (research.heads_training.teacher: its top-32 probabilities, renormalised), computed before training.
2. Student: the laddered step itself: the model captured (ir.capture), rewritten by the very
   LadderResidual pass decoding uses, run in eager PyTorch with autograd, one sequence per forward
   (a prefill over a fresh cache: causal attention over the sequence's own tokens). The capture
   shares the model's parameters, so training changes the model in place, and every program compiled
   from it afterwards with the same ladder runs the recovered model (programs built before are
   dropped: a lowered program keeps copies of some weights, backends.runtime.program.forget_programs).
3. Loss: KL(original || laddered) at every position over the teacher's top-32 tokens and one more
   outcome, "any other token" (`coarse_kl`), averaged over the sequences of an optimizer step; AdamW
   with a cosine schedule, fixed seed. The heads' loss (top-32 renormalised) suits a draft, which
   only ranks tokens; its optimum puts no mass outside the top 32, which would sharpen a model
   that must keep the original's whole law. With the rest as an outcome, the original's law is the
   optimum.
4. What learns: the laddered layers' own weights (their norms, attention and MLP). The embedding, the
   (tied) LM head and every other layer stay frozen, so the function below the lowest laddered layer
   is exactly the original's, the backward pass stops there, and only those layers need saving
   (`save_recovered` / `load_recovered`, refused for another model).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.runtime.program import forget_programs
from ..common.errors import DamagedFileError, InvalidParameterError
from ..heads.io import check_model, model_fingerprint, read_json
from .heads_training import Continuation, cosine_adamw, teacher
from ..rewrites.ladder_residual import LadderResidual

WEIGHTS = "ladder.safetensors"
CONFIG = "ladder.json"


@dataclass(frozen=True)
class LadderTrainConfig:
    epochs: int = 2
    sequences_per_step: int = 4  # sequences whose gradients one optimizer step sums
    lr: float = 1e-4
    seed: int = 0

    def __post_init__(self):
        for name in ("epochs", "sequences_per_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name} must be a positive int, got {value!r}")
        if not self.lr > 0:
            raise InvalidParameterError(f"lr must be positive, got {self.lr}")


def laddered_step(model: nn.Module, ladder: LadderResidual, cache_size: int) -> torch.fx.GraphModule:
    """The model's one-sequence step with `ladder` applied, sharing the model's parameters, for
    `sequence_logits`: its K/V caches are plain attributes (lists of per-layer tensors), not buffers."""
    from ..ir import capture
    from ..passes import Pipeline

    gm, _ = Pipeline(ladder).run(capture(model, cache_size=cache_size))
    for name in ("k_cache", "v_cache"):
        cache = gm._buffers.pop(name)  # [L, 1, KV, S, D]
        object.__setattr__(gm, name, list(torch.zeros_like(cache)))
    return gm


def sequence_logits(step: torch.fx.GraphModule, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [L, V] of `tokens` [L] as one prefill over a fresh cache, differentiable. The step
    writes each layer's K/V into its cache in place and attention reads them back; with one tensor
    per layer (laddered_step), no layer's write changes a tensor another layer's backward reads, and
    fresh zeros per call carry no autograd history from one sequence to the next."""
    for name in ("k_cache", "v_cache"):
        setattr(step, name, [torch.zeros_like(layer) for layer in getattr(step, name)])  # [1, KV, S, D] each
    positions = torch.arange(len(tokens), device=tokens.device)[None]  # [1, L]
    logits, _ = step(input_ids=tokens[None], positions=positions, kv_len=len(tokens))  # [1, L, V]
    return logits[0]


def coarse_kl(probs: torch.Tensor, ids: torch.Tensor, rest: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student), averaged over positions, on the outcomes "token ids[..., i]" and "any
    other token": teacher probabilities `probs` [N, TOP] (not renormalised) and `rest` [N] (1 - their
    sum), against the student's `log_probs` [N, V]."""
    log_top = log_probs.gather(-1, ids)  # [N, TOP]
    log_rest = (-torch.expm1(log_top.logsumexp(-1))).clamp_min(1e-12).log()  # [N]: log(1 - top mass)
    top = (probs * (probs.clamp_min(1e-12).log() - log_top)).sum(-1)
    other = rest * (rest.clamp_min(1e-12).log() - log_rest)
    return (top + other).mean()


def layer_parameters(model: nn.Module, layers: tuple[int, ...]) -> dict[str, nn.Parameter]:
    """The parameters of the decoder layers `layers`, by their names in the model."""
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    return {name: p for name, p in model.named_parameters() if name.startswith(prefixes)}


def recover_ladder(model: nn.Module, ladder: LadderResidual, corpus: list[Continuation],
                   config: LadderTrainConfig = LadderTrainConfig(), progress: bool = True) -> list[float]:  # fmt: skip
    """Fine-tune the laddered layers of `model` (in place) towards the original model's law on
    `corpus` (module docstring). Call it on the original weights: the teacher is the model as it is
    when called. Returns the loss (KL, nats per position) of each optimizer step."""
    from tqdm.auto import tqdm

    if not corpus:
        raise InvalidParameterError("need training sequences, got none")
    layers = ladder.resolved(model.config.num_hidden_layers)
    if not layers:
        raise InvalidParameterError("the ladder names no layers: there is nothing to recover")
    torch.manual_seed(config.seed)
    data = teacher(model, corpus)  # the original's law, before any weight moves
    trained = layer_parameters(model, layers)
    if not trained:
        raise InvalidParameterError(f"no parameters named model.layers.<i>.* for the laddered layers {list(layers)}")
    requires_grad_before = {p: p.requires_grad for p in model.parameters()}
    device = next(model.parameters()).device
    step = laddered_step(model, ladder, max(len(seq.tokens) for seq in corpus))
    steps = config.epochs * math.ceil(len(corpus) / config.sequences_per_step)
    optimizer, schedule = cosine_adamw(list(trained.values()), config.lr, steps)
    generator = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []
    bar = tqdm(total=steps, desc=f"recovering laddered layers {list(layers)}", disable=not progress)
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in trained.values():
            p.requires_grad_(True)
        for _ in range(config.epochs):
            for batch in torch.randperm(len(corpus), generator=generator).split(config.sequences_per_step):
                optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for i in batch.tolist():
                    tokens, first = corpus[i].tokens.to(device), data.offsets[i]
                    logits = sequence_logits(step, tokens)[:-1]  # [L - 1, V]: the laws of x[1..L-1]
                    law = slice(first, first + len(tokens) - 1)
                    mass = data.mass[law]  # [L - 1]: the teacher's top-32 share
                    loss = coarse_kl(data.probs[law] * mass[:, None], data.ids[law], 1 - mass,
                                     F.log_softmax(logits.float(), dim=-1))  # fmt: skip
                    (loss / len(batch)).backward()
                    total += loss.item() / len(batch)
                optimizer.step()
                schedule.step()
                losses.append(total)
                bar.set_postfix(kl=f"{total:.4f}")
                bar.update()
    finally:
        bar.close()
        for p, flag in requires_grad_before.items():
            p.requires_grad_(flag)
        forget_programs(model)  # programs built before hold copies of the old weights
    return losses


def save_recovered(model: nn.Module, ladder: LadderResidual, directory: str, report: dict | None = None) -> None:
    """The laddered layers' weights (float32) and a JSON with the ladder, the model's identity and `report`."""
    from safetensors.torch import save_file

    layers = ladder.resolved(model.config.num_hidden_layers)
    os.makedirs(directory, exist_ok=True)
    tensors = {name: p.detach().float().cpu().contiguous() for name, p in layer_parameters(model, layers).items()}
    save_file(tensors, os.path.join(directory, WEIGHTS))
    with open(os.path.join(directory, CONFIG), "w") as f:
        json.dump({"layers": list(layers), "model": model_fingerprint(model.lm_head), "report": report or {}}, f,
                  indent=2)  # fmt: skip


def load_recovered(model: nn.Module, directory: str) -> LadderResidual:
    """Load recovered laddered layers into `model` (in place); returns the ladder to compile it with.
    Refused for another model than the one they were trained for."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    hint = "fine-tune one again with specpass.research.ladder_training.recover_ladder"
    data = read_json(directory, CONFIG, "recovered ladder", hint)
    if not isinstance(data.get("model"), str) or not isinstance(data.get("layers"), list):
        raise DamagedFileError(f"{os.path.join(directory, CONFIG)} is not a recovered ladder's config; {hint}")
    check_model(data["model"], model.lm_head, directory, "recovered ladder")
    ladder = LadderResidual(tuple(data["layers"]))
    params = layer_parameters(model, ladder.resolved(model.config.num_hidden_layers))
    try:
        tensors = load_file(os.path.join(directory, WEIGHTS))
    except (OSError, SafetensorError) as exc:
        raise DamagedFileError(f"{os.path.join(directory, WEIGHTS)} is damaged ({exc}); {hint}") from None
    if set(tensors) != set(params):
        raise InvalidParameterError(f"{directory}: its weights do not match the model's layers {data['layers']}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])
    forget_programs(model)
    return ladder

