"""Draft heads (Medusa, Hydra): modules, saving and loading, training."""

from specpass.heads.io import HeadsMismatchError, load_heads, model_fingerprint, save_heads, shipped_heads
from specpass.heads.modules import KINDS, DraftStep, HeadsConfig, HydraHeads, MedusaHeads, make_heads

__all__ = [
    "KINDS",
    "DraftStep",
    "HeadsConfig",
    "HeadsMismatchError",
    "HydraHeads",
    "MedusaHeads",
    "load_heads",
    "make_heads",
    "model_fingerprint",
    "save_heads",
    "shipped_heads",
]
