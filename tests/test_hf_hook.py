"""HF's `generate(..., custom_generate=specpass.custom_generate())` honours the generation config
(greedy with logits processors equals HF generate token for token) or refuses a setting by name."""

import pytest
import torch
from transformers import CompileConfig, GenerationConfig, LogitsProcessorList, StoppingCriteriaList, StopStringCriteria
from transformers.generation.logits_process import TypicalLogitsWarper

import specpass
from conftest import FIXED_BUDGET, NEW_TOKENS, padded, peaked_tiny_model
from specpass.drafters import PromptLookup
from specpass.rewrites import TreeAttention

FIXED_TREES = {"budget": FIXED_BUDGET}  # no cost curve to measure
HOOK = specpass.custom_generate(FIXED_TREES)
ONE_NODE = specpass.custom_generate({"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))})


def _seen_settings(continuation: list[int], eos: int) -> dict:
    """Each greedy setting the hook honours, built on a case's own greedy continuation so that HF's output
    differs from plain greedy (the test asserts it: a setting the hook ignored would show)."""
    t0, t1 = continuation[:2]
    return {
        "repetition_penalty": dict(repetition_penalty=1.5),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=1),  # no token twice
        "bad_words_ids": dict(bad_words_ids=[[t0]]),
        "bad_words_ids (a pair)": dict(bad_words_ids=[[t0, t1]]),  # t1 is banned right after t0
        "sequence_bias": dict(sequence_bias={(t0,): -50.0}),
        "sequence_bias (a pair)": dict(sequence_bias={(t0, t1): -50.0}),
        "suppress_tokens": dict(suppress_tokens=[t0]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[t0]),
        "forced_eos_token_id": dict(forced_eos_token_id=eos),  # the last token allowed is EOS
        "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(2, 3.0)),  # EOS soon after 2
        "max_time": dict(max_time=0.0),  # MaxTimeCriteria: over at the first check, after one token
        "eos_token_id": dict(eos_token_id=t1),  # ends at the second token
    }


SEEN = list(_seen_settings([0, 1], 2))


@pytest.mark.parametrize("name", SEEN)
def test_each_greedy_setting_changes_hf_output_and_the_hook_equals_it(default_model, cases, name):
    model, _ = default_model
    ids, reference = cases[0]
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    settings = _seen_settings(reference[0, ids.shape[1] :].tolist(), eos)[name]
    expected = model.generate(ids, max_new_tokens=8, do_sample=False, **settings)
    assert not torch.equal(expected, reference[:, : ids.shape[1] + 8])  # the case sees the setting
    out = model.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=HOOK, **settings)
    assert torch.equal(out, expected)


def test_several_settings_at_once_on_code_and_chat(default_model, cases):
    """remove_invalid_values and renormalize_logits cannot change a finite model's greedy tokens: they
    run here beside settings that do, and must not disturb them."""
    model, _ = default_model
    settings = dict(repetition_penalty=1.2, no_repeat_ngram_size=4, suppress_tokens=[198], remove_invalid_values=True,
                    renormalize_logits=True)  # fmt: skip
    for ids, _ in (cases[0], cases[3]):
        reference = model.generate(ids, max_new_tokens=24, do_sample=False, **settings)
        out = model.generate(ids, max_new_tokens=24, do_sample=False, custom_generate=HOOK, **settings)
        assert torch.equal(out, reference)


def test_forced_bos_on_a_one_token_prompt(default_model, cases):
    """HF forces the BOS token only when the prompt is one token long."""
    model, _ = default_model
    ids = cases[0][0][:, :1]
    plain = model.generate(ids, max_new_tokens=8, do_sample=False)
    forced = plain[0, 1].item() + 1
    expected = model.generate(ids, max_new_tokens=8, do_sample=False, forced_bos_token_id=forced)
    assert expected[0, 1].item() == forced and not torch.equal(expected, plain)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, forced_bos_token_id=forced, custom_generate=HOOK)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("length", ["min_new_tokens", "min_length"])
