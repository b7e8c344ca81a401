"""HF's `model.generate(..., custom_generate=specpass.custom_generate(options))`: every generation setting
is honoured or refused with a `SpecpassError` naming it, never ignored.

Each `GenerationConfig` field is listed here as honoured, refused (at the values that change the output)
or inert (it cannot change a decoder-only model's tokens); a field the lists do not know (a newer
transformers) is refused unless it holds its default. Honoured: greedy and sampling with their warpers,
the logits processors that are pure functions of (prefix, scores), applied to every tree node with its
own prefix, the stopping criteria and streaming. Sampling's seed is the hook's `seed=`, else one int from
torch's global generator. A padded batch runs in specpass.generate's loop, every row with the one seed.
What HF keeps from a callable hook (the streamer; an `assistant_model`, refused) is read from generate's
frame (docs/design.md, "The HF hook"). Out of the hook's reach: `cache_implementation="paged"`.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

from .backends.runtime.decode import generate as decode
from .backends.runtime.generation import prompts_from, with_new_tokens
from .backends.runtime.sampling import Sampling, TargetChoice
from .common.errors import UnsupportedSettingError

# Settings HF's generate reads that change the output in ways a verify step does not implement.
_REFUSED = {  # the specific before the general: num_beam_groups needs num_beams > 1
    "num_beam_groups": lambda v: v is not None and v > 1,
    "constraints": lambda v: v is not None,
    "force_words_ids": lambda v: v is not None,
    "num_beams": lambda v: v is not None and v > 1,
    "num_return_sequences": lambda v: v is not None and v > 1,
    "penalty_alpha": lambda v: v is not None,
    "dola_layers": lambda v: v is not None,
    "return_dict_in_generate": bool,
    "output_scores": bool,
    "output_logits": bool,
    "output_attentions": bool,
    "output_hidden_states": bool,
    "prompt_lookup_num_tokens": lambda v: v is not None,  # HF's own speculation: specpass's drafter is in `options`
    "assistant_early_exit": lambda v: v is not None,
    "use_mtp": bool,
    "is_assistant": bool,  # set by HF's assisted generation on its assistant model
    "speculation_type": lambda v: v is not None,
    "token_healing": bool,
    "guidance_scale": lambda v: v is not None and v != 1,
    "watermarking_config": lambda v: v is not None,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1,
    "encoder_no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "cache_implementation": lambda v: v == "quantized",  # a lossy cache
}
# Settings the hook applies: it reads them, or HF turns them into the processors and stopping criteria below.
_HONOURED = frozenset((
    "do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h",
    "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "suppress_tokens",
    "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty",
    "remove_invalid_values", "renormalize_logits", "min_length", "min_new_tokens", "max_length", "max_new_tokens",
    "max_time", "stop_strings", "eos_token_id", "pad_token_id",
))  # fmt: skip
# Settings that cannot change a decoder-only model's tokens once the refused ones are at their defaults.
_INERT = {
    "bos_token_id": "read only when generate gets no input ids",
    "decoder_start_token_id": "encoder-decoder models only",
    "use_cache": "how HF's loop caches; specpass decodes with its own cache",
    "cache_implementation": "how HF's loop caches (its exact caches); specpass decodes with its own cache",
    "cache_config": "how HF's loop caches; specpass decodes with its own cache",
    "max_cache_len": "how HF's loop caches; specpass decodes with its own cache",
    "prefill_chunk_size": "how HF's loop runs the prompt; specpass runs it in its own pieces",
    "compile_config": "how HF's loop compiles; specpass's program is its own",
    "disable_compile": "how HF's loop compiles; specpass's program is its own",
    "low_memory": "read only by beam and contrastive search (refused)",
    "length_penalty": "read only by beam search (refused)",
    "early_stopping": "read only by beam search (refused)",
    "diversity_penalty": "read only by group beam search (refused)",
    "num_assistant_tokens": "read only by HF's assisted generation (refused)",
    "num_assistant_tokens_schedule": "read only by HF's assisted generation (refused)",
    "assistant_confidence_threshold": "read only by HF's assisted generation (refused)",
    "assistant_lookbehind": "read only by HF's assisted generation (refused)",
    "target_lookbehind": "read only by HF's assisted generation (refused)",
    "max_matching_ngram_size": "read only by HF's assisted generation (refused)",
    "assistant_ensemble_weight": "read only by HF's assisted generation (refused)",
    "continuous_batching_config": "read only by HF's continuous batching (generate_batch), which never calls the hook",
    "transformers_version": "metadata",
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
        from .api import compile_program

        config = generation_config
        if _generate_argument(sys._getframe(1), "assistant_model") is not None:
            raise UnsupportedSettingError("specpass's custom_generate does not take an assistant_model: "
                                          "its drafter is chosen in the options (specpass.custom_generate(options))")  # fmt: skip
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
        streamer = _generate_argument(sys._getframe(1), "streamer")
        batch = decode(program, prompts, max_new, _eos(config), choices, stop, streamer=streamer)
        pad = config.pad_token_id if isinstance(config.pad_token_id, int) else next(iter(_eos(config)), 0)
        return with_new_tokens(input_ids, batch.new_tokens, pad)  # HF's layout: the input as given, then new tokens

    return specpass_decoding


def _refuse_settings(config, kwargs: dict, input_ids: torch.Tensor) -> None:
    for name, refused in _REFUSED.items():
        value = getattr(config, name, None)
        if refused(value):
            raise UnsupportedSettingError(f"specpass's custom_generate does not implement {name}={value!r}")
    unknown = [(name, value) for name, value in config.to_dict().items() if not name.startswith("_")
               and name not in _REFUSED and name not in _HONOURED and name not in _INERT and value != _default_setting(name)]  # fmt: skip
    if unknown:  # a setting of a newer transformers, or an attribute set by hand: never ignored
        name, value = unknown[0]
        raise UnsupportedSettingError(f"specpass's custom_generate does not know the generation setting "
                                      f"{name}={value!r}; leave it at its default")  # fmt: skip
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


def _generate_argument(caller, name: str):
    """An argument HF's generate keeps from a callable custom_generate (`streamer`, `assistant_model`), read
    from its frame when it is the hook's caller (None for a direct call); a streamer comes wrapped to skip
    the prompt generate has put already."""
    from transformers.generation.utils import GenerationMixin

    if caller.f_code is not _generate_code(GenerationMixin):
        return None
    value = caller.f_locals.get(name)
    return _AfterPrompt(value) if name == "streamer" and value is not None else value


@functools.cache
def _generate_code(mixin: type):
    return inspect.unwrap(mixin.generate).__code__


@functools.cache
def _default_setting(name: str):
    from transformers import GenerationConfig

    return GenerationConfig().to_dict().get(name)


class _AfterPrompt:
    """A streamer whose first `put` (the prompt, which HF's generate has put already) is dropped."""

    def __init__(self, streamer):
        self.streamer, self.prompt_seen = streamer, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.streamer.put(value)
        self.prompt_seen = True

    def end(self) -> None:
        self.streamer.end()
