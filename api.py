"""specpass.generate, compile_program and load_onnx (the HF hook is in hf_hook.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .backends.runtime.decode import generate as decode
from .backends.runtime.generation import BatchGeneration, Generation, check_batch_size, check_request, prompts_from
from .backends.runtime.program import DecodeProgram, program_for
from .backends.resolve import resolve
from .backends.runtime.sampling import Sampling, TargetChoice
from .common.errors import InvalidParameterError
from .ir import arch_spec


def compile_program(model: nn.Module | DecodeProgram, options=None, rows: int = 1) -> DecodeProgram:
    """The speculative program of `model` (plain, or compiled with backend="specpass") with a cache of
    `rows` sequences; a program (e.g. from `load_onnx`) is returned as it is."""
    if isinstance(model, DecodeProgram):
        if options is not None:
            raise InvalidParameterError("a program's options are fixed when it is built; options must be None")
        check_batch_size(model, rows)
        return model
    model, opts = resolve(model, options)
    arch_spec(model)  # clear error for unsupported architectures before any capture work
    return program_for(model, opts, rows)


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int = 128,
    *,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    options=None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int | Sequence[int] = 0,
    acceptance: str = "auto",
    streamer=None,
) -> Generation | BatchGeneration:
    """Speculative generation; the tokens equal the model's plain decoding with the same settings.

    model: `torch.compile(model, backend="specpass", options=...)`, a plain HF model (then `options`
    or the defaults apply), or a program such as `load_onnx(...)`'s. eos_token_id defaults to the
    model's generation config. Greedy by default; do_sample=True samples after temperature, top_k,
    top_p and min_p (Hugging Face's warpers) with noise keyed by (seed, position), so the same seed
    gives the same tokens with or without speculation (backends/runtime/sampling.py); drafts drawn from draft
    laws (drafters.Heads(temperature=...)) are accepted by the multi-candidate rule instead, which
    keeps the distribution but not the tokens, unless acceptance="match" (backends/runtime/multi_candidate.py).

    A batch: input_ids [B, P] with attention_mask [B, P] (1: token, 0: padding, left or right), as in
    Hugging Face. Every row's tokens equal that row generated alone, sampled rows included: a row
    samples exactly what its prompt samples alone with the same seed (backends/runtime/decode.py); the
    result is a `BatchGeneration`: `sequences` [B, P + N] (prompts left-padded, then new tokens, then
    pad_token_id, default the model's pad token, else its EOS) and per-row `stats`. seed: one for
    every row, or one per row (rows with the same prompt and seed give the same tokens).

    streamer (one prompt): Hugging Face's streamer interface (`TextStreamer`,
    `TextIteratorStreamer`): it gets the prompt, then each step's accepted tokens as they are
    accepted, then `end()`.
    """
    prompts = prompts_from(input_ids, attention_mask)
    check_request(prompts, max_new_tokens)
    seeds = [seed] * len(prompts) if isinstance(seed, int) or not isinstance(seed, Sequence) else list(seed)
    if len(seeds) != len(prompts):
        raise InvalidParameterError(f"seed: give one int, or one per row ({len(prompts)}), got {len(seeds)}")
    choices = [TargetChoice(sampling=Sampling(do_sample=do_sample, temperature=temperature, top_k=top_k,
                                              top_p=top_p, min_p=min_p, seed=s, acceptance=acceptance))
               for s in seeds]  # fmt: skip
    program = compile_program(model, options, rows=len(prompts))
    if eos_token_id is None:
        eos = program.eos_token_ids
    else:
        eos = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    batch = decode(program, prompts, max_new_tokens, eos, choices, pad_token_id=pad_token_id, streamer=streamer)
    if len(prompts) > 1:
        return batch
    return Generation(batch.sequences.to(input_ids.device), batch.stats[0])  # [1, P + N]: one row, no padding


def load_onnx(directory: str, **kwargs):
    """An ONNX Runtime program from a `specpass export` directory, for `generate` (see OrtProgram)."""
    from .backends.onnx.program import OrtProgram

    return OrtProgram(directory, **kwargs)
