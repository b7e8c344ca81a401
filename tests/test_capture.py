import collections
import operator
import re

import pytest
import torch
from conftest import TINY_ARCHS, WINDOW, tiny_model

from specpass.common.errors import InvalidParameterError, UnsupportedArchitectureError
from specpass.ir import SUPPORTED_ARCHITECTURES, Role, capture, info, verify


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_capture_matches_hf_prefill_and_cached_steps(arch):
    model = tiny_model(arch)
    gm = capture(model, cache_size=64)
    ids = torch.randint(0, 96, (1, 40))  # 40 positions: past llama3-rope's original 16
    with torch.no_grad():
        reference = model(ids).logits  # [1, 40, V]
        logits, hidden = gm(ids, torch.arange(40)[None], 40)
        assert hidden.shape == (1, 40, 32)
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
        gm(ids[:, :30], torch.arange(30)[None], 30)  # prefill 30, then 10 one-token steps from the cache
        for t in range(30, 40):
            step_logits, _ = gm(ids[:, t : t + 1], torch.tensor([[t]]), t + 1)
            torch.testing.assert_close(step_logits[0, 0], reference[0, t], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_node_is_annotated_with_layer_and_role(arch):
    gm = capture(tiny_model(arch), cache_size=32)
    per_layer = collections.Counter((info(n).layer, info(n).role) for n in gm.graph.nodes if n.op == "call_module")
    fused = arch.startswith("phi3")  # one qkv_proj instead of q/k/v
    for layer in range(2):
        for role in (Role.QKV, Role.O) if fused else (Role.Q, Role.K, Role.V, Role.O):
            assert per_layer[layer, role] == 1
        assert per_layer[layer, Role.Q] == (0 if fused else 1)
    roles = {info(n).role for n in gm.graph.nodes}
    assert {Role.EMBED, Role.ROPE, Role.MASK, Role.ATTENTION, Role.MLP, Role.RESIDUAL, Role.NORM,
            Role.LM_HEAD, Role.CACHE_WRITE} <= roles  # fmt: skip
    residual_adds = [n for n in gm.graph.nodes if info(n).role is Role.RESIDUAL and n.target is operator.add]
    assert len(residual_adds) == 4 and {info(n).layer for n in residual_adds} == {0, 1}


def test_capture_shares_weights_with_the_model():
    model = tiny_model()
    gm = capture(model, cache_size=16)
    assert gm.get_submodule("layers.0.self_attn.q_proj").weight is model.model.layers[0].self_attn.q_proj.weight
    assert gm.get_submodule("lm_head").weight is model.lm_head.weight


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedArchitectureError, match=re.escape(", ".join(SUPPORTED_ARCHITECTURES))):
        capture(model)


@pytest.mark.parametrize("arch", ["mistral", "qwen2-window", "gemma2", "gemma3"])
def test_sliding_windows_change_the_logits_the_capture_matches(arch):
    """The conformance above would pass vacuously if the tiny windows never cut anything: they do."""
    model = tiny_model(arch)
    unwindowed = type(model)(type(model.config)(**{**model.config.to_dict(), "sliding_window": 10**6}))
    unwindowed.load_state_dict(model.state_dict())
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids).logits - unwindowed.eval()(ids).logits)[0, WINDOW:].abs().max() > 1e-3
        assert torch.equal(model(ids).logits[0, :WINDOW], unwindowed(ids).logits[0, :WINDOW])


def test_length_dependent_rope_is_refused_past_its_exact_range():
    with pytest.raises(InvalidParameterError, match="exceeds 128 positions"):
        capture(tiny_model("phi3-longrope"), cache_size=129)


def test_verify_rejects_a_broken_graph():
    from specpass.common.errors import GraphVerificationError

    gm = capture(tiny_model(), cache_size=16)
    q = next(n for n in gm.graph.nodes if info(n).role is Role.Q)
    del q.meta["specpass"]
    with pytest.raises(GraphVerificationError, match="no specpass annotation"):
        verify(gm)
