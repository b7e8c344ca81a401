"""specpass.generate, compile_program and load_onnx (the HF hook is in hf_hook.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specpass.backends.decode import Generation, check_max_new_tokens, check_prompt
from specpass.backends.decode import generate as _decode
from specpass.backends.program import DecodeProgram, program_for
from specpass.backends.resolve import resolve
from specpass.backends.sampling import Sampling, TargetChoice
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
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    acceptance: str = "auto",
) -> Generation:
    """Speculative generation; the tokens equal the model's plain decoding with the same settings.

    model: `torch.compile(model, backend="specpass", options=...)`, a plain HF model (then `options`
    or the defaults apply), or a program such as `load_onnx(...)`'s. eos_token_id defaults to the
    model's generation config. Greedy by default; do_sample=True samples after temperature, top_k,
    top_p and min_p (Hugging Face's warpers) with noise keyed by (seed, position), so the same seed
    gives the same tokens with or without speculation (backends/sampling.py); drafts drawn from draft
    laws (drafters.Heads(temperature=...)) are accepted by the multi-candidate rule instead, which
    keeps the distribution but not the tokens, unless acceptance="match" (backends/multi_candidate.py).
    """
    check_prompt(input_ids)
    check_max_new_tokens(max_new_tokens)
    sampling = Sampling(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        seed=seed, acceptance=acceptance)  # fmt: skip
    program = compile_program(model, options)
    if eos_token_id is None:
        eos = program.eos_token_ids
    else:
        eos = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    return _decode(program, input_ids, max_new_tokens, eos, TargetChoice(sampling=sampling))


def load_onnx(directory: str, **kwargs):
    """An ONNX Runtime program from a `specpass export` directory, for `generate` (see OrtProgram)."""
    from specpass.backends.onnxrt import OrtProgram

    return OrtProgram(directory, **kwargs)
