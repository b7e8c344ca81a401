"""Training TRIM-KV's retention gates (heads.retention) on a frozen model: `specpass train-retention`.

Each step runs one training sequence twice: the frozen model (the teacher's next-token law p), then the
model with every layer's attention logits biased by its gates, logit[t, i] + (t - i) log beta_i (the
retention beta_i^(t - i) of key i at query t, per KV head), so the gates learn which tokens the model can
lose. Loss = KL(p || gated) + next-token cross-entropy + `capacity_weight` * capacity loss, where the
capacity loss holds each layer's and KV head's retained mass S_t = sum over i <= t of beta_i^(t - i) to
the memory M: mean over t of max(0, S_t - M) / max(t - M, 1) (TRIM-KV's code). Only the gates train.
Sequences: standard-library sources kept apart from the evaluation and tuning texts
(research.long_context.TRAINING_SOURCES).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..common.errors import InvalidParameterError
from ..heads.io import model_fingerprint
from ..heads.retention import RetentionConfig, RetentionGates
from .long_context import TRAINING_SOURCES, library_sequences

GATED = "specpass_retention_gated"


@dataclass(frozen=True)
class RetentionTraining:
    """capacity: the memory M (tokens per layer and KV head) the gates are trained for; sequence:
    tokens per training sequence (longer than M); steps; learning_rate (AdamW, cosine); bias: the
    gates' starting bias; inner_size: their hidden width; capacity_weight: the capacity loss's weight."""

    capacity: int = 128
    sequence: int = 512
    steps: int = 150
    learning_rate: float = 1e-3
    bias: float = 6.0
    inner_size: int = 128  # the paper's 512 is for 1.7-14B models; SmolLM2's hidden size is 576
    capacity_weight: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for name in ("capacity", "sequence", "steps", "inner_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"RetentionTraining.{name} must be an int >= 1, got {value!r}")
        if self.sequence <= self.capacity:
            raise InvalidParameterError(f"sequences of {self.sequence} tokens never exceed the capacity {self.capacity}")


def _gated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention with the retention bias (module docstring). query [B, H, T, D], key / value
    [B, KV, T, D]; the layer's log beta [B, T, KV] is in module.retention_log_beta."""
    heads, kv, t = query.shape[1], key.shape[1], query.shape[2]
    log_beta = module.retention_log_beta.transpose(1, 2).repeat_interleave(heads // kv, dim=1)  # [B, H, T]
    logits = (query @ key.repeat_interleave(heads // kv, 1).transpose(-1, -2)) * scaling  # [B, H, T, T]
    ages = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).clamp(min=0).to(logits.dtype)  # [T, T]: t - i
    logits = logits + ages * log_beta[:, :, None, :]
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = logits.softmax(-1) @ value.repeat_interleave(heads // kv, 1)
    return out.transpose(1, 2).contiguous(), None


def capacity_loss(log_beta: torch.Tensor, capacity: int) -> torch.Tensor:
    """log_beta [T, KV] of one layer -> mean over t and KV heads of max(0, S_t - M) / max(t - M, 1),
    S_t = sum over i <= t of beta_i^(t - i)."""
    t = log_beta.shape[0]
    ages = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).float()  # [T, T]
    retained = torch.exp(ages.clamp(min=0)[None] * log_beta.T[:, None, :]).masked_fill(ages[None] < 0, 0.0)  # [KV, T, T]
    mass = retained.sum(-1)  # [KV, T]
    over = (mass - capacity).clamp(min=0) / (torch.arange(t) - capacity).clamp(min=1)
    return over.mean()


class _Gating:
    """Runs the gates on each layer's normed input (forward hooks) and puts the model's attention on
    `_gated_attention` while active."""

    def __init__(self, model, gates: RetentionGates):
        self.model, self.gates, self.log_betas, self.hooks = model, gates, [], []

    def __enter__(self):
        AttentionInterface.register(GATED, _gated_attention)
        AttentionMaskInterface.register(GATED, sdpa_mask)
        self.before = self.model.config._attn_implementation
        for layer, block in enumerate(self.model.model.layers):
            self.hooks.append(block.input_layernorm.register_forward_hook(self._hook(layer, block.self_attn)))
        self.model.set_attn_implementation(GATED)
        return self

    def _hook(self, layer: int, attention):
        def hook(_, __, normed):
            attention.retention_log_beta = self.gates(layer, normed)  # [B, T, KV]
            self.log_betas.append(attention.retention_log_beta)

        return hook

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        self.model.set_attn_implementation(self.before)


def training_sequences(tokenizer, config: RetentionTraining) -> list[torch.Tensor]:
    """One sequence [sequence] of library text a step (TRAINING_SOURCES)."""
    return library_sequences(tokenizer, config.sequence, config.steps, TRAINING_SOURCES)


def train_retention(model, sequences: list[torch.Tensor], config: RetentionTraining, log=print) -> tuple[RetentionGates, dict]:
    """Gates trained on `model` (frozen), one step per sequence [T > capacity], as the module docstring
    says; returns them and a report (the loss's parts at every step, seconds)."""
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise InvalidParameterError(f"retention gates train on a decoder with model.layers, not {type(model).__name__}")
    torch.manual_seed(config.seed)
    c = model.config
    gates = RetentionGates(RetentionConfig(c.num_hidden_layers, c.hidden_size, c.num_key_value_heads, config.inner_size,
                                           config.bias, config.capacity, model_fingerprint(model.lm_head)))  # fmt: skip
    if not sequences or min(len(ids) for ids in sequences) <= config.capacity:
        raise InvalidParameterError(f"need sequences longer than the capacity {config.capacity}")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    optimizer = torch.optim.AdamW(gates.parameters(), lr=config.learning_rate, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / len(sequences))))
    history, started = [], time.perf_counter()
    for step, ids in enumerate(sequences):
        with torch.no_grad():
            teacher = model(ids[None]).logits[0].float().log_softmax(-1)  # [T, V]
        with _Gating(model, gates) as gating:
            student = model(ids[None]).logits[0].float().log_softmax(-1)
        kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        ce = F.nll_loss(student[:-1], ids[1:])
        cap = torch.stack([capacity_loss(b[0], config.capacity) for b in gating.log_betas]).mean()
        loss = kl + ce + config.capacity_weight * cap
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        history.append({"kl": kl.item(), "ce": ce.item(), "capacity": cap.item()})
        if step % 10 == 0 or step == len(sequences) - 1:
            log(f"step {step:4d}  kl {kl.item():.4f}  ce {ce.item():.3f}  capacity {cap.item():.4f}")
    report = {"config": asdict(config), "first": history[0], "last": history[-1], "history": history,
              "seconds": time.perf_counter() - started}  # fmt: skip
    return gates.eval(), report
