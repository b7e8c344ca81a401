"""Losslessness on the real default model (float32, CPU): specpass greedy == HF greedy, token for token."""

import numpy as np
import pytest
import torch

import specpass
from conftest import FIXED_BUDGET, NEW_TOKENS, token_inside_an_accepted_draft, with_feature, with_heads
from specpass.backends.runtime.cost import CostCurve
from specpass.backends.runtime import decode
from specpass.drafters import Combined, Feature, Heads, PromptLookup, RowsDrafting, TokenRecycling
from specpass.rewrites import TreeAttention


class _Trees:
    """Every step's tree as drafted and as verified (after the budget's cut), recorded at the drafters."""

    def __init__(self):
        self.drafted, self.verified = [], []

    def clear(self):
        self.drafted.clear()
        self.verified.clear()

    def sizes(self) -> list[int]:
        return [len(tree) for tree in self.verified]


class _Recording(RowsDrafting):
    """A batch's drafting that records every row's tree as drafted and as verified."""

    def __init__(self, drafting: RowsDrafting, recorded: _Trees):
        self.drafting, self.recorded = drafting, recorded

    def draft(self, histories, max_nodes, max_depths):
        rows = self.drafting.draft(histories, max_nodes, max_depths)
        self.recorded.drafted.extend(rows.row(b) for b in range(len(rows)))
        return rows

    def precomputed(self, trees):
        return self.drafting.precomputed(trees)

    def observe(self, trees, verified, paths, histories):
        self.recorded.verified.extend(trees.row(b) for b in range(len(trees)))
        return self.drafting.observe(trees, verified, paths, histories)

    def keep(self, rows):
        return self.drafting.keep(rows)


@pytest.fixture
def trees(monkeypatch):
    """The trees of every generation in the test (the drafting the decode loop starts, wrapped)."""
    recorded = _Trees()
    prefill = decode._prefill
    monkeypatch.setattr(decode, "_prefill", lambda *args: _Recording(prefill(*args), recorded))
    return recorded


def _first_child_chain(tree):
    """The branch through every node's first child (what a program without TreeAttention verifies)."""
    keep = [0]
    while (nxt := next((i for i in range(keep[-1] + 1, len(tree)) if tree.parents[i] == keep[-1]), None)) is not None:
        keep.append(nxt)
    return [tree.tokens[i] for i in keep]


def _is_prefix(verified, drafted) -> bool:
    n = len(verified)
    return np.array_equal(verified.tokens, drafted.tokens[:n]) and np.array_equal(verified.parents, drafted.parents[:n])


OPTIONS = {
    "prompt_lookup": {"drafter": PromptLookup(), "budget": FIXED_BUDGET},
    "token_recycling": {"drafter": TokenRecycling(), "budget": FIXED_BUDGET},
    "combined": {"drafter": Combined(PromptLookup(), TokenRecycling()), "budget": FIXED_BUDGET},
    "medusa": with_heads("medusa", Heads()),
    "hydra": with_heads("hydra", Heads()),
    "hydra_combined": with_heads("hydra", Combined(Heads(), PromptLookup(), TokenRecycling())),
    "feature": with_feature(Feature()),
    "feature_combined": with_feature(Combined(Feature(), PromptLookup(), TokenRecycling())),
}
METHODS = list(OPTIONS)  # one per drafting method (static Heads trees: tests/test_heads.py, on ORT: test_onnx.py)
COMPOSITES = ("combined", "hydra_combined", "feature_combined")  # every proposer at once: on three cases


