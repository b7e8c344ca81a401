"""Saving and loading draft heads: `heads.safetensors` (the weights) beside `heads.json` (HeadsConfig).

Heads belong to one model: the JSON records the model's fingerprint, and loading them for another
model is refused with the two identities in the message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import os

import torch
from torch import nn

from specpass.errors import InvalidParameterError, SpecpassError
from specpass.heads.modules import HeadsConfig, make_heads

WEIGHTS = "heads.safetensors"
CONFIG = "heads.json"


class HeadsMismatchError(SpecpassError):
    """The heads were trained for another model."""


def model_fingerprint(lm_head: nn.Module) -> str:
    """Identity of a model for its heads: vocabulary and hidden size, and a hash of LM-head rows."""
    weight = lm_head.weight.detach()
    sample = weight[:: max(1, weight.shape[0] // 64)][:64].float().cpu().contiguous()
    digest = hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]
    return f"{weight.shape[0]}x{weight.shape[1]}-{digest}"


def shipped_heads(kind: str) -> str:
    """Directory of the heads shipped for the embedded default model."""
    return str(importlib.resources.files("specpass") / "data" / "heads" / kind)


def save_heads(heads: nn.Module, config: HeadsConfig, directory: str, dtype: torch.dtype = torch.float16) -> None:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
               for name, t in heads.state_dict().items()}  # fmt: skip
    save_file(tensors, os.path.join(directory, WEIGHTS))
    with open(os.path.join(directory, CONFIG), "w") as f:
        json.dump(dataclasses.asdict(config), f, indent=2)


def read_config(directory: str) -> HeadsConfig:
    path = os.path.join(directory, CONFIG)
    if not os.path.exists(path):
        raise InvalidParameterError(f"no draft heads at {directory!r} (no {CONFIG}); train some with `specpass train-heads`")
    with open(path) as f:
        data = json.load(f)
    data["accuracy"] = tuple(tuple(row) for row in data.get("accuracy", ()))
    return HeadsConfig(**data)


def load_heads(directory: str, lm_head: nn.Module) -> tuple[nn.Module, HeadsConfig]:
    """Heads from `directory`, on the LM head's device and dtype; refused for another model."""
    from safetensors.torch import load_file

    config = read_config(directory)
    identity = model_fingerprint(lm_head)
    if config.model != identity:
        raise HeadsMismatchError(
            f"the heads in {directory} were trained for model {config.model}, this model is {identity}"
        )
    heads = make_heads(config)
    heads.load_state_dict(load_file(os.path.join(directory, WEIGHTS)))
    weight = lm_head.weight
    return heads.to(device=weight.device, dtype=weight.dtype).eval(), config
