"""specpass: lossless speculative decoding as torch.compile graph rewrites.

Public contract: `load_default_model`, `generate`, `Pipeline`, the `rewrites` and `drafters` modules,
and the torch.compile backend named "specpass". `import specpass` loads nothing: each name imports its
module when it is first used (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a reader and a type checker see; at run time `__getattr__` imports on first use
    from . import drafters, rewrites
    from .api import compile_program, generate, load_onnx
    from .backends.options import CompileOptions
    from .backends.runtime.generation import BatchGeneration, Generation, GenerationStats
    from .common.errors import (
        CacheCapacityError, DamagedFileError, ExportError, GraphVerificationError, InvalidParameterError,
        PassMismatchError, PassPipelineError, SpecpassError, StaleProgramError, UnsupportedArchitectureError,
        UnsupportedSettingError,
    )
    from .hf_hook import custom_generate
    from .models import load_default_model
    from .passes import Pipeline

_ERRORS = (
    "CacheCapacityError", "DamagedFileError", "ExportError", "GraphVerificationError", "InvalidParameterError",
    "PassMismatchError", "PassPipelineError", "SpecpassError", "StaleProgramError", "UnsupportedArchitectureError",
    "UnsupportedSettingError",
)
_HOME = {  # public name -> the module that defines it
    "compile_program": ".api", "generate": ".api", "load_onnx": ".api",
    "CompileOptions": ".backends.options",
    "BatchGeneration": ".backends.runtime.generation", "Generation": ".backends.runtime.generation",
    "GenerationStats": ".backends.runtime.generation",
    **{name: ".common.errors" for name in _ERRORS},
    "custom_generate": ".hf_hook",
    "load_default_model": ".models",
    "Pipeline": ".passes",
}
_SUBPACKAGES = ("drafters", "rewrites")
__all__ = sorted([*_HOME, *_SUBPACKAGES])


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name], __name__), name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    raise AttributeError(f"module 'specpass' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