@pytest.mark.parametrize("name", list(OPTIONS))
def test_drafters_equal_greedy(default_model, cases, name):
    """The combined drafters on three cases (code and chat), each single one on the two code cases (EOS
    after 46 tokens, the length limit). Then, per method, a token the drafter got accepted in the
    middle of a multi-token step on the first case is declared EOS: the generation ends right there,
    as HF greedy with that EOS does (the reference's prefix through that token's first occurrence)."""
    model, _ = default_model
    compiled = torch.compile(model, backend="specpass", options=OPTIONS[name])
    outputs = []
    for ids, reference in cases[:3] if name in COMPOSITES else cases[:2]:
        outputs.append(specpass.generate(compiled, ids, max_new_tokens=NEW_TOKENS))
        assert torch.equal(outputs[-1].sequences, reference)
        assert outputs[-1].stats.new_tokens == reference.shape[1] - ids.shape[1]
        assert outputs[-1].stats.finish_reason in ("eos", "length")
    # the drafter drafts something the target accepts (1.0: nothing; these drafters take 1.4 to 3)
    assert sum(out.stats.tau for out in outputs) / len(outputs) > 1.15
    ids, reference = cases[0]
    continuation = reference[0, ids.shape[1] :].tolist()
    eos, position = token_inside_an_accepted_draft(continuation, outputs[0].stats.steps)
    stopped = specpass.generate(compiled, ids, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    assert stopped.sequences[0, ids.shape[1] :].tolist() == continuation[: position + 1]
    assert stopped.stats.finish_reason == "eos"


def test_chain_only_pipeline_equals_greedy(default_model, cases, trees):
    model, _ = default_model
    options = {"pipeline": specpass.Pipeline(), "drafter": PromptLookup(), "lowering": "eager"}
    for ids, reference in cases[:1]:  # a code prompt: prompt lookup drafts chains there
        trees.clear()
        out = specpass.generate(model, ids, max_new_tokens=NEW_TOKENS, options=options)
        assert torch.equal(out.sequences, reference)
        assert len(trees.verified) == len(trees.drafted) == len(out.stats.steps) == out.stats.target_forwards - 1
        for drafted, verified in zip(trees.drafted, trees.verified):  # a prefix of the first-child branch
            assert verified.is_chain() and list(verified.tokens) == _first_child_chain(drafted)[: len(verified)]
        assert out.stats.mean_tree_size == sum(trees.sizes()) / len(trees.sizes())
        assert max(trees.sizes()) > 1  # prompt lookup drafted chains that were verified


@pytest.mark.parametrize("name", METHODS)
def test_length_limits(default_model, cases, name):
    model, _ = default_model
    ids, reference = cases[0]
    for limit in (1, 7):  # the prefill's token alone; a cut inside a step
        out = specpass.generate(model, ids, max_new_tokens=limit, options=OPTIONS[name])
        assert torch.equal(out.sequences, reference[:, : ids.shape[1] + limit])
        assert out.stats.finish_reason == "length"


def test_cache_full_stops_with_a_clear_reason(default_model, cases):
    model, _ = default_model
    ids, reference = cases[3]
    cache = ids.shape[1] + 20
    options = {"cache_size": cache, "budget": FIXED_BUDGET}
    out = specpass.generate(model, ids, max_new_tokens=NEW_TOKENS, options=options)
    assert out.stats.finish_reason == "cache_full"
    n = out.sequences.shape[1]
    assert n == cache + 1 and torch.equal(out.sequences, reference[:, :n])


def test_bad_requests_are_clear_errors(default_model):
    model, tokenizer = default_model
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    with pytest.raises(specpass.InvalidParameterError, match="prompt is empty"):
        specpass.generate(model, ids[:, :0], max_new_tokens=8)
    for bad in (0, -1):
        with pytest.raises(specpass.InvalidParameterError, match="max_new_tokens must be a positive int"):
            specpass.generate(model, ids, max_new_tokens=bad)
    with pytest.raises(specpass.InvalidParameterError, match="batch size 2: this SpeculativeProgram holds 1 sequence"):
        specpass.generate(specpass.compile_program(model), ids.repeat(2, 1), max_new_tokens=8)
    with pytest.raises(specpass.CacheCapacityError, match="KV cache holds 4"):
        specpass.generate(model, ids, max_new_tokens=8, options={"cache_size": 4})


def test_tree_budget_follows_the_cost_curve(default_model, cases, trees, monkeypatch):
    model, _ = default_model
    ids, reference = cases[0]
    compiled = torch.compile(model, backend="specpass", options={"pipeline": specpass.Pipeline(TreeAttention(8))})
    program = specpass.compile_program(compiled)
    curve = program.cost_curve
    assert curve.sizes[0] == 1 and curve.sizes[-1] == 8 and all(s > 0 for s in curve.seconds)
    out = specpass.generate(compiled, ids, max_new_tokens=32)
    assert torch.equal(out.sequences, reference[:, : ids.shape[1] + 32])
    assert all(_is_prefix(v, d) for d, v in zip(trees.drafted, trees.verified))  # the budget cuts a prefix
    assert len(trees.verified[0]) == curve.best_size(trees.drafted[0].expected_tokens().tolist())  # no overhead measured yet
    assert out.stats.mean_tree_size == sum(trees.sizes()) / len(trees.sizes())

    # A flat curve (8 nodes cost what 1 costs) keeps every drafted tree whole; a steep one keeps the root only.
    for seconds, keeps_all in (((curve.seconds[0],) * 2, True), ((curve.seconds[0], 1e3), False)):
        monkeypatch.setattr(program, "_cost", CostCurve((1, 8), seconds))
        trees.clear()
        out = specpass.generate(compiled, ids, max_new_tokens=12)
        assert torch.equal(out.sequences, reference[:, : ids.shape[1] + 12])
        expected = [len(tree) if keeps_all else 1 for tree in trees.drafted]
        assert trees.sizes() == expected and max(len(tree) for tree in trees.drafted) == 8
        if not keeps_all:
            assert set(out.stats.steps) == {1} and out.stats.mean_tree_size == 1.0


def test_fixed_budget_verifies_the_full_tree(default_model, cases, trees):
    model, _ = default_model
    options = {"budget": 12, "pipeline": specpass.Pipeline(TreeAttention(64))}
    ids, reference = cases[0]
    out = specpass.generate(model, ids, max_new_tokens=NEW_TOKENS, options=options)
    assert torch.equal(out.sequences, reference)
    program = specpass.compile_program(model, specpass.CompileOptions(**options))
    assert program._cost is None  # a fixed budget never measures the cost curve
    assert all(_is_prefix(v, d) for d, v in zip(trees.drafted, trees.verified))
    assert trees.sizes() == [min(12, len(tree)) for tree in trees.drafted]  # 12 nodes whenever there are 12
    assert out.stats.mean_tree_size == sum(trees.sizes()) / len(trees.sizes())
    assert max(trees.sizes()) == 12 and 6.0 < out.stats.mean_tree_size  # 7.4: the budget is filled most steps
