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
GREEDY_SETTINGS = {
    "repetition_penalty": dict(repetition_penalty=1.3),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=3),
    "min_new_tokens": dict(min_new_tokens=40),
    "bad_words_ids": dict(bad_words_ids=[[28705], [13]]),
    "several": dict(repetition_penalty=1.2, no_repeat_ngram_size=4, suppress_tokens=[198]),
}


@pytest.mark.parametrize("name", list(GREEDY_SETTINGS))
def test_greedy_with_processors_equals_hf_generate(default_model, cases, name):
    model, _ = default_model
    settings = GREEDY_SETTINGS[name]
    for ids, _ in cases[:1] + cases[3:4] if name == "several" else cases[:1]:  # all together: code and chat
        reference = model.generate(ids, max_new_tokens=48, do_sample=False, **settings)
        out = model.generate(ids, max_new_tokens=48, do_sample=False, custom_generate=HOOK, **settings)
        assert torch.equal(out, reference)


def test_min_new_tokens_holds_back_eos(default_model, cases):
    model, _ = default_model
    ids, reference = next((i, r) for i, r in cases if r.shape[1] < i.shape[1] + NEW_TOKENS)  # ends at EOS
    eos_at = reference.shape[1] - ids.shape[1]
    settings = dict(min_new_tokens=eos_at + 5, max_new_tokens=eos_at + 20, do_sample=False)
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
    one_node = specpass.custom_generate({"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))})
    more = dict(typical_p=0.5, repetition_penalty=1.2, seed=11)
    for ids, _ in cases[:3]:
        assert torch.equal(model.generate(ids, **settings, **more), model.generate(ids, **(settings | {"custom_generate": one_node}), **more))


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
