"""HF's `model.generate(..., custom_generate=specpass.custom_generate(options))`: every generation
setting is honoured or refused with a `SpecpassError` naming it, never ignored.

Honoured: greedy and sampling (do_sample, temperature, top_k, top_p, min_p, typical_p, epsilon and eta
cutoffs, top_h), and the logits processors that are pure functions of (prefix, scores), applied to
every tree node with that node's own prefix: repetition penalty, no-repeat n-gram, min length / min
new tokens, bad words, sequence bias, suppress tokens (also at the beginning), forced BOS / EOS,
remove invalid values, exponential decay length penalty, renormalize logits. Stopping: max length /
max new tokens, EOS, stop strings (as `stopping_criteria=[StopStringCriteria(tokenizer, strings)]`:
HF drops the `tokenizer` argument of a callable custom_generate), max time. HF's generate never hands
a `streamer` to a callable hook (it puts the prompt into it itself and keeps it), so streaming through
the hook is not available. Sampling draws its noise from a seed: the hook's own
`seed=` argument (`model.generate(..., seed=7, custom_generate=...)`), else one int drawn from
torch's global generator, so `torch.manual_seed` makes a run reproducible. A padded batch
(input_ids [B, P] with attention_mask, padding on either side) runs in specpass.generate's loop
(backends/runtime/decode.py); the result is HF's layout (the input as given, each row's new tokens, then the
pad token). One seed rule for rows, as in specpass.generate: every row samples with the one seed, so a
row samples exactly what its prompt samples alone (identical prompts give identical samples; give
specpass.generate one seed per row for independent ones).
"""

from __future__ import annotations

import torch

from specpass.backends.runtime.decode import generate as decode
from specpass.backends.runtime.generation import prompts_from, with_new_tokens
from specpass.backends.runtime.sampling import Sampling, TargetChoice
from specpass.errors import UnsupportedSettingError

# Settings HF's generate reads that change the output in ways a verify step does not implement.
_REFUSED = {
    "num_beams": lambda v: v is not None and v > 1,
    "num_return_sequences": lambda v: v is not None and v > 1,
    "penalty_alpha": lambda v: v is not None,
    "dola_layers": lambda v: v is not None,
    "return_dict_in_generate": bool,
    "output_scores": bool,
    "output_logits": bool,
    "output_attentions": bool,
    "output_hidden_states": bool,
    "prompt_lookup_num_tokens": lambda v: v is not None,
    "assistant_early_exit": lambda v: v is not None,
    "token_healing": bool,
    "guidance_scale": lambda v: v is not None and v != 1,
    "watermarking_config": lambda v: v is not None,
}
_PROCESSORS = (  # pure functions of (input_ids, scores)
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor", "SequenceBiasLogitsProcessor", "NoBadWordsLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor",
    "ExponentialDecayLengthPenalty", "LogitNormalization", "SuppressTokensAtBeginLogitsProcessor",
    "SuppressTokensLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
    "MinPLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper",
)  # fmt: skip
_NATIVE_STOPS = ("MaxLengthCriteria", "EosTokenCriteria")  # the decode loop's own length limit and EOS
_STOPS = ("StopStringCriteria", "MaxTimeCriteria")
_HARMLESS_KWARGS = ("use_cache", "logits_to_keep", "attention_mask", "cache", "past_key_values", "position_ids")


def custom_generate(options=None):
    """A callable for HF's `model.generate(ids, custom_generate=specpass.custom_generate(options))`."""

    def specpass_decoding(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                          seed: int | None = None, **kwargs):  # fmt: skip
        from specpass.api import compile_program

        config = generation_config
        _refuse_settings(config, kwargs, input_ids)
        processors = _processors(logits_processor)
        stop = _stop(stopping_criteria)
        if config.do_sample:
            seed = int(torch.randint(0, 1 << 62, ())) if seed is None else seed
            sampling = Sampling(do_sample=True, seed=seed)  # the warpers come in HF's processor list
        else:
            if seed is not None:
                raise UnsupportedSettingError("seed applies only to sampling (do_sample=True)")
            sampling = Sampling()
        max_new = config.max_length - input_ids.shape[1]
        if max_new <= 0:
            raise UnsupportedSettingError(
                f"max_length {config.max_length} leaves no room after a prompt of {input_ids.shape[1]} tokens"
            )
        prompts = prompts_from(input_ids, kwargs.get("attention_mask"))
        program = compile_program(model, options, rows=len(prompts))
        choices = [TargetChoice(processors, sampling)] * len(prompts)
        batch = decode(program, prompts, max_new, _eos(config), choices, stop)
        pad = config.pad_token_id if isinstance(config.pad_token_id, int) else next(iter(_eos(config)), 0)
        return with_new_tokens(input_ids, batch.new_tokens, pad)  # HF's layout: the input as given, then new tokens

    return specpass_decoding


def _refuse_settings(config, kwargs: dict, input_ids: torch.Tensor) -> None:
    for name, refused in _REFUSED.items():
        value = getattr(config, name, None)
        if refused(value):
            raise UnsupportedSettingError(f"specpass's custom_generate does not implement {name}={value!r}")
    for name, value in kwargs.items():
        if name not in _HARMLESS_KWARGS and value is not None:
            raise UnsupportedSettingError(f"specpass's custom_generate does not implement the argument {name!r}")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise UnsupportedSettingError("specpass's custom_generate starts from an empty cache; a filled one was given")


def _processors(processors) -> list:
    for processor in processors or ():
        if type(processor).__name__ not in _PROCESSORS:
            raise UnsupportedSettingError(
                f"specpass's custom_generate does not implement the logits processor {type(processor).__name__} "
                f"(it applies: {', '.join(_PROCESSORS)})"
            )
    return list(processors or ())


def _stop(criteria):
    """The decode loop's per-token callback applying the stopping criteria specpass does not handle itself."""
    kept = []
    for criterion in criteria or ():
        name = type(criterion).__name__
        if name in _STOPS:
            kept.append(criterion)
        elif name not in _NATIVE_STOPS:
            raise UnsupportedSettingError(
                f"specpass's custom_generate does not implement the stopping criterion {name} "
                f"(it applies: {', '.join(_NATIVE_STOPS + _STOPS)})"
            )
    if not kept:
        return None

    def stop(tokens) -> bool:
        ids = torch.tensor([list(tokens)], dtype=torch.long)  # [1, L]
        return any(bool(criterion(ids, None).any()) for criterion in kept)

    return stop


def _eos(config) -> list[int] | None:
    eos = config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
