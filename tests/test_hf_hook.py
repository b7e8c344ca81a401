"""HF's `generate(..., custom_generate=specpass.custom_generate())` honours the generation config
(greedy with logits processors equals HF generate token for token) or refuses a setting by name."""

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList, StopStringCriteria
from transformers.generation.logits_process import TypicalLogitsWarper

import specpass
from conftest import FIXED_BUDGET, NEW_TOKENS
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


REFUSED = {
    "num_beams": dict(num_beams=2),
    "num_return_sequences": dict(num_return_sequences=2, do_sample=True),
    "return_dict_in_generate": dict(return_dict_in_generate=True, output_scores=True),
    "guidance_scale": dict(guidance_scale=1.5),
    "penalty_alpha": dict(penalty_alpha=0.6, top_k=4),
    "logits processor": dict(logits_processor=LogitsProcessorList([lambda ids, scores: scores])),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unimplemented_settings_are_refused_by_name(default_model, name):
    model, tokenizer = default_model
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    with pytest.raises(specpass.UnsupportedSettingError, match=name):
        model.generate(ids, max_new_tokens=4, custom_generate=HOOK, **REFUSED[name])


def test_seed_without_sampling_is_refused(default_model):
    model, tokenizer = default_model
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    with pytest.raises(specpass.UnsupportedSettingError, match="seed applies only to sampling"):
        model.generate(ids, max_new_tokens=4, do_sample=False, seed=3, custom_generate=HOOK)
    assert TypicalLogitsWarper.__name__ in specpass.hf_hook._PROCESSORS
