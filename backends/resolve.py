"""Find the model and the specpass options behind a `torch.compile(model, backend="specpass", ...)` result.

torch.compile keeps the backend's options in the wrapper it hands to dynamo; there is no public
accessor, so this walks dynamo's callback chain (`_torchdynamo_orig_backend` links, checked on
torch 2.11 and 2.13) to the wrapper that holds `compiler_fn` and `kwargs`. If that layout changes,
the error says so rather than running with the wrong options.
"""

from __future__ import annotations

from torch import nn

from .options import CompileOptions
from ..common.errors import SpecpassError


def _compile_wrapper(compiled: nn.Module):
    link = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    for _ in range(16):
        if link is None:
            break
        if hasattr(link, "compiler_fn") and hasattr(link, "kwargs") and hasattr(link, "compiler_name"):
            return link
        link = getattr(link, "_torchdynamo_orig_backend", None)
    raise SpecpassError("cannot find the torch.compile options of this module (unknown torch.compile layout)")


def resolve(model: nn.Module, options=None) -> tuple[nn.Module, CompileOptions]:
    """(original model, options) for a plain model (default or given options) or a compiled one."""
    orig = getattr(model, "_orig_mod", None)
    if orig is None:
        return model, CompileOptions.from_mapping(options)
    wrapper = _compile_wrapper(model)
    from .compile import specpass_backend

    if getattr(wrapper.compiler_fn, "__wrapped__", wrapper.compiler_fn) is not specpass_backend:
        raise SpecpassError(f"the model was compiled with backend {wrapper.compiler_name!r}, not 'specpass'")
    if options is not None:
        raise SpecpassError("pass options to torch.compile(..., options=...) or to generate, not both")
    return orig, CompileOptions.from_mapping(wrapper.kwargs.get("options"))
