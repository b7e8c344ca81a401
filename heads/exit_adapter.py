"""The exit adapter: a small trained head that turns the residual stream after an early layer into a draft
of the full model's next token (Kangaroo-style self-speculation; rewrites.EarlyExit).

A plain early exit rarely agrees with the full model on a small model: the stream after layer k is not
yet what the final norm expects. The adapter learns the rest of the way from the model's own law:

    z = x + W2 SiLU(W1 RMSNorm(x))        (`blocks` residual MLP blocks; x: the stream after layer k)
    logits = head(RMSNorm_final(z))       (over the draft vocabulary: `vocab` [D] token ids)

Initialised as the plain exit (W2 = 0, the model's final-norm weight and LM-head rows), all trained
(research.exit_training). It reads no KV cache and no other position, so the draft graph's cache writes
stay the step's own and a drafted token costs one MLP and a D-row head beyond layers [0, k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..common.errors import InvalidParameterError, require_positive_ints


@dataclass(frozen=True)
class ExitAdapterConfig:
    """What a trained exit adapter is, which model and layer it belongs to, and how well it measured."""

    layer: int  # it reads the residual stream after the model's layers [0, layer)
    hidden_size: int
    inner_size: int  # width of each block's MLP
    blocks: int
    vocab_size: int  # the model's
    draft_vocab: int  # rows of its head (the tokens it may propose)
    norm_eps: float
    model: str  # identity of the model: heads.io.model_fingerprint
    agreement: float = 0.0  # held-out top-1 agreement with the full model's greedy token (0: not measured)

    def __post_init__(self):
        names = ("layer", "hidden_size", "inner_size", "blocks", "vocab_size", "draft_vocab")
        require_positive_ints(self, names, "ExitAdapterConfig.")
        if self.draft_vocab > self.vocab_size:
            raise InvalidParameterError(f"draft_vocab {self.draft_vocab} exceeds the vocabulary ({self.vocab_size})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama-family models compute it: in float32, then back to x's dtype, times weight."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


class _Block(nn.Module):
    def __init__(self, hidden_size: int, inner_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.up = nn.Linear(hidden_size, inner_size)
        self.down = nn.Linear(inner_size, hidden_size)
        nn.init.zeros_(self.down.weight)  # the identity until trained
        nn.init.zeros_(self.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(rms_norm(x, self.norm_weight, self.eps))))


class ExitAdapter(nn.Module):
    """hidden [..., H] (the stream after layer k) -> logits [..., D] over the draft vocabulary `vocab` [D]."""

    def __init__(self, config: ExitAdapterConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.blocks = nn.ModuleList(_Block(h, config.inner_size, config.norm_eps) for _ in range(config.blocks))
        self.norm_weight = nn.Parameter(torch.ones(h))
        self.head = nn.Linear(h, config.draft_vocab, bias=False)
        self.register_buffer("vocab", torch.zeros(config.draft_vocab, dtype=torch.long))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(rms_norm(hidden, self.norm_weight, self.config.norm_eps))


def plain_exit_adapter(config: ExitAdapterConfig, final_norm_weight: torch.Tensor, lm_weight: torch.Tensor,
                       vocab: torch.Tensor) -> ExitAdapter:  # fmt: skip
    """An untrained adapter that computes the plain exit on `vocab` [D]: the model's final norm
    (`final_norm_weight` [H]) and its LM head's rows (`lm_weight` [V, H]) of those tokens."""
    adapter = ExitAdapter(config).to(device=lm_weight.device, dtype=lm_weight.dtype)
    with torch.no_grad():
        adapter.norm_weight.copy_(final_norm_weight)
        adapter.head.weight.copy_(lm_weight[vocab.to(lm_weight.device)])
        adapter.vocab.copy_(vocab)
    return adapter


def save_exit_adapter(adapter: ExitAdapter, config: ExitAdapterConfig, directory: str,
                      dtype: torch.dtype = torch.float16) -> None:  # fmt: skip
    from .io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_module

    save_module(adapter, config, directory, ADAPTER_WEIGHTS, ADAPTER_CONFIG, dtype)


ADAPTER_HINT = "train one with `specpass train-heads --kind exit-adapter --layer K` (the shipped one: reinstall specpass)"


def read_exit_adapter_config(directory: str) -> ExitAdapterConfig:
    from .io import ADAPTER_CONFIG, read_config_file

    return read_config_file(directory, ADAPTER_CONFIG, lambda data: ExitAdapterConfig(**data), "exit adapter", ADAPTER_HINT)


def load_exit_adapter(directory: str, lm_head: nn.Module) -> ExitAdapter:
    """The adapter in `directory`, on the LM head's device and dtype; refused for another model."""
    from .io import ADAPTER_WEIGHTS, load_for_model

    config = read_exit_adapter_config(directory)
    return load_for_model(ExitAdapter(config), config.model, lm_head, directory, ADAPTER_WEIGHTS, ADAPTER_HINT,
                          "exit adapter")  # fmt: skip
