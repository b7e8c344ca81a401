import collections

import pytest
import torch
from conftest import tiny_model

from specpass.errors import InvalidParameterError, UnsupportedArchitectureError
from specpass.ir import Role, capture, info, verify


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_capture_matches_hf_prefill_and_cached_steps(arch):
    model = tiny_model(arch)
    gm = capture(model, cache_size=64)
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        reference = model(ids).logits  # [1, 12, V]
        logits, hidden = gm(ids, torch.arange(12)[None], 12)
        assert hidden.shape == (1, 12, 32)
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
        gm(ids[:, :7], torch.arange(7)[None], 7)  # prefill 7, then 5 one-token steps from the cache
        for t in range(7, 12):
            step_logits, _ = gm(ids[:, t : t + 1], torch.tensor([[t]]), t + 1)
            torch.testing.assert_close(step_logits[0, 0], reference[0, t], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_every_node_is_annotated_with_layer_and_role(arch):
    gm = capture(tiny_model(arch), cache_size=32)
    per_layer = collections.Counter((info(n).layer, info(n).role) for n in gm.graph.nodes if n.op == "call_module")
    for layer in range(2):
        for role in (Role.Q, Role.K, Role.V, Role.O):
            assert per_layer[layer, role] == 1
    roles = {info(n).role for n in gm.graph.nodes}
    assert {Role.EMBED, Role.ROPE, Role.MASK, Role.ATTENTION, Role.MLP, Role.RESIDUAL, Role.NORM,
            Role.LM_HEAD, Role.CACHE_WRITE} <= roles  # fmt: skip
    residual_adds = [n for n in gm.graph.nodes if info(n).role is Role.RESIDUAL]
    assert len(residual_adds) == 4 and {info(n).layer for n in residual_adds} == {0, 1}


def test_capture_shares_weights_with_the_model():
    model = tiny_model()
    gm = capture(model, cache_size=16)
    assert gm.get_submodule("layers.0.self_attn.q_proj").weight is model.model.layers[0].self_attn.q_proj.weight
    assert gm.get_submodule("lm_head").weight is model.lm_head.weight


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"):
        capture(model)


def test_cache_larger_than_sliding_window_is_refused():
    with pytest.raises(InvalidParameterError, match="sliding window 128"):
        capture(tiny_model("mistral"), cache_size=256)


def test_verify_rejects_a_broken_graph():
    from specpass.errors import GraphVerificationError

    gm = capture(tiny_model(), cache_size=16)
    q = next(n for n in gm.graph.nodes if info(n).role is Role.Q)
    del q.meta["specpass"]
    with pytest.raises(GraphVerificationError, match="no specpass annotation"):
        verify(gm)