def test_min_length_holds_back_eos(default_model, cases, length):
    model, _ = default_model
    ids, reference = next((i, r) for i, r in cases if r.shape[1] < i.shape[1] + NEW_TOKENS)  # ends at EOS
    eos_at = reference.shape[1] - ids.shape[1]
    least = eos_at + 5 if length == "min_new_tokens" else reference.shape[1] + 5
    settings = {length: least, "max_new_tokens": eos_at + 8, "do_sample": False}
    out = model.generate(ids, custom_generate=HOOK, **settings)
    assert torch.equal(out, model.generate(ids, **settings))
    assert out.shape[1] > reference.shape[1]


def test_stop_strings_equal_hf_generate(default_model, cases):
    """HF drops the `tokenizer` argument for callable custom_generate, so stop strings come in as
    StopStringCriteria (what HF builds from stop_strings)."""
    model, tokenizer = default_model
    ids, _ = cases[0]
    reference = model.generate(ids, max_new_tokens=64, do_sample=False, stop_strings=["return"], tokenizer=tokenizer)
    criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, ["return"])])
    out = model.generate(ids, max_new_tokens=64, do_sample=False, stopping_criteria=criteria, custom_generate=HOOK)
    assert torch.equal(out, reference)
    assert reference.shape[1] < ids.shape[1] + 64  # the stop string did stop it


def test_sampling_through_the_hook_is_seeded(default_model, cases):
    model, _ = default_model
    ids, _ = cases[0]
    settings = dict(max_new_tokens=24, do_sample=True, temperature=0.7, top_p=0.9, custom_generate=HOOK)
    torch.manual_seed(0)
    a = model.generate(ids, **settings)
    torch.manual_seed(0)
    b = model.generate(ids, **settings)
    assert torch.equal(a, b)
    c = model.generate(ids, seed=11, **settings)
    d = specpass.generate(model, ids, 24, do_sample=True, temperature=0.7, top_p=0.9, seed=11, options=FIXED_TREES)
    assert torch.equal(c, d.sequences)  # the hook's seed= is specpass.generate's seed
    # sampling after HF's processors (typical_p, a repetition penalty) is lossless too: speculative
    # equals one-node trees with the same seed
    more = dict(typical_p=0.5, repetition_penalty=1.2, seed=11)
    for ids, _ in cases[:1]:  # typical_p alone: test_each_warper_changes_the_sample_and_speculation_keeps_it
        assert torch.equal(model.generate(ids, **settings, **more), model.generate(ids, **(settings | {"custom_generate": ONE_NODE}), **more))


WARPERS = {  # strong settings at T = 1, so that the warper shows in a 12-token sample
    "top_k": dict(top_k=2),
    "min_p": dict(min_p=0.3),
    "typical_p": dict(typical_p=0.2),
    "epsilon_cutoff": dict(epsilon_cutoff=0.1),
    "eta_cutoff": dict(eta_cutoff=0.1),
    "top_h": dict(top_h=0.2),
}


@pytest.mark.parametrize("name", list(WARPERS))
def test_each_warper_changes_the_sample_and_speculation_keeps_it(default_model, cases, name):
    """With the same seed, sampling with the warper differs from sampling without it, and speculative
    sampling through the hook equals one-node sampling through the hook (HF draws other noise, so HF's
    own sample is not the reference; the law is HF's: backends/runtime/sampling.py)."""
    model, _ = default_model
    ids, _ = cases[3]
    base = dict(max_new_tokens=12, do_sample=True, seed=5)
    warped = model.generate(ids, custom_generate=HOOK, **base, **WARPERS[name])
    assert not torch.equal(warped, model.generate(ids, custom_generate=HOOK, **base))
    assert torch.equal(warped, model.generate(ids, custom_generate=ONE_NODE, **base, **WARPERS[name]))


