"""TRIM-KV's retention gates: one small MLP per layer that scores a token when it is created.

For the attention input x of a layer (after its norm), log beta = logsigmoid(W2 silu(W1 x + b1) + bias),
one value per KV head; the token's retention at time t is beta^(t - its position), and an evicting
cache keeps the tokens whose retention is highest (rewrites.kv_eviction.TrimKV). The bias starts large,
so an untrained gate retains everything alike. Saved as `retention.safetensors` beside `retention.json`
(a RetentionConfig naming the model's fingerprint); trained by specpass.research.retention_training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .io import load_weights, read_config_file, save_module

WEIGHTS = "retention.safetensors"
CONFIG = "retention.json"
HINT = "train gates with `specpass train-retention` (specpass.research.retention_training)"


@dataclass(frozen=True)
class RetentionConfig:
    """num_layers, hidden_size, num_kv_heads: the model's; inner_size: the gates' hidden width;
    bias: the starting bias (sigmoid(10) retains 0.99995 a step); capacity: the memory M the gates
    were trained for (0: untrained); model: the model's fingerprint (heads.io.model_fingerprint)."""

    num_layers: int
    hidden_size: int
    num_kv_heads: int
    inner_size: int = 128
    bias: float = 10.0
    capacity: int = 0
    model: str = ""


class RetentionGates(nn.Module):
    """The gates of every layer (module docstring)."""

    def __init__(self, config: RetentionConfig):
        super().__init__()
        self.config = config
        self.first = nn.ModuleList(nn.Linear(config.hidden_size, config.inner_size) for _ in range(config.num_layers))
        self.second = nn.ModuleList(
            nn.Linear(config.inner_size, config.num_kv_heads, bias=False) for _ in range(config.num_layers)
        )
        self.bias = nn.Parameter(torch.full((config.num_layers, config.num_kv_heads), float(config.bias)))

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] (the layer's attention input) -> log beta [..., KV], float32, <= 0."""
        z = self.second[layer](F.silu(self.first[layer](x.to(self.bias.dtype))))
        return F.logsigmoid(z + self.bias[layer]).float()


def save_gates(gates: RetentionGates, directory: str) -> None:
    """The gates in float16 (their config in JSON); loading returns float32 modules."""
    save_module(gates, gates.config, directory, WEIGHTS, CONFIG)


def gates_config(directory: str) -> RetentionConfig:
    """The config of the gates saved in `directory` (a clear error where there are none)."""
    return read_config_file(directory, CONFIG, lambda data: RetentionConfig(**data), "retention gates", HINT)


def load_gates(directory: str) -> RetentionGates:
    """The gates saved in `directory`, in eval mode (the pass checks the model: heads.io.model_mismatch)."""
    gates = RetentionGates(gates_config(directory))
    load_weights(gates, directory, WEIGHTS, HINT)
    return gates.eval()
