"""The torch.compile entry point: lookup by name, options, the dynamo graph, and HF's custom_generate hook."""

import subprocess
import sys

import pytest
import torch
from conftest import WINDOW, tiny_model

import specpass
from specpass.common.errors import InvalidParameterError, SpecpassError


def test_backend_is_listed_without_importing_specpass():
    code = "import sys, torch._dynamo as d; print('specpass' in d.list_backends()); print('specpass' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


def test_calling_the_compiled_model_runs_its_forward():
    model = tiny_model()
    fast = torch.compile(model, backend="specpass")
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_generate_uses_the_options_given_to_torch_compile():
    model = tiny_model()
    pipeline = specpass.Pipeline(specpass.rewrites.TreeAttention(max_nodes=8))
    fast = torch.compile(model, backend="specpass", options={"pipeline": pipeline, "cache_size": 100})
    program = specpass.compile_program(fast)
    assert program.options.pipeline == pipeline and program.cache_size == 100 and program.max_nodes == 8
    assert "TreeAttention: modified" in str(program.report)
    assert specpass.compile_program(fast) is program  # built once per (model, options)
    ids = torch.randint(0, 96, (1, 5))
    out = specpass.generate(fast, ids, max_new_tokens=20, eos_token_id=[])
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"pipline": None}, "unknown specpass option"),
        ({"pipeline": "TreeAttention"}, "must be a specpass.Pipeline"),
        ({"drafter": "ngram"}, "must be a specpass drafter"),
        ({"lowering": "tensorrt"}, "lowering"),
        ({"cache_size": 1}, "cache_size"),
        ({"budget": "max"}, "budget"),
        ({"budget": 0}, "budget"),
    ],
)
def test_invalid_options_are_clear_errors(options, message):
    fast = torch.compile(tiny_model(), backend="specpass", options=options)
    with pytest.raises(InvalidParameterError, match=message):
        specpass.compile_program(fast)


def test_other_backends_are_not_taken_for_specpass():
    fast = torch.compile(tiny_model(), backend="eager")
    with pytest.raises(SpecpassError, match="compiled with backend 'eager'"):
        specpass.compile_program(fast)


def test_unsupported_architecture_through_torch_compile():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    fast = torch.compile(model, backend="specpass")
    with pytest.raises(specpass.UnsupportedArchitectureError, match="supported architectures: LlamaForCausalLM"):
        specpass.generate(fast, torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    # calling the model goes through dynamo, which wraps what the backend raised
    wrapped = "UnsupportedArchitectureError: .*supported architectures: LlamaForCausalLM"
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=wrapped) as raised:
        fast(torch.tensor([[1, 2, 3]]))
    assert isinstance(raised.value.inner_exception, specpass.UnsupportedArchitectureError)


def test_hf_custom_generate_hook():
    model = tiny_model("mistral")
    ids = torch.randint(0, 96, (1, 6))
    reference = model.generate(ids, max_new_tokens=16, do_sample=False)
    options = {"cache_size": 128, "pipeline": specpass.Pipeline(specpass.rewrites.TreeAttention(16))}  # < window 18
    out = model.generate(ids, max_new_tokens=16, do_sample=False, custom_generate=specpass.custom_generate(options))
    assert torch.equal(out, reference)


def test_drafter_memory_lives_with_the_program_until_forget():
    model = tiny_model()
    fast = torch.compile(model, backend="specpass", options={"cache_size": 100})
    program = specpass.compile_program(fast)
    ids = torch.randint(0, 96, (1, 5))
    first = specpass.generate(fast, ids, max_new_tokens=20, eos_token_id=[])
    table = program.drafter_memory[1]  # the default drafter: (prompt lookup, token recycling)
    assert len(table) > 0
    second = specpass.generate(fast, ids, max_new_tokens=20, eos_token_id=[])
    assert program.drafter_memory[1] is table and torch.equal(second.sequences, first.sequences)
    program.forget()
    assert len(program.drafter_memory[1]) == 0


def test_the_default_pipeline_fits_a_narrow_sliding_window():
    """A model whose sliding window (18) is narrower than the default trees (64): the default pipeline
    verifies trees one node shorter than the window (the report says so) and decodes exactly; trees as
    deep as the window, asked for explicitly, stay refused."""
    model = tiny_model("mistral")
    options = {"budget": 8}
    program = specpass.compile_program(model, options)
    assert program.max_nodes == WINDOW - 1 and f"below the narrowest sliding window ({WINDOW})" in str(program.report)
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(5))  # longer than the window
    out = specpass.generate(model, ids, max_new_tokens=24, eos_token_id=[], options=options)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None))
    with pytest.raises(specpass.SpecpassError, match=f"use max_nodes < {WINDOW}"):
        specpass.compile_program(model, {"pipeline": specpass.Pipeline(specpass.rewrites.TreeAttention(64))})
