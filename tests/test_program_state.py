"""A program's state across calls (backends.runtime.guard): calls from several threads each get their own exact
output, and weights changed after compiling are noticed (the program is rebuilt, or refused)."""

import pytest
import torch
from conftest import FIXED_BUDGET, at_once, needs_onednn, peaked_tiny_model, with_feature
from torch import nn

import specpass
from specpass.heads import shipped_heads
from specpass.heads.exit_adapter import read_exit_adapter_config


def test_threads_on_one_compiled_model_each_get_their_own_exact_output(default_model, cases):
    """Four threads (the four cases) and then sixteen (each case four times) call `specpass.generate` at
    once on one compiled model (the default drafter, trees of 8 nodes): every output is HF greedy's for
    its own prompt. (Without the program's lock, four threads gave four wrong outputs.)"""
    model, _ = default_model
    fast = torch.compile(model, backend="specpass", options={"budget": FIXED_BUDGET})
    for copies, n in ((1, 12), (4, 3)):
        calls = [lambda ids=ids: specpass.generate(fast, ids, max_new_tokens=n) for ids, _ in cases * copies]
        for out, (ids, reference) in zip(at_once(calls), cases * copies):
            assert torch.equal(out.sequences, reference[:, : ids.shape[1] + n])


def test_threads_on_one_feature_draft_program_each_get_their_own_exact_output(default_model, cases):
    """Four threads (the four cases) at once on one compiled model with the shipped feature draft and
    the combined tree: each session's draft cache is its own, every output is HF greedy's."""
    from specpass.drafters import Combined, Feature, PromptLookup, TokenRecycling

    model, _ = default_model
    fast = torch.compile(model, backend="specpass",
                         options=with_feature(Combined(Feature(), PromptLookup(), TokenRecycling())))  # fmt: skip
    calls = [lambda ids=ids: specpass.generate(fast, ids, max_new_tokens=16) for ids, _ in cases]
    outputs = at_once(calls)
    for out, (ids, reference) in zip(outputs, cases):
        assert torch.equal(out.sequences, reference[:, : ids.shape[1] + 16])
    assert sum(out.stats.tau for out in outputs) / len(outputs) > 1.15  # the draft's tokens were accepted


def test_threads_through_the_hf_hook_each_get_their_own_exact_output(default_model, cases):
    model, _ = default_model
    hook = specpass.custom_generate({"budget": FIXED_BUDGET})
    calls = [lambda ids=ids: model.generate(ids, max_new_tokens=12, do_sample=False, custom_generate=hook)
             for ids, _ in cases]  # fmt: skip
    for out, (ids, reference) in zip(at_once(calls), cases):
        assert torch.equal(out, reference[:, : ids.shape[1] + 12])


def _greedy(model, ids, n=24):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=None)  # fmt: skip


def _edit_in_place(model):
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(3.0)


def _load_state_dict(model):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name in state:
        if name.endswith("self_attn.o_proj.weight"):
            state[name] = -state[name]
    model.load_state_dict(state)


def _replace_parameter(model):
    up = model.model.layers[0].mlp.up_proj
    up.weight = nn.Parameter(up.weight.detach() * -2.0)


