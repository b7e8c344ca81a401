"""Saving and loading trained draft modules: draft heads (`heads.safetensors` beside `heads.json`,
a HeadsConfig) and exit adapters (`exit_adapter.safetensors` beside `exit_adapter.json`, an
ExitAdapterConfig).

A draft module belongs to one model: the JSON records the model's fingerprint, and loading it for
another model is refused with the two identities in the message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import os

import torch
from torch import nn

from ..common.errors import DamagedFileError, InvalidParameterError, SpecpassError
from ..common.json_files import read_json_object
from .modules import HeadsConfig, make_heads

WEIGHTS = "heads.safetensors"
CONFIG = "heads.json"
ADAPTER_WEIGHTS = "exit_adapter.safetensors"
ADAPTER_CONFIG = "exit_adapter.json"


class HeadsMismatchError(SpecpassError):
    """The heads (or the exit adapter) were trained for another model."""


def model_fingerprint(lm_head: nn.Module) -> str:
    """Identity of a model for its heads: vocabulary and hidden size, and a hash of LM-head rows."""
    weight = lm_head.weight.detach()
    sample = weight[:: max(1, weight.shape[0] // 64)][:64].float().cpu().contiguous()
    digest = hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]
    return f"{weight.shape[0]}x{weight.shape[1]}-{digest}"


SHIPPED = ("medusa", "hydra", "exit_adapter", "feature")  # the drafts shipped for the embedded default model


def shipped_heads(name: str) -> str:
    """Directory of the draft `name` (one of SHIPPED) shipped for the embedded default model."""
    if name not in SHIPPED:
        raise ValueError(f"no shipped draft {name!r}; the shipped ones are {', '.join(SHIPPED)}")
    return str(importlib.resources.files("specpass") / "data" / "heads" / name)


def save_module(module: nn.Module, config, directory: str, weights: str, config_name: str,
                dtype: torch.dtype = torch.float16) -> None:  # fmt: skip
    """`module`'s state (floating tensors in `dtype`) to `weights` and the dataclass `config` to `config_name`."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
               for name, t in module.state_dict().items()}  # fmt: skip
    save_file(tensors, os.path.join(directory, weights))
    with open(os.path.join(directory, config_name), "w") as f:
        json.dump(dataclasses.asdict(config), f, indent=2)


def read_json(directory: str, config_name: str, what: str, hint: str) -> dict:
    """The JSON config `config_name` in `directory`; a clear error naming `what` and how to make one."""
    path = os.path.join(directory, config_name)
    if not os.path.exists(path):
        raise InvalidParameterError(f"no {what} at {directory!r} (no {config_name}); {hint}")
    data = read_json_object(path, hint)
    return data


def read_config_file(directory: str, config_name: str, build, what: str, hint: str):
    """`build`(the JSON object in `config_name`): a typed config; a missing, damaged or foreign file is one
    clear error naming `what` and `hint`."""
    data = read_json(directory, config_name, what, hint)
    try:
        return build(data)
    except (KeyError, TypeError, ValueError, SpecpassError) as exc:
        raise DamagedFileError(f"{os.path.join(directory, config_name)} is not a {what} config ({exc}); {hint}") from None


def load_weights(module: nn.Module, directory: str, weights: str, hint: str) -> None:
    """`module`'s state from the safetensors file `weights` in `directory`; a damaged or mismatched file
    is one line naming it and `hint` (how to make it again)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.path.join(directory, weights)
    try:
        module.load_state_dict(load_file(path))
    except (OSError, RuntimeError, SafetensorError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DamagedFileError(f"{path} is damaged or does not match its JSON config ({reason}); {hint}") from None


def check_model(trained_for: str, lm_head: nn.Module, directory: str, what: str) -> None:
    """Refuse a draft module trained for another model than the one `lm_head` belongs to."""
    identity = model_fingerprint(lm_head)
    if trained_for != identity:
        raise HeadsMismatchError(f"the {what} in {directory}: trained for model {trained_for}, this model is {identity}")


def load_for_model(module: nn.Module, trained_for: str, lm_head: nn.Module, directory: str, weights: str,
                   hint: str, what: str) -> nn.Module:  # fmt: skip
    """`module` (built from its config) with its weights from `directory`, on the LM head's device and
    dtype, in eval mode; refused when it was trained for another model than `lm_head`'s."""
    check_model(trained_for, lm_head, directory, what)
    load_weights(module, directory, weights, hint)
    weight = lm_head.weight
    return module.to(device=weight.device, dtype=weight.dtype).eval()


