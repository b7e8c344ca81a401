"""The feature draft (heads.feature_draft) and its training-time test (heads.feature_training)."""

from __future__ import annotations

import pytest
import torch

from specpass.errors import DamagedFileError, InvalidParameterError
from specpass.heads.feature_draft import FeatureDraft, FeatureDraftConfig, chain_mask, default_feature_layers
from specpass.heads.io import HeadsMismatchError, load_feature_draft, save_feature_draft


def _config(**changes) -> FeatureDraftConfig:
    values = dict(hidden_size=16, vocab_size=40, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=24,
                  feature_layers=(1, 2, 3), draft_vocab=12, rope_theta=10000.0, rms_eps=1e-6, model="m")  # fmt: skip
    return FeatureDraftConfig(**(values | changes))


def _draft(seed: int = 0) -> FeatureDraft:
    torch.manual_seed(seed)
    draft = FeatureDraft(_config())
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
        draft.draft_vocab.copy_(torch.randperm(40)[:12])
    return draft.eval()


def test_chain_mask_is_the_definition():
    length = 7
    for step in range(4):
        mask = chain_mask(length, step)
        assert mask.shape == (length, (step + 1) * length)
        for s in range(step, length):
            seen = {(i, p) for i in range(step + 1) for p in range(length) if mask[s, i * length + p]}
            expected = {(0, p) for p in range(s - step + 1)} | {(i, s - step + i) for i in range(1, step + 1)}
            assert seen == expected


@torch.no_grad()
def test_training_chains_equal_drafting_one_token_at_a_time():
    """Step j at position s of forward_chains == decoding: the step-0 cache of positions 0..s-j (the
    target's features), then j drafted tokens, each a one-token `extend` over the cache so far."""
    draft = _draft()
    b, t, h, steps = 2, 9, 16, 4
    features, embeds = torch.randn(b, t, 3 * h), torch.randn(b, t, h)
    chains = draft.forward_chains(features, embeds, steps)
    kv, d = draft.config.num_kv_heads, draft.config.head_dim
    for s in range(t):
        for j in range(min(steps, s + 1)):
            start = s - j
            positions = torch.arange(start + 1).expand(b, -1)
            empty = torch.zeros(b, kv, 0, d)
            causal = torch.ones(start + 1, start + 1, dtype=torch.bool).tril()[None].expand(b, -1, -1)
            out, keys, values = draft.extend(embeds[:, : start + 1], draft.fuse(features[:, : start + 1]), positions,
                                             empty, empty, causal)  # fmt: skip
            state = out[:, -1:]
            for i in range(1, j + 1):  # drafted token i sits at position start + i and sees everything so far
                see = torch.ones(b, 1, keys.shape[2] + 1, dtype=torch.bool)
                state, keys, values = draft.extend(embeds[:, start + i : start + i + 1], state,
                                                   torch.full((b, 1), start + i), keys, values, see)  # fmt: skip
            torch.testing.assert_close(chains[j][:, s], state[:, 0], rtol=1e-5, atol=1e-5)


def test_config_refuses_bad_values():
    with pytest.raises(InvalidParameterError, match="three distinct"):
        _config(feature_layers=(1, 1, 2))
    with pytest.raises(InvalidParameterError, match="multiple of num_kv_heads"):
        _config(num_kv_heads=3)
    with pytest.raises(InvalidParameterError, match="exceeds the vocabulary"):
        _config(draft_vocab=41)
    assert default_feature_layers(30) == (2, 15, 27) and default_feature_layers(3) == (0, 1, 2)
    with pytest.raises(InvalidParameterError, match="three layers"):
        default_feature_layers(2)


def test_saved_draft_loads_for_its_model_only(tmp_path):
    from specpass.heads.io import model_fingerprint

    torch.manual_seed(0)
    lm_head, other = torch.nn.Linear(16, 40, bias=False), torch.nn.Linear(16, 40, bias=False)
    draft = _draft()
    draft.config = _config(model=model_fingerprint(lm_head))
    save_feature_draft(draft, draft.config, str(tmp_path), dtype=torch.float32)
    loaded = load_feature_draft(str(tmp_path), lm_head)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    with pytest.raises(HeadsMismatchError, match="trained for model"):
        load_feature_draft(str(tmp_path), other)
    (tmp_path / "feature_draft.json").write_text("[1]")
    with pytest.raises(DamagedFileError, match="specpass train-heads --kind eagle"):
        load_feature_draft(str(tmp_path), lm_head)


def _peaked_four_layer_llama():
    import transformers

    from specpass.research.tiny_models import TINY

    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(TINY | {"num_hidden_layers": 4}))).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked next-token law: a flat one has no top-1 to agree on
    return model


def test_training_teaches_the_chain_and_saves_a_draft_for_its_model(tmp_path):
    """On a tiny random model nothing generalises, so the check is on the training sequences: the trained
    draft's chain agrees with the model's greedy token more than the untrained one at every depth; the
    saved draft loads with the same accuracy table, the features caught while generating equal a
    forward's, and a corpus cached as tokens trains the same."""
    from specpass.heads.feature_training import FeatureTrainConfig, make_feature_draft, measure_chain_accuracy
    from specpass.heads.feature_training import train_feature_draft, with_features
    from specpass.heads.train import Continuation, generate_corpus

    model = _peaked_four_layer_llama()
    layers = default_feature_layers(4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (1, 6), generator=gen) for _ in range(24)]
    corpus = generate_corpus(model, prompts[:20], max_new_tokens=24, progress=False, layers=layers)
    held_out = generate_corpus(model, prompts[20:], max_new_tokens=24, progress=False, layers=layers)
    recomputed = with_features(model, [Continuation(c.tokens, c.start) for c in corpus[:3]], layers)
    for caught, forward in zip(corpus, recomputed):
        torch.testing.assert_close(caught.layer_states, forward.layer_states, rtol=1e-4, atol=1e-4)
    config = FeatureTrainConfig(epochs=40, sequences=4, steps=3, lr=3e-3, draft_vocab=96, ranks=4)
    draft, result, losses = train_feature_draft(model, corpus, held_out, config, out_dir=str(tmp_path), progress=False)
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    untrained = make_feature_draft(model, result, [c.tokens for c in corpus]).eval()
    trained_on = measure_chain_accuracy(model, draft, corpus, 3, 1)
    before = measure_chain_accuracy(model, untrained, corpus, 3, 1)
    assert all(a[0] > b[0] + 0.1 for a, b in zip(trained_on, before)), (trained_on, before)
    assert len(result.accuracy) == 3 and all(len(row) == 4 for row in result.accuracy)
    loaded = load_feature_draft(str(tmp_path), model.lm_head)
    assert loaded.config == result
    again = measure_chain_accuracy(model, loaded.float(), held_out, 3, 4)
    assert all(abs(a - b) < 0.05 for x, y in zip(again, result.accuracy) for a, b in zip(x, y))  # float16 weights


def test_cli_refuses_options_of_other_kinds(capsys):
    """Refused before any model loads: one line naming the option, exit 2."""
    from specpass.cli import main

    for args, message in ((("--kind", "eagle", "--heads", "3"), "--heads is for draft heads"),
                          (("--kind", "hydra", "--chain-steps", "3"), "--chain-steps is for --kind eagle"),
                          (("--kind", "eagle", "--chain-steps", "0"), "steps must be a positive int")):  # fmt: skip
        assert main(["train-heads", "--out", "unused", *args]) == 2
        assert message in capsys.readouterr().err
