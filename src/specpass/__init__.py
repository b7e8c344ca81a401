"""specpass: lossless speculative decoding as torch.compile graph rewrites.

Public contract: `load_default_model`, `generate`, `Pipeline`, the `rewrites` and `drafters` modules,
and the torch.compile backend named "specpass".
"""

from specpass import drafters, rewrites
from specpass.api import compile_program, generate, load_onnx
from specpass.backends.runtime.generation import BatchGeneration, Generation, GenerationStats
from specpass.backends.options import CompileOptions
from specpass.errors import (
    CacheCapacityError,
    DamagedFileError,
    ExportError,
    GraphVerificationError,
    InvalidParameterError,
    PassMismatchError,
    PassPipelineError,
    SpecpassError,
    StaleProgramError,
    UnsupportedArchitectureError,
    UnsupportedSettingError,
)
from specpass.hf_hook import custom_generate
from specpass.models import load_default_model
from specpass.passes import Pipeline

__all__ = [
    "BatchGeneration",
    "CacheCapacityError",
    "DamagedFileError",
    "CompileOptions",
    "ExportError",
    "Generation",
    "GenerationStats",
    "GraphVerificationError",
    "InvalidParameterError",
    "PassMismatchError",
    "PassPipelineError",
    "Pipeline",
    "SpecpassError",
    "StaleProgramError",
    "UnsupportedArchitectureError",
    "UnsupportedSettingError",
    "compile_program",
    "custom_generate",
    "drafters",
    "generate",
    "load_default_model",
    "load_onnx",
    "rewrites",
]