def test_max_length_and_pad_token_id_in_a_batch():
    """max_length counts the prompt; pad_token_id fills a row that ended at EOS, as HF's generate lays it out."""
    model = peaked_tiny_model()
    prompts = [torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 11)]
    ids, mask = padded(prompts)
    alone = model.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]), max_new_tokens=3, do_sample=False)
    eos = int(alone[0, -1])  # row 0's third token: it ends there
    settings = dict(attention_mask=mask, max_length=ids.shape[1] + 10, do_sample=False, eos_token_id=eos, pad_token_id=7)
    expected = model.generate(ids, **settings)
    hook = specpass.custom_generate({"lowering": "eager", "drafter": PromptLookup(), "budget": FIXED_BUDGET})
    out = model.generate(ids, custom_generate=hook, **settings)
    assert torch.equal(out, expected)
    assert out.shape[1] > ids.shape[1] + 3 and out[0, ids.shape[1] + 3 :].eq(7).all()  # row 0 padded after its EOS


# Every GenerationConfig field: honoured (the test that shows HF's output with it and the hook's agree),
# refused (an example that the hook refuses by name), or inert (an example that changes neither HF's
# greedy output nor the hook's).
HONOURED_BY = {
    **dict.fromkeys((name.split(" (")[0] for name in SEEN), "test_each_greedy_setting_changes_hf_output_and_the_hook_equals_it"),
    "remove_invalid_values": "test_several_settings_at_once_on_code_and_chat",
    "renormalize_logits": "test_several_settings_at_once_on_code_and_chat",
    "forced_bos_token_id": "test_forced_bos_on_a_one_token_prompt",
    "min_new_tokens": "test_min_length_holds_back_eos",
    "min_length": "test_min_length_holds_back_eos",
    "stop_strings": "test_stop_strings_equal_hf_generate",
    "max_new_tokens": "test_each_greedy_setting_changes_hf_output_and_the_hook_equals_it",
    "max_length": "test_max_length_and_pad_token_id_in_a_batch",
    "pad_token_id": "test_max_length_and_pad_token_id_in_a_batch",
    "do_sample": "test_sampling_through_the_hook_is_seeded",
    "temperature": "test_sampling_through_the_hook_is_seeded",
    "top_p": "test_sampling_through_the_hook_is_seeded",
    **dict.fromkeys(WARPERS, "test_each_warper_changes_the_sample_and_speculation_keeps_it"),
}
REFUSED = {
    "num_beams": dict(num_beams=2),
    "num_beam_groups": dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5),
    "constraints": dict(constraints=[]),
    "force_words_ids": dict(force_words_ids=[[5]]),
    "num_return_sequences": dict(num_return_sequences=2, do_sample=True),
    "penalty_alpha": dict(penalty_alpha=0.6, top_k=4),
    "dola_layers": dict(dola_layers="low"),
    "return_dict_in_generate": dict(return_dict_in_generate=True),
    "output_scores": dict(output_scores=True),
    "output_logits": dict(output_logits=True),
    "output_attentions": dict(output_attentions=True),
    "output_hidden_states": dict(output_hidden_states=True),
    "prompt_lookup_num_tokens": dict(prompt_lookup_num_tokens=3),
    "assistant_early_exit": dict(assistant_early_exit=1),
    "use_mtp": dict(use_mtp=True),
    "is_assistant": dict(is_assistant=True),
    "speculation_type": dict(speculation_type="dflash"),
    "token_healing": dict(token_healing=True),
    "guidance_scale": dict(guidance_scale=1.5),
    "watermarking_config": dict(watermarking_config={"bias": 2.0}),
    "encoder_repetition_penalty": dict(encoder_repetition_penalty=1.3),
    "encoder_no_repeat_ngram_size": dict(encoder_no_repeat_ngram_size=2),
    "cache_implementation": dict(cache_implementation="quantized"),
}
REFUSED_BY_HF_FIRST = {  # HF's generate stops these before it calls the hook (its own error names them)
    "token_healing": (ValueError, "token healing"),
    "cache_implementation": (ImportError, "quantization"),  # without optimum-quanto; with it, the hook refuses
}
INERT = {
    "bos_token_id": dict(bos_token_id=5),
    "decoder_start_token_id": dict(decoder_start_token_id=5),
    "use_cache": dict(use_cache=False),
    "cache_implementation": dict(cache_implementation="static"),
    "cache_config": dict(cache_config={"nbits": 4}),
    "max_cache_len": dict(cache_implementation="static", max_cache_len=64),
    "prefill_chunk_size": dict(prefill_chunk_size=2),
    "compile_config": dict(compile_config=CompileConfig(fullgraph=False)),
    "disable_compile": dict(disable_compile=True),
    "low_memory": dict(low_memory=True),
    "length_penalty": dict(length_penalty=2.0),
    "early_stopping": dict(early_stopping=True),
    "diversity_penalty": dict(diversity_penalty=0.5),
    "num_assistant_tokens": dict(num_assistant_tokens=3),
    "num_assistant_tokens_schedule": dict(num_assistant_tokens_schedule="constant"),
    "assistant_confidence_threshold": dict(assistant_confidence_threshold=0.2),
    "assistant_lookbehind": dict(assistant_lookbehind=3),
    "target_lookbehind": dict(target_lookbehind=3),
    "max_matching_ngram_size": dict(max_matching_ngram_size=3),
    "assistant_ensemble_weight": dict(assistant_ensemble_weight=0.5),
    "continuous_batching_config": dict(continuous_batching_config=None),
    "transformers_version": dict(transformers_version="0.0.1"),
}


