"""Which Hugging Face causal LMs specpass can capture, and their shape parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .families import family_of


@dataclass(frozen=True)
class ArchSpec:
    """Shape parameters of a decoder of a registered family (ir.families), read from the HF config."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_windows: tuple[int | None, ...]  # each layer's sliding window (None: full attention)
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None = None  # what fills a batch's finished rows (None: the first EOS id)

    @property
    def smallest_window(self) -> int | None:
        """The narrowest sliding window of any layer (None: every layer attends to the whole cache)."""
        windows = [w for w in self.layer_windows if w is not None]
        return min(windows) if windows else None

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def _eos_ids(model) -> tuple[int, ...]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _pad_id(model) -> int | None:
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    pad = getattr(model.config, "pad_token_id", None) if pad is None else pad
    return int(pad) if isinstance(pad, int) else None


def arch_spec(model: torch.nn.Module) -> ArchSpec:
    """Read the ArchSpec of `model`, raising UnsupportedArchitectureError for an unregistered family."""
    family = family_of(model)
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ArchSpec(
        architecture=type(model).__name__,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        layer_windows=family.layer_windows(config),
        eos_token_ids=_eos_ids(model),
        pad_token_id=_pad_id(model),
    )
