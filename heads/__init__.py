"""The trained drafts: Medusa and Hydra heads, the exit adapter, the feature draft; their modules and files
(the trainers are in `research/`)."""

from .io import HeadsMismatchError, load_heads, model_fingerprint, save_heads, shipped_heads
from .modules import DESIGNS, DraftStep, HeadsConfig, HydraHeads, MedusaHeads, make_heads

__all__ = [
    "DESIGNS",
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
