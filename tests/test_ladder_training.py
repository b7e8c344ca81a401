"""Recovery fine-tune of a laddered model (specpass.research.ladder_training): the student is the decode-time
laddered step, training moves only the laddered layers and brings the laddered model's law closer to
the original's, and recovered weights save, load and refuse another model."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

import specpass
from specpass.common.errors import InvalidParameterError
from specpass.heads.io import HeadsMismatchError
from specpass.research.heads_training import Continuation
from specpass.ir import SlotLayout
from specpass.research.ladder_training import (LadderTrainConfig, coarse_kl, laddered_step, load_recovered, recover_ladder,
                                      save_recovered, sequence_logits)  # fmt: skip
from specpass.rewrites import LadderResidual, TreeAttention


def _four_layer_llama(seed: int = 0):
    """A tiny random Llama of 4 layers whose sub-layers write 8x more into the stream than at
    initialisation, so that a ladder changes its law measurably."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specpass.research.tiny_models import TINY

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 4})).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(8)
            layer.mlp.down_proj.weight.mul_(8)
        model.lm_head.weight.mul_(8)
    return model


def _corpus(count: int, length: int, seed: int) -> list[Continuation]:
    generator = torch.Generator().manual_seed(seed)
    return [Continuation(torch.randint(3, 96, (length + i % 5,), generator=generator), start=4) for i in range(count)]


@torch.no_grad()
def _laddered_kl(model, ladder, corpus) -> tuple[float, float]:
    """Mean KL(original || laddered) over the corpus's positions on the whole law (no top-k), and
    the top-1 agreement."""
    step = laddered_step(model, ladder, max(len(s.tokens) for s in corpus))
    original = _four_layer_llama()
    total = agree = count = 0.0
    for seq in corpus:
        want = F.log_softmax(original(seq.tokens[None]).logits[0, :-1], -1)  # [L - 1, V]
        got = F.log_softmax(sequence_logits(step, seq.tokens)[:-1], -1)
        total += float((want.exp() * (want - got)).sum())
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        count += len(want)
    return total / count, agree / count


def test_the_loss_is_the_kl_of_top_tokens_and_the_rest():
    law = torch.tensor([[0.5, 0.3, 0.1, 0.1]])  # [1, V]
    probs, ids = torch.tensor([[0.5, 0.3]]), torch.tensor([[0, 1]])
    student = torch.tensor([[0.4, 0.4, 0.15, 0.05]])
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.2)
    assert coarse_kl(probs, ids, 1 - probs.sum(-1), student.log()).item() == pytest.approx(expected, abs=1e-6)
    assert coarse_kl(probs, ids, 1 - probs.sum(-1), law.log()).item() == pytest.approx(0, abs=1e-6)  # the optimum


@torch.no_grad()
def test_the_student_is_the_decode_time_laddered_model():
    model, ladder = tiny_model("llama"), LadderResidual.top(1)
    tokens = torch.randint(3, 96, (17,), generator=torch.Generator().manual_seed(1))
    program = specpass.compile_program(model, {"pipeline": specpass.Pipeline(TreeAttention(1), ladder), "budget": 1,
                                               "lowering": "eager"})  # fmt: skip
    decoded = program.forward(tokens[None], SlotLayout.of((SlotLayout.chain(0, len(tokens)),)))[0][0]  # [L, V]
    torch.testing.assert_close(sequence_logits(laddered_step(model, ladder, 32), tokens), decoded, rtol=0, atol=1e-5)


def test_recovery_moves_only_the_laddered_layers_and_closes_the_gap():
    """On the sequences it trains on (random tokens do not generalise: the real model's held-out
    numbers are benchmarks/ladder_quality.py's), the laddered model's law moves towards the original's."""
    model, ladder = _four_layer_llama(), LadderResidual.top(2)
    corpus = _corpus(24, 20, seed=0)
    before_weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    (kl_before, agree_before) = _laddered_kl(model, ladder, corpus)
    losses = recover_ladder(model, ladder, corpus, LadderTrainConfig(epochs=10, lr=3e-4), progress=False)
    (kl_after, agree_after) = _laddered_kl(model, ladder, corpus)
    assert len(losses) == 10 * 6  # 24 sequences, 4 per step, 10 epochs
    assert kl_after < 0.4 * kl_before and agree_after > agree_before, (kl_before, kl_after, agree_before, agree_after)
    assert losses[-1] < 0.4 * losses[0]
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before_weights[name])}
    assert changed and all(name.startswith(("model.layers.2.", "model.layers.3.")) for name in changed), changed
    assert all(p.requires_grad for p in model.parameters())  # the model is left as it was given


def test_programs_built_before_training_are_not_reused():
    """A lowered program keeps copies of some weights: the one compiled after training runs the new ones."""
    model, ladder = _four_layer_llama(), LadderResidual.top(1)
    options = {"pipeline": specpass.Pipeline(TreeAttention(1), ladder), "budget": 1, "lowering": "eager"}
    before = specpass.compile_program(model, options)
    recover_ladder(model, ladder, _corpus(8, 16, seed=0), LadderTrainConfig(epochs=1, lr=3e-3), progress=False)
    after = specpass.compile_program(model, options)
    tokens = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        trained = sequence_logits(laddered_step(model, ladder, 16), tokens)
        torch.testing.assert_close(after.forward(tokens[None], SlotLayout.of((SlotLayout.chain(0, 12),)))[0][0], trained,
                                   rtol=0, atol=1e-5)
    assert after is not before


def test_recovered_layers_save_load_and_refuse_another_model(tmp_path):
    model, ladder = _four_layer_llama(), LadderResidual((1,))
    recover_ladder(model, ladder, _corpus(8, 16, seed=0), LadderTrainConfig(epochs=1, lr=3e-3), progress=False)
    save_recovered(model, ladder, str(tmp_path), {"note": "test"})
    fresh = _four_layer_llama()
    loaded = load_recovered(fresh, str(tmp_path))
    assert loaded == LadderResidual((1,))
    tokens = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(sequence_logits(laddered_step(fresh, loaded, 16), tokens),
                                   sequence_logits(laddered_step(model, ladder, 16), tokens), rtol=0, atol=0)  # fmt: skip
    with pytest.raises(HeadsMismatchError, match="recovered ladder"):
        load_recovered(_four_layer_llama(seed=1), str(tmp_path))
    with pytest.raises(InvalidParameterError, match="no recovered ladder"):
        load_recovered(copy.deepcopy(fresh), str(tmp_path / "missing"))


def test_bad_recovery_requests_are_refused():
    model = _four_layer_llama()
    with pytest.raises(InvalidParameterError, match="names no layers"):
        recover_ladder(model, LadderResidual(), _corpus(2, 8, seed=0), progress=False)
    with pytest.raises(InvalidParameterError, match="need training sequences"):
        recover_ladder(model, LadderResidual.top(1), [], progress=False)
    with pytest.raises(InvalidParameterError, match="outside the model"):
        recover_ladder(model, LadderResidual((7,)), _corpus(2, 8, seed=0), progress=False)
    with pytest.raises(InvalidParameterError, match="lr must be positive"):
        LadderTrainConfig(lr=0)
