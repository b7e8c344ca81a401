"""specpass.generate and the HF `custom_generate` hook."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specpass.backends.decode import Generation
from specpass.backends.decode import generate as _decode
from specpass.backends.program import DecodeProgram, program_for
from specpass.backends.resolve import resolve
from specpass.errors import InvalidParameterError
from specpass.ir import arch_spec


def compile_program(model: nn.Module | DecodeProgram, options=None) -> DecodeProgram:
    """The speculative program of `model` (plain, or compiled with backend="specpass"); a program
    (e.g. from `load_onnx`) is returned as it is."""
    if isinstance(model, DecodeProgram):
        if options is not None:
            raise InvalidParameterError("a program's options are fixed when it is built; options must be None")
        return model
    model, opts = resolve(model, options)
    arch_spec(model)  # clear error for unsupported architectures before any capture work
    return program_for(model, opts)


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int = 128,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    options=None,
) -> Generation:
    """Greedy speculative generation; the tokens equal the model's plain greedy decoding.

    model: `torch.compile(model, backend="specpass", options=...)`, a plain HF model (then `options`
    or the defaults apply), or a program such as `load_onnx(...)`'s. eos_token_id defaults to the
    model's generation config.
    """
    program = compile_program(model, options)
    if eos_token_id is None:
        eos = program.eos_token_ids
    else:
        eos = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    return _decode(program, input_ids, max_new_tokens, eos)


def custom_generate(options=None):
    """A callable for HF's `model.generate(ids, custom_generate=specpass.custom_generate(...))`.

    HF calls it with the model and its prepared generation config; greedy settings are required.
    """

    def specpass_decoding(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **_):
        config = generation_config
        if config is not None and config.do_sample:
            raise NotImplementedError("specpass's custom_generate implements greedy decoding (do_sample=False)")
        max_new = config.max_new_tokens if config is not None and config.max_new_tokens else 20
        eos = config.eos_token_id if config is not None else None
        out = generate(model, input_ids, max_new, eos_token_id=eos, options=options)
        return out.sequences

    return specpass_decoding


def load_onnx(directory: str, **kwargs):
    """An ONNX Runtime program from a `specpass export` directory, for `generate` (see OrtProgram)."""
    from specpass.backends.onnxrt import OrtProgram

    return OrtProgram(directory, **kwargs)
