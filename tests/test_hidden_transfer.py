"""Hidden Transfer (heads.hidden_transfer, rewrites.HiddenTransfer, drafters.PseudoTokens,
research.transfer_training): the attention pattern, training against a plain forward, the pass's graphs,
drafting against HF greedy, seeded sampling, refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import check_drafting_equals_hf_greedy, check_sampling_equals_one_node_sampling, peaked_four_layer_llama

from specpass.common.errors import ExportError, InvalidParameterError
from specpass.heads.hidden_transfer import HiddenTransferConfig, TransferMatrices
from specpass.research.transfer_training import pseudo_logits, pseudo_mask, pseudo_positions


def _config(**changes) -> HiddenTransferConfig:
    values = dict(layer=2, num_layers=4, pseudo_tokens=3, hidden_size=32, vocab_size=96, model="m")
    return HiddenTransferConfig(**(values | changes))


def test_config_refuses_a_layer_past_the_model():
    with pytest.raises(InvalidParameterError, match="leaves none of the model's 4 layers"):
        _config(layer=4)
    with pytest.raises(InvalidParameterError, match="pseudo_tokens"):
        _config(pseudo_tokens=0)


@pytest.mark.parametrize("owners", [[0, 1, 2, 3], [1, 3]])
def test_the_pseudo_tokens_see_their_prefix_and_their_earlier_siblings(owners):
    """pseudo_mask and pseudo_positions against their definition, entry by entry (every position's
    pseudo tokens, and some positions')."""
    t, k = 4, 3
    owners = torch.tensor(owners)
    mask, positions = pseudo_mask(t, owners, k), pseudo_positions(t, owners, k)
    where = [("real", p, 0) for p in range(t)] + [("pseudo", int(p), j) for p in owners for j in range(1, k + 1)]
    for q, (kind_q, p_q, j_q) in enumerate(where):
        assert positions[q] == p_q + j_q
        for s, (kind_s, p_s, j_s) in enumerate(where):
            if kind_q == "real":
                expected = kind_s == "real" and p_s <= p_q
            else:
                expected = p_s <= p_q if kind_s == "real" else (p_s == p_q and j_s <= j_q)
            assert mask[q, s] == expected, (where[q], where[s])


@torch.no_grad()
def test_training_logits_equal_a_plain_forward_of_each_prefix_and_its_pseudo_tokens():
    """Pseudo token j of position p in the training forward == the model's layers [k, L) run with a plain
    causal mask over [real 0..p, pseudo 1..K of p] at positions 0..p, p+1..p+K (HF's own layers and
    masks), the transfer random; for every position at once and for a few."""
    model = peaked_four_layer_llama()
    transfer = TransferMatrices(_config())
    torch.manual_seed(0)
    transfer.weight.normal_(0, 0.2)
    tokens = torch.randint(0, 96, (2, 7))
    every = pseudo_logits(model, transfer, tokens, torch.arange(7).expand(2, -1))  # [B, T, K, V]
    some = pseudo_logits(model, transfer, tokens, torch.tensor([[2, 5], [0, 6]]))  # [B, 2, K, V]
    torch.testing.assert_close(some, torch.stack((every[0, [2, 5]], every[1, [0, 6]])), rtol=1e-5, atol=1e-5)
    source = model.model(tokens, output_hidden_states=True).hidden_states[2]  # [B, T, H]
    for b in range(2):
        for p in range(7):
            pseudo = transfer(source[b, p].expand(1, 3, -1))  # [1, K, H]
            states = torch.cat((source[b : b + 1, : p + 1], pseudo), 1)  # [1, p + 1 + K, H]
            positions = torch.arange(p + 1 + 3)[None]
            rotary = model.model.rotary_emb(states, positions)
            for layer in model.model.layers[2:]:
                out = layer(states, attention_mask=None, position_ids=positions, position_embeddings=rotary)
                states = out[0] if isinstance(out, tuple) else out
            expected = model.lm_head(model.model.norm(states[0, p + 1 :]))  # [K, V]
            torch.testing.assert_close(every[b, p], expected, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A transfer of 3 pseudo tokens into layer 2 of a 4-layer peaked tiny Llama, trained on its
    continuations of 20 random prompts."""
    from specpass.research.heads_training import generate_corpus
    from specpass.research.transfer_training import TransferTrainConfig, train_transfer

    model = peaked_four_layer_llama()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (1, 6), generator=gen) for _ in range(24)]
    corpus = generate_corpus(model, prompts[:20], max_new_tokens=24, progress=False)
    held_out = generate_corpus(model, prompts[20:], max_new_tokens=24, progress=False)
    config = TransferTrainConfig(epochs=30, sequences=4, positions=16, pseudo_tokens=3, layer=2, lr=3e-2, ranks=4)
    directory = str(tmp_path_factory.mktemp("transfer"))
    transfer, result, losses = train_transfer(model, corpus, held_out, config, out_dir=directory, progress=False)
    return model, corpus, held_out, directory, transfer, result, losses


def test_training_teaches_every_pseudo_token_and_saves_a_transfer_for_its_model_only(trained):
    """On a tiny random model nothing generalises, so the check is on the training sequences: the trained
    pseudo tokens agree with the model's greedy token more than the untrained (identity) ones at every
    depth; the model's own parameters are left as they were; the saved transfer loads for this model
    and is refused for another."""
    from specpass.heads.hidden_transfer import load_transfer
    from specpass.heads.io import HeadsMismatchError
    from specpass.research.tiny_models import tiny_model
    from specpass.research.transfer_training import measure_transfer_accuracy

    model, corpus, _, directory, transfer, result, losses = trained
    assert result.layer == 2 and result.pseudo_tokens == 3 and len(result.accuracy) == 3
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])  # K linear maps on a random model: measured 0.71
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    untrained = TransferMatrices(result)
    trained_on = measure_transfer_accuracy(model, transfer, corpus, 1)
    before = measure_transfer_accuracy(model, untrained, corpus, 1)
    assert all(a[0] > b[0] + 0.05 for a, b in zip(trained_on, before)), (trained_on, before)  # measured +.09 to +.24
    loaded = load_transfer(directory, model.lm_head)
    assert loaded.config == result and torch.allclose(loaded.weight, transfer.weight, atol=1e-2)
    with pytest.raises(HeadsMismatchError):
        load_transfer(directory, tiny_model("llama").lm_head)


@torch.no_grad()
def test_the_pass_adds_the_source_output_and_a_draft_graph_equal_to_the_training_forward(trained):
    """The verify graph's outputs stay bit for bit, plus the stream entering layer k (HF's hidden_states[k]);
    the draft graph, called as a step over K pseudo tokens after a committed prefix, gives the logits the
    training forward gives for that prefix's last position; the pass is refused a second time, for
    another model and for a model of another depth, and ONNX export refuses it by name."""
    import transformers

    import specpass
    from specpass.backends.onnx.export import export
    from specpass.heads.hidden_transfer import load_transfer
    from specpass.ir import capture
    from specpass.ir.draft import DRAFT_STATES, draft_graph, draft_spec, step_output
    from specpass.ir.layout import SlotLayout
    from specpass.ir.split import EXIT_HIDDEN
    from specpass.research.tiny_models import TINY, tiny_model
    from specpass.rewrites import HiddenTransfer, TreeAttention

    model, corpus, _, directory, *_ = trained
    gm, report = specpass.Pipeline(TreeAttention(8), HiddenTransfer(directory)).run(capture(model, 32))
    assert "3 pseudo tokens transferred into layer 2" in str(report)
    assert step_output(gm, DRAFT_STATES) is not None and draft_spec(gm).shares_cache
    assert "already has a draft graph" in HiddenTransfer(directory).check(gm)
    assert "trained for model" in HiddenTransfer(directory).check(capture(tiny_model("llama"), 32))
    deeper = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(TINY | {"num_hidden_layers": 5}))).eval()
    deeper.lm_head.weight.data.copy_(model.lm_head.weight)  # the same fingerprint, one layer more
    assert "trained for a 4-layer model" in HiddenTransfer(directory).check(capture(deeper, 32))
    tokens = corpus[0].tokens[:9][None]  # [1, 9]
    layout = SlotLayout.chain(0, 9)
    outputs = gm(**layout.step_inputs(tokens))
    reference = model(tokens, output_hidden_states=True)
    torch.testing.assert_close(outputs[0], reference.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outputs[-1], reference.hidden_states[2], rtol=1e-5, atol=1e-5)
    inputs = SlotLayout.chain(9, 3).step_inputs(torch.zeros(1, 3, dtype=torch.long))
    del inputs["input_ids"]
    logits = draft_graph(gm)(**inputs, **{EXIT_HIDDEN: outputs[-1][:, -1:].expand(1, 3, -1)})[0]  # [1, K, V]
    saved = load_transfer(directory, model.lm_head)  # as the pass loads it (saved in float16)
    torch.testing.assert_close(logits[0], pseudo_logits(model, saved, tokens, torch.tensor([[8]]))[0, 0], rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    with pytest.raises(ExportError, match="cannot express pass HiddenTransfer"):
        export(model, specpass.Pipeline(TreeAttention(8), HiddenTransfer(directory)), "unused", progress=False)


def test_pseudo_tokens_drafting_equals_hf_greedy_alone_combined_and_in_a_batch(trained):
    """Greedy with the trained transfer, alone and in the combined tree, equals HF greedy on prompts it was
    trained on (tau > 1.3 there: K linear maps on a random model) and unseen ones; a batch of rows (each
    drafting in its own cache row) equals each row alone; the drafter refuses a pipeline without the pass."""
    import specpass
    from specpass.drafters import Combined, PromptLookup, PseudoTokens, TokenRecycling
    from specpass.rewrites import HiddenTransfer, TreeAttention

    model, corpus, _, directory, *_ = trained
    pipeline = specpass.Pipeline(TreeAttention(16), HiddenTransfer(directory))
    combined = Combined(PseudoTokens(top_k=4), PromptLookup(), TokenRecycling())
    check_drafting_equals_hf_greedy(model, corpus, pipeline, PseudoTokens(), combined, min_tau=1.3)  # measured 1.5-2.0
    with pytest.raises(InvalidParameterError, match="needs a hidden transfer"):
        specpass.generate(model, corpus[0].tokens[:6][None], 4, options={"drafter": PseudoTokens()})


def test_pseudo_tokens_sampling_equals_one_node_sampling_with_the_same_seed(trained):
    """Sample-and-match over the pseudo tokens' tree: the same tokens as sampling one token a step."""
    import specpass
    from specpass.drafters import PseudoTokens
    from specpass.rewrites import HiddenTransfer, TreeAttention

    model, corpus, _, directory, *_ = trained
    pipeline = specpass.Pipeline(TreeAttention(16), HiddenTransfer(directory))
    check_sampling_equals_one_node_sampling(model, corpus, pipeline, PseudoTokens(), min_tau=1.1)  # measured 1.17