def model_mismatch(what: str, directory: str, trained_for: str, hidden_size: int, vocab_size: int,
                   gm) -> str | None:  # fmt: skip
    """Why a trained draft module (`what` in `directory`, of `hidden_size` and `vocab_size`, trained for
    model `trained_for`) does not fit the captured step `gm`, or None when it fits (a pass's check)."""
    from ..ir import arch_of

    arch = arch_of(gm)
    if (hidden_size, vocab_size) != (arch.hidden_size, arch.vocab_size):
        return (f"{what} of hidden size {hidden_size} and vocabulary {vocab_size} do not fit a model of hidden size "
                f"{arch.hidden_size} and vocabulary {arch.vocab_size}")  # fmt: skip
    identity = model_fingerprint(gm.get_submodule("lm_head"))
    if trained_for != identity:
        return f"the {what} in {directory}: trained for model {trained_for}, this model is {identity}"
    return None


def save_heads(heads: nn.Module, config: HeadsConfig, directory: str, dtype: torch.dtype = torch.float16) -> None:
    save_module(heads, config, directory, WEIGHTS, CONFIG, dtype)


HEADS_HINT = "train them again with `specpass train-heads --kind medusa|hydra --out DIR` (the shipped ones: reinstall specpass)"


def read_config(directory: str) -> HeadsConfig:
    return read_config_file(directory, CONFIG, HeadsConfig.from_dict, "draft heads", HEADS_HINT)


def load_heads(directory: str, lm_head: nn.Module) -> tuple[nn.Module, HeadsConfig]:
    """Heads from `directory`, on the LM head's device and dtype; refused for another model."""
    config = read_config(directory)
    return load_for_model(make_heads(config), config.model, lm_head, directory, WEIGHTS, HEADS_HINT, "heads"), config


FEATURE_WEIGHTS = "feature_draft.safetensors"
FEATURE_CONFIG = "feature_draft.json"
FEATURE_HINT = "train one again with `specpass train-heads --kind feature --out DIR` (the shipped one: reinstall specpass)"


def save_feature_draft(draft: nn.Module, config, directory: str, dtype: torch.dtype = torch.float16) -> None:
    save_module(draft, config, directory, FEATURE_WEIGHTS, FEATURE_CONFIG, dtype)


def read_feature_config(directory: str):
    from .feature_draft import FeatureDraftConfig

    def build(data: dict):
        data["accuracy"] = tuple(tuple(row) for row in data.get("accuracy", ()))
        data["feature_layers"] = tuple(data["feature_layers"])
        return FeatureDraftConfig(**data)

    return read_config_file(directory, FEATURE_CONFIG, build, "feature draft", FEATURE_HINT)


def feature_draft_module(config) -> nn.Module:
    """An untrained draft of `config`'s design: EAGLE-3's layer (heads.feature_draft), Clover's
    (heads.clover) or Chimera's (heads.chimera)."""
    from .chimera import ChimeraDraft
    from .clover import CloverDraft
    from .feature_draft import FeatureDraftLayer

    return {"eagle3": FeatureDraftLayer, "clover": CloverDraft, "chimera": ChimeraDraft}[config.design](config)


def load_feature_draft(directory: str, lm_head: nn.Module) -> nn.Module:
    """A feature draft from `directory`, on the LM head's device and dtype; refused for another model."""
    config = read_feature_config(directory)
    return load_for_model(feature_draft_module(config), config.model, lm_head, directory, FEATURE_WEIGHTS,
                          FEATURE_HINT, "feature draft")  # fmt: skip