def test_every_generation_config_field_is_honoured_refused_or_inert():
    """Walks this transformers' GenerationConfig: a field none of the three tables names fails here (add
    it to the hook's lists and to a table with its test); the tables are the hook's."""
    fields = {name for name in GenerationConfig().to_dict() if not name.startswith("_")}
    unclassified = fields - set(HONOURED_BY) - set(REFUSED) - set(INERT)
    assert not unclassified, f"GenerationConfig fields neither honoured, refused nor inert: {sorted(unclassified)}"
    assert set(HONOURED_BY) == specpass.hf_hook._HONOURED
    assert set(REFUSED) == set(specpass.hf_hook._REFUSED)
    assert set(INERT) == set(specpass.hf_hook._INERT)
    assert all(callable(globals().get(test)) and test.startswith("test_") for test in HONOURED_BY.values())


@pytest.mark.parametrize("name", list(REFUSED))
def test_each_refused_setting_is_refused_by_name(default_model, name):
    """The hook's own check on every refused field, then the whole call: the hook refuses it by name, or
    HF's generate stops it first."""
    model, tokenizer = default_model
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    config = GenerationConfig(**{k: v for k, v in REFUSED[name].items()})
    with pytest.raises(specpass.UnsupportedSettingError, match=name):
        specpass.hf_hook._refuse_settings(config, {}, ids)
    error, message = REFUSED_BY_HF_FIRST.get(name, (specpass.UnsupportedSettingError, name))
    with pytest.raises(error, match=message):
        model.generate(ids, max_new_tokens=4, custom_generate=HOOK, **REFUSED[name])


@pytest.fixture(scope="module")
def tiny_and_hook():
    """A peaked tiny Llama and a hook that runs it (eager): where the subject is a setting, not the model."""
    hook = specpass.custom_generate({"lowering": "eager", "drafter": PromptLookup(), "budget": FIXED_BUDGET})
    return peaked_tiny_model(), hook


@pytest.mark.parametrize("name", list(INERT))
def test_each_inert_setting_changes_neither_hf_nor_the_hook(tiny_and_hook, name):
    model, hook = tiny_and_hook
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(9))
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    expected = model.generate(ids, **settings)
    assert torch.equal(model.generate(ids, **settings, **INERT[name]), expected)
    assert torch.equal(model.generate(ids, custom_generate=hook, **settings, **INERT[name]), expected)


