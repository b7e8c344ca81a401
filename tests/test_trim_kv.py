"""TRIM-KV (rewrites.kv_eviction.TrimKV, heads.retention, research.retention_training): the gates saved
and loaded, refused for another model; the rewritten step records each layer's log retention; every
generation equals an independent evicting decoder (tests/eviction_reference.py) alone, speculatively and
in a batch; refusals (no gates, another model's gates, an ONNX export); the trainer lowers its loss."""

import pytest
import torch
from conftest import padded, tiny_model
from eviction_reference import evicting_greedy

import specpass
from specpass.common.errors import GraphVerificationError, InvalidParameterError, PassMismatchError
from specpass.drafters.registry import drafter_by_name
from specpass.heads.io import model_fingerprint
from specpass.heads.retention import RetentionConfig, RetentionGates, load_gates, save_gates
from specpass.ir import capture
from specpass.research.retention_training import RetentionTraining, capacity_loss, train_retention
from specpass.rewrites import TreeAttention, TrimKV
from specpass.rewrites.kv_eviction import ops


def _gates(model, directory, seed=1, bias=1.0) -> str:
    """Random gates for `model`, saved in `directory` (bias 1: retention well below 1, so ages matter)."""
    c = model.config
    torch.manual_seed(seed)
    gates = RetentionGates(RetentionConfig(c.num_hidden_layers, c.hidden_size, c.num_key_value_heads, inner_size=16,
                                           bias=bias, model=model_fingerprint(model.lm_head)))  # fmt: skip
    save_gates(gates, str(directory))
    return str(directory)


def test_gates_round_trip_and_score_each_token_alone(tmp_path):
    model = tiny_model()
    directory = _gates(model, tmp_path / "gates")
    gates = load_gates(directory)
    x = torch.randn(2, 5, model.config.hidden_size)
    log_beta = gates(1, x)  # [B, T, KV]
    assert log_beta.shape == (2, 5, model.config.num_key_value_heads) and (log_beta <= 0).all()
    assert torch.allclose(gates(1, x[:, 2:3]), log_beta[:, 2:3])  # a token's retention is its own
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidParameterError, match="no retention gates .*train-retention"):
        load_gates(str(tmp_path / "empty"))


def test_the_rewritten_step_records_retention_and_refuses_what_it_must(tmp_path):
    model = tiny_model()
    directory = _gates(model, tmp_path / "gates")
    gm, report = specpass.Pipeline(TreeAttention(8), TrimKV(48, 8, gates_directory=directory)).run(capture(model, cache_size=256))
    recorded = [n for n in gm.graph.nodes if n.target is ops.record_retention]
    assert [n.args[1] for n in recorded] == [0, 1] and gm.k_cache.shape[3] == 48
    assert gm.kv_retention.shape == (2, 1, 2, 8) and gm.kv_slot_positions.shape == (2, 1, 2, 48)
    assert not hasattr(gm, ops.QUERIES)  # scored at creation: no queries kept
    assert "log retention recorded in 2 layers" in str(report)
    recorded[1].replace_all_uses_with(recorded[1].args[2])
    gm.graph.erase_node(recorded[1])
    with pytest.raises(GraphVerificationError, match=r"recording their tokens' retention are \[0\]"):
        TrimKV(48, 8, gates_directory=directory).verify(gm)
    other = _gates(tiny_model(seed=3), tmp_path / "other")
    with pytest.raises(PassMismatchError, match="retention gates in .*trained for model"):
        specpass.Pipeline(TreeAttention(8), TrimKV(48, 8, gates_directory=other)).run(capture(model, cache_size=64))
    with pytest.raises(PassMismatchError, match="no retention gates"):
        specpass.Pipeline(TreeAttention(8), TrimKV(48, 8, gates_directory=str(tmp_path))).run(capture(model, cache_size=64))
    with pytest.raises(InvalidParameterError, match="gates_directory must name"):
        TrimKV(48, 8)
    with pytest.raises(specpass.SpecpassError, match="TrimKV"):  # the export cannot carry the gates' state yet
        from specpass.backends.onnx.export import export

        export(model, specpass.Pipeline(TreeAttention(8), TrimKV(48, 8, gates_directory=directory)),
               str(tmp_path / "out"), progress=False)  # fmt: skip
    pipeline = specpass.Pipeline(TreeAttention(8), TrimKV(48, 8, gates_directory=directory))
    assert specpass.Pipeline.from_json(pipeline.to_json()) == pipeline and "output changes: KV eviction" in str(pipeline)


