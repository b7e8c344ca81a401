"""The trained drafts: Medusa and Hydra heads, the exit adapter, the feature draft; their modules and files
(the trainers are in `research/`)."""

from .io import HeadsMismatchError, load_heads, model_fingerprint, save_heads, shipped_heads
from .modules import DESIGNS, HeadsConfig, HeadsStep, HydraHeads, MedusaHeads, make_heads

__all__ = [
    "DESIGNS",
    "HeadsConfig",
    "HeadsStep",
    "HeadsMismatchError",
    "HydraHeads",
    "MedusaHeads",
    "load_heads",
    "make_heads",
    "model_fingerprint",
    "save_heads",
    "shipped_heads",
]


def __getattr__(name: str):
    if name == "DraftStep":  # the 0.1 name, until 0.2 (docs/design.md, "Renamed names")
        import warnings

        warnings.warn("specpass.heads.DraftStep is now HeadsStep (the heads' draft graph; FeatureDraftStep is the "
                      "feature draft's)", DeprecationWarning, stacklevel=2)  # fmt: skip
        return HeadsStep
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