def test_a_setting_the_hook_does_not_know_is_refused_unless_default(default_model):
    """What a newer transformers' new field meets: refused by name when set, accepted at its default."""
    model, tokenizer = default_model
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    config = GenerationConfig(max_new_tokens=4, do_sample=False, a_future_setting=3)
    with pytest.raises(specpass.UnsupportedSettingError, match="a_future_setting=3"):
        model.generate(ids, generation_config=config, custom_generate=HOOK)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, a_future_setting=None)
    assert torch.equal(model.generate(ids, generation_config=config, custom_generate=HOOK),
                       model.generate(ids, generation_config=config))  # fmt: skip


def test_an_assistant_model_and_other_processors_are_refused_by_name(default_model):
    model, tokenizer = default_model
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    with pytest.raises(specpass.UnsupportedSettingError, match="assistant_model"):
        model.generate(ids, max_new_tokens=4, custom_generate=HOOK, assistant_model=model)
    with pytest.raises(specpass.UnsupportedSettingError, match="logits processor"):
        model.generate(ids, max_new_tokens=4, custom_generate=HOOK,
                       logits_processor=LogitsProcessorList([lambda ids, scores: scores]))  # fmt: skip
    with pytest.raises(specpass.UnsupportedSettingError, match="PrefixConstrainedLogitsProcessor"):
        model.generate(ids, max_new_tokens=4, custom_generate=HOOK, prefix_allowed_tokens_fn=lambda b, ids: [5])


def test_every_logits_processor_and_stopping_criterion_hf_defines_is_applied_or_refused():
    """Each LogitsProcessor and StoppingCriteria class of this transformers: the hook applies it (and a test
    above runs it through the field that builds it) or refuses it by name."""
    from transformers.generation import logits_process, stopping_criteria

    built_by = {  # the processors the hook applies, each with the field that makes HF build it
        "MinLengthLogitsProcessor": "min_length", "MinNewTokensLengthLogitsProcessor": "min_new_tokens",
        "RepetitionPenaltyLogitsProcessor": "repetition_penalty", "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
        "SequenceBiasLogitsProcessor": "sequence_bias", "NoBadWordsLogitsProcessor": "bad_words_ids",
        "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id", "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
        "InfNanRemoveLogitsProcessor": "remove_invalid_values", "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
        "LogitNormalization": "renormalize_logits", "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
        "SuppressTokensLogitsProcessor": "suppress_tokens", "TemperatureLogitsWarper": "temperature",
        "TopKLogitsWarper": "top_k", "TopPLogitsWarper": "top_p", "MinPLogitsWarper": "min_p",
        "TypicalLogitsWarper": "typical_p", "EpsilonLogitsWarper": "epsilon_cutoff", "EtaLogitsWarper": "eta_cutoff",
        "TopHLogitsWarper": "top_h",
    }  # fmt: skip
    assert set(built_by) == set(specpass.hf_hook._PROCESSORS)
    assert all(field in HONOURED_BY for field in built_by.values())
    for module, base, check in ((logits_process, logits_process.LogitsProcessor, specpass.hf_hook._processors),
                                (stopping_criteria, stopping_criteria.StoppingCriteria, specpass.hf_hook._stop)):  # fmt: skip
        classes = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, base) and c is not base]
        assert len(classes) >= 5
        for cls in classes:
            applied = cls.__name__ in built_by or cls.__name__ in specpass.hf_hook._NATIVE_STOPS + specpass.hf_hook._STOPS
            if not applied:
                with pytest.raises(specpass.UnsupportedSettingError, match=cls.__name__):
                    check([object.__new__(cls)])


def test_seed_without_sampling_is_refused(default_model):
    model, tokenizer = default_model
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    with pytest.raises(specpass.UnsupportedSettingError, match="seed applies only to sampling"):
        model.generate(ids, max_new_tokens=4, do_sample=False, seed=3, custom_generate=HOOK)
    assert TypicalLogitsWarper.__name__ in specpass.hf_hook._PROCESSORS