@torch.no_grad()
def test_every_generation_equals_an_independent_evicting_decoder_alone_and_in_a_batch(tmp_path):
    """tests/eviction_reference.py (HF's modules, the gates run on each layer's normed input there,
    TRIM-KV's ranking by log retention x age): each prompt's tokens equal it with one-node trees,
    speculatively alone, and as a row of a left-padded batch; the policy changes them."""
    model = tiny_model()
    policy = TrimKV(24, 8, gates_directory=_gates(model, tmp_path / "gates"))
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 96, (n,), generator=gen) for n in (30, 41)]
    prompts = [torch.cat([p, p[3:15]]) for p in prompts]
    reference = [evicting_greedy(model, p.tolist(), policy, 30) for p in prompts]
    full = [model.generate(p[None], max_new_tokens=30, do_sample=False, eos_token_id=None)[0, len(p) :].tolist()
            for p in prompts]  # fmt: skip
    assert reference != full
    options = lambda budget: {"pipeline": specpass.Pipeline(TreeAttention(16), policy), "budget": budget,  # noqa: E731
                              "drafter": drafter_by_name("combined")}  # fmt: skip
    taus = []
    for prompt, want in zip(prompts, reference):
        one = specpass.generate(model, prompt[None], 30, options=options(1), eos_token_id=[])
        assert one.sequences[0, len(prompt) :].tolist() == want
        out = specpass.generate(model, prompt[None], 30, options=options(8), eos_token_id=[])
        assert out.sequences[0, len(prompt) :].tolist() == want
        taus.append(out.stats.tau)
    assert max(taus) > 1.0
    ids, mask = padded(prompts)
    out = specpass.generate(model, ids, max_new_tokens=30, attention_mask=mask, eos_token_id=[], options=options(8))
    assert [list(row) for row in out.new_tokens] == reference


def test_capacity_loss_is_the_retained_mass_past_the_memory():
    log_beta = torch.log(torch.tensor([[0.5], [1.0], [0.25], [1.0]]))  # [T, KV=1]
    mass = [1.0, 0.5 + 1.0, 0.25 + 1.0 + 1.0, 0.125 + 1.0 + 0.25 + 1.0]  # S_t = sum_i beta_i^(t - i)
    want = sum(max(0.0, s - 2) / max(t - 2, 1) for t, s in enumerate(mass)) / 4
    assert capacity_loss(log_beta, capacity=2).item() == pytest.approx(want)


def test_the_trainer_lowers_its_loss_and_its_gates_belong_to_the_model():
    model = tiny_model()
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 96, (48,), generator=gen) for _ in range(24)]
    config = RetentionTraining(capacity=12, sequence=48, steps=24, inner_size=16, bias=3.0, learning_rate=1e-2)
    gates, report = train_retention(model, sequences, config, log=lambda line: None)
    total = lambda part: part["kl"] + part["ce"] + part["capacity"]  # noqa: E731
    assert total(report["last"]) < total(report["first"]) and report["last"]["capacity"] < report["first"]["capacity"]
    assert gates.config.model == model_fingerprint(model.lm_head) and gates.config.capacity == 12
    assert all(not p.requires_grad for p in model.parameters())  # the model stayed frozen
    with pytest.raises(InvalidParameterError, match="longer than the capacity"):
        train_retention(model, [s[:10] for s in sequences], config)
    with pytest.raises(InvalidParameterError, match="never exceed the capacity"):
        RetentionTraining(capacity=64, sequence=64)