@needs_onednn
@pytest.mark.parametrize("change", [_edit_in_place, _load_state_dict, _replace_parameter])
def test_weights_changed_after_compiling_rebuild_the_program(change, onednn_linears):
    """The oneDNN lowering keeps prepacked copies of every linear's weight: after the change, the next
    call equals HF greedy with the new weights (not the old output, nor a mix)."""
    model = peaked_tiny_model()
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    options = {"lowering": "onednn", "budget": 4, "drafter": specpass.drafters.PromptLookup()}
    fast = torch.compile(model, backend="specpass", options=options)
    before = specpass.generate(fast, ids, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(before.sequences, _greedy(model, ids))
    program = specpass.compile_program(fast)
    change(model)
    expected = _greedy(model, ids)
    assert not torch.equal(expected, before.sequences)  # the change shows in the output
    after = specpass.generate(fast, ids, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(after.sequences, expected)
    assert specpass.compile_program(fast) is not program  # rebuilt, and kept for the next call
    assert specpass.compile_program(fast) is specpass.compile_program(fast)


def test_a_program_passed_in_refuses_weights_changed_after_it_was_built():
    model = peaked_tiny_model()
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    program = specpass.compile_program(model, {"lowering": "eager", "budget": 4})
    specpass.generate(program, ids, max_new_tokens=4)
    _edit_in_place(model)
    with pytest.raises(specpass.StaleProgramError, match=r"down_proj.weight \(written in place\)"):
        specpass.generate(program, ids, max_new_tokens=4)
    model.to(torch.float64)
    with pytest.raises(specpass.StaleProgramError, match="moved"):
        specpass.generate(program, ids, max_new_tokens=4)


ADAPTER_LAYER = read_exit_adapter_config(shipped_heads("exit_adapter")).layer
PIPELINES = {  # every rewrite whose runtime keeps state: none of it may live in the model's own tensors
    "default": {},
    "hydra heads": {"pipeline": specpass.Pipeline(specpass.rewrites.TreeAttention(16), specpass.rewrites.DraftHeads("hydra")),
                    "drafter": specpass.drafters.Heads()},
    "exit adapter": {"pipeline": specpass.Pipeline(specpass.rewrites.TreeAttention(16),
                                                   specpass.rewrites.EarlyExit(ADAPTER_LAYER, adapter="default")),
                     "drafter": specpass.drafters.SelfDraft(3)},
    "TOVA eviction": {"pipeline": specpass.Pipeline(specpass.rewrites.TreeAttention(8), specpass.rewrites.TOVA(64, 8))},
}  # fmt: skip


@pytest.mark.parametrize("name", list(PIPELINES))
def test_generating_does_not_count_as_a_weight_change(default_model, cases, name):
    """specpass's generations (their caches, draft graphs, eviction state) and HF's own generate leave
    every tensor of the model as it was: the program is reused, not rebuilt."""
    model, _ = default_model
    options = PIPELINES[name] | {"budget": FIXED_BUDGET}
    program = specpass.compile_program(model, options)
    ids, reference = cases[1]
    out = specpass.generate(model, ids, max_new_tokens=8, options=options)
    if name != "TOVA eviction":  # lossy: its own model, not HF's
        assert torch.equal(out.sequences, reference[:, : ids.shape[1] + 8])
    specpass.generate(model, ids, max_new_tokens=8, options=options)
    model.generate(ids, max_new_tokens=4, do_sample=False)
    assert specpass.compile_program(model, options) is program


def test_a_dtype_move_through_generate_rebuilds_the_program():
    """generate(model, ...) after `model.to(bfloat16)`: a new program, built for the new dtype, whose output
    is HF greedy of the moved model (not the float32 program's)."""
    model = peaked_tiny_model()
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(5))
    options = {"budget": 4, "drafter": specpass.drafters.PromptLookup()}
    before = specpass.generate(model, ids, max_new_tokens=24, eos_token_id=[], options=options)
    assert torch.equal(before.sequences, _greedy(model, ids))
    program = specpass.compile_program(model, options)
    model.to(torch.bfloat16)
    expected = _greedy(model, ids)
    assert not torch.equal(expected, before.sequences)  # the move shows in HF's own output
    after = specpass.generate(model, ids, max_new_tokens=24, eos_token_id=[], options=options)
    assert torch.equal(after.sequences, expected)
    rebuilt = specpass.compile_program(model, options)
    assert rebuilt is not program and rebuilt.k_cache.dtype == torch.bfloat16


def test_weights_changed_between_hf_hook_calls_rebuild_the_program():
    """The hook builds its program through the same cache as generate(model): a change between two
    `model.generate(..., custom_generate=hook)` calls gives HF greedy of the changed weights."""
    model = peaked_tiny_model()
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(6))
    options = {"lowering": "eager", "budget": 4, "drafter": specpass.drafters.PromptLookup()}
    hook = specpass.custom_generate(options)
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, eos_token_id=None)
    before = model.generate(ids, custom_generate=hook, **settings)
    assert torch.equal(before, _greedy(model, ids))
    program = specpass.compile_program(model, options)
    _load_state_dict(model)
    expected = _greedy(model, ids)
    assert not torch.equal(expected, before)
    assert torch.equal(model.generate(ids, custom_generate=hook, **settings), expected)
    assert specpass.compile_program(model, options) is not program


@pytest.mark.gpu
def test_a_device_move_through_generate_rebuilds_the_program():
    model = peaked_tiny_model()
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(7))
    options = {"budget": 4, "drafter": specpass.drafters.PromptLookup()}
    assert torch.equal(specpass.generate(model, ids, max_new_tokens=24, eos_token_id=[], options=options).sequences,
                       _greedy(model, ids))  # fmt: skip
    model.to("cuda")
    after = specpass.generate(model, ids.cuda(), max_new_tokens=24, eos_token_id=[], options=options)
    assert torch.equal(after.sequences.cpu(), _greedy(model, ids.cuda()).cpu())
    assert specpass.compile_program(model, options).k_cache.device.type == "cuda"
