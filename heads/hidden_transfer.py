"""Hidden Transfer's trained part (Wu et al. 2024, "Parallel Decoding via Hidden Transfer for Lossless Large
Language Model Acceleration"): linear maps that turn the residual stream entering layer k at the last
accepted position p into pseudo hidden states of the K positions after it.

    pseudo_j = W_j h_k[p]        (j = 1..K: the pseudo state at position p + j; W_j [H, H])

The pseudo states then go through the target's own layers [k, L), final norm and LM head, attending to
the cached context and to the earlier pseudo states (rewrites.HiddenTransfer), so pseudo_j's logits
draft x[p+j+1]. Each W_j starts as the identity and is trained with the target frozen
(research.transfer_training). Saved as `hidden_transfer.safetensors` beside `hidden_transfer.json`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..common.errors import InvalidParameterError, require_positive_ints

WEIGHTS = "hidden_transfer.safetensors"
CONFIG = "hidden_transfer.json"
HINT = "train one with `specpass train-heads --kind hidden-transfer --layer K --heads N --out DIR`"


@dataclass(frozen=True)
class HiddenTransferConfig:
    """What a trained transfer is, which model and layer it belongs to, and how accurate it measured.

    accuracy[j][r]: on held-out data, how often pseudo token j + 1's rank-r token was the target's greedy one."""

    layer: int  # the pseudo states enter the model's layer `layer` (1 <= layer < num_layers)
    num_layers: int
    pseudo_tokens: int  # K
    hidden_size: int
    vocab_size: int
    model: str  # identity of the model: heads.io.model_fingerprint
    accuracy: tuple[tuple[float, ...], ...] = ()
    cache_size: int = 0  # the step's KV slots, where a pass placed it (rewrites.HiddenTransfer); 0 in a trained file

    def __post_init__(self):
        require_positive_ints(self, ("layer", "num_layers", "pseudo_tokens", "hidden_size", "vocab_size"),
                              "HiddenTransferConfig.")  # fmt: skip
        if self.layer >= self.num_layers:
            raise InvalidParameterError(f"a transfer into layer {self.layer} leaves none of the model's "
                                        f"{self.num_layers} layers to decode the pseudo states")  # fmt: skip


class TransferMatrices(nn.Module):
    """source [B, K, H] (token j: the state pseudo_j is transferred from) -> pseudo states [B, K, H]."""

    def __init__(self, config: HiddenTransferConfig):
        super().__init__()
        self.config = config
        k, h = config.pseudo_tokens, config.hidden_size
        self.weight = nn.Parameter(torch.eye(h).expand(k, h, h).clone())  # [K, H, H]: the identity to start

    def forward(self, source: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bkh,kgh->bkg", source, self.weight)


def save_transfer(transfer: TransferMatrices, config: HiddenTransferConfig, directory: str,
                  dtype: torch.dtype = torch.float16) -> None:  # fmt: skip
    from .io import save_module

    save_module(transfer, config, directory, WEIGHTS, CONFIG, dtype)


def read_transfer_config(directory: str) -> HiddenTransferConfig:
    from .io import read_config_file

    def build(data: dict) -> HiddenTransferConfig:
        return HiddenTransferConfig(**dict(data, accuracy=tuple(tuple(row) for row in data.get("accuracy", ()))))

    return read_config_file(directory, CONFIG, build, "hidden transfer", HINT)


def load_transfer(directory: str, lm_head: nn.Module) -> TransferMatrices:
    """The transfer in `directory`, on the LM head's device and dtype; refused for another model."""
    from .io import load_for_model

    config = read_transfer_config(directory)
    return load_for_model(TransferMatrices(config), config.model, lm_head, directory, WEIGHTS, HINT, "hidden transfer")
