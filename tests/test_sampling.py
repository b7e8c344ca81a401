"""Sampling: the keyed-noise sampler draws from the processed distribution (chi-square tests that a broken
sampler fails), and speculative sampling equals non-speculative sampling with the same seed, token for
token, on the real default model (float32, CPU)."""

import math

import numpy as np
import pytest
import torch

import specpass
from conftest import FIXED_BUDGET, NEW_TOKENS, token_inside_an_accepted_draft, with_feature, with_heads
from specpass.backends.runtime.sampling import (
    KeyedNoise, Sampling, TargetChoice, choose_rows, node_prefixes, position_noise,
)  # fmt: skip
from specpass.drafters import Combined, Feature, Heads, PromptLookup, TokenRecycling
from specpass.rewrites import TreeAttention

DRAWS = 100_000
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, -6.0])  # [V]: a vocabulary tail too


def _draws(choice: TargetChoice, logits: torch.Tensor, n: int, start: int = 1) -> torch.Tensor:
    """n draws of the token after a one-token prefix: a chain of n nodes with equal logits predicts
    positions start+1 .. start+n, each with its own noise, so the draws are independent."""
    parents = tuple(range(-1, n - 1))
    return choice(logits.expand(n, -1), [0] * start, parents, (0,) * n)


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of counts against probs; cells expecting fewer than 5
    draws are pooled into one (the test's usual validity rule), cells with p = 0 must be empty."""
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * counts.sum()
    order = expected.argsort(descending=True)
    expected, observed = expected[order], counts[order].double()
    big = int((expected >= 5).sum())
    if big < len(expected):  # pool the tail, with the smallest big cell too if the pool stays small
        big -= int(expected[big:].sum() < 5)
        expected = torch.cat([expected[:big], expected[big:].sum()[None]])
        observed = torch.cat([observed[:big], observed[big:].sum()[None]])
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def _target(sampling: Sampling) -> torch.Tensor:
    """The processed distribution as Hugging Face's warpers define it."""
    scores = LOGITS[None].clone()
    for warper in sampling.processors():
        scores = warper(torch.zeros(1, 1, dtype=torch.long), scores)
    return scores[0].softmax(-1)


CASES = [
    Sampling(do_sample=True, temperature=0.3),
    Sampling(do_sample=True, temperature=0.7),
    Sampling(do_sample=True, temperature=1.0),
    Sampling(do_sample=True, temperature=1.5),
    Sampling(do_sample=True, temperature=0.7, top_k=3),
    Sampling(do_sample=True, temperature=1.0, top_p=0.9),
    Sampling(do_sample=True, temperature=1.5, top_k=5, top_p=0.8, min_p=0.05),
]


@pytest.mark.parametrize("sampling", CASES, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}-m{s.min_p}")
def test_keyed_sampler_draws_from_the_processed_distribution(sampling):
    probs = _target(sampling)
    draws = _draws(TargetChoice(sampling=sampling), LOGITS, DRAWS)
    counts = torch.bincount(draws, minlength=len(LOGITS))
    assert counts[probs == 0].sum() == 0  # nothing outside top-k / top-p / min-p
    assert _chi_square_p(counts, probs) > 1e-3
    # total variation shrinks with the number of draws, as plain sampling's does (~ 1/sqrt(n))
    tv = [0.5 * float((torch.bincount(draws[:n], minlength=len(LOGITS)) / n - probs).abs().sum()) for n in (1000, DRAWS)]
    assert tv[1] < tv[0] and tv[1] < 0.01


def test_next_two_tokens_follow_the_chain_rule():
    """Two positions, the second's law depending on the first token: the pair frequencies match
    p(a) p(b | a). Keyed noise is independent across positions."""
    sampling = Sampling(do_sample=True, temperature=1.0)
    first = torch.tensor([1.0, 0.0, -1.0])  # [V]
    second = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])  # [V, V]: row a is p(. | a)
    pairs = _pairs(lambda seed: TargetChoice(sampling=Sampling(do_sample=True, seed=seed)), first, second, 20_000)
    probs = (first.softmax(-1)[:, None] * second.softmax(-1)).flatten()
    assert _chi_square_p(pairs, probs) > 1e-3
    assert sampling.do_sample


def _pairs(choice_for_seed, first: torch.Tensor, second: torch.Tensor, n: int) -> torch.Tensor:
    counts = torch.zeros(first.numel() * second.shape[-1], dtype=torch.long)
    for seed in range(n):
        choice = choice_for_seed(seed)
        a = int(choice(first[None], [0])[0])  # position 1
        b = int(choice(second[a][None], [0, a])[0])  # position 2
        counts[a * second.shape[-1] + b] += 1
    return counts


def test_broken_samplers_fail_the_same_tests():
    """The tests can fail: noise shared by all positions, and a sampler that ignores temperature."""

    class SharedNoise(TargetChoice):
        def __call__(self, logits, tokens, parents=(-1,), node_tokens=None):
            return (logits.float() + position_noise(self.sampling.seed, 0, logits.shape[-1])).argmax(-1)

    first = torch.tensor([0.0, 0.0, 0.0])
    second = torch.zeros(3, 3)
    probs = (first.softmax(-1)[:, None] * second.softmax(-1)).flatten()
    pairs = _pairs(lambda seed: SharedNoise(sampling=Sampling(do_sample=True, seed=seed)), first, second, 3000)
    assert _chi_square_p(pairs, probs) < 1e-3

    cold = Sampling(do_sample=True, temperature=0.3)
    draws = _draws(TargetChoice(sampling=Sampling(do_sample=True)), LOGITS, 20_000)  # temperature dropped
    assert _chi_square_p(torch.bincount(draws, minlength=len(LOGITS)), _target(cold)) < 1e-3


def test_edge_cases_of_the_sampler():
    # top_k = 1 is greedy; a distribution concentrated on one token always gives it
    logits = torch.randn(6, 50)
    tokens, parents = [1, 2, 3], (-1, 0, 0, 1, 3, 4)
    top1 = TargetChoice(sampling=Sampling(do_sample=True, top_k=1, temperature=1.5, seed=5))
    assert torch.equal(top1(logits, tokens, parents, (3, 7, 8, 9, 10, 11)), logits.argmax(-1))
    peaked = torch.full((1, 50), -1e9)
    peaked[0, 17] = 0.0
    assert all(int(_draws(TargetChoice(sampling=Sampling(do_sample=True, seed=s)), peaked[0], 4)[0]) == 17 for s in range(5))
    # nodes at the same depth share their position's noise: equal logits give equal choices
    choice = TargetChoice(sampling=Sampling(do_sample=True, seed=9))
    same = choice(torch.zeros(3, 50), tokens, (-1, 0, 0), (3, 7, 8))
    assert same[1] == same[2]
    assert torch.equal(position_noise(9, 4, 50), position_noise(9, 4, 50))
    assert not torch.equal(position_noise(9, 4, 50), position_noise(9, 5, 50))
    assert not torch.equal(position_noise(9, 4, 50), position_noise(10, 4, 50))
    assert node_prefixes([5, 6], (-1, 0, 1, 0), (6, 7, 8, 9)) == [[5, 6], [5, 6, 7], [5, 6, 7, 8], [5, 6, 9]]


def test_invalid_sampling_settings_are_refused():
    for bad in (dict(temperature=0.0), dict(temperature=math.inf), dict(top_k=-1), dict(top_p=0.0),
                dict(top_p=1.5), dict(min_p=1.0), dict(seed=-1), dict(do_sample=1)):  # fmt: skip
        with pytest.raises(specpass.InvalidParameterError):
            Sampling(**({"do_sample": True} | bad))
    with pytest.raises(specpass.InvalidParameterError, match="temperature: only takes effect when sampling"):
        Sampling(temperature=0.7)


def test_keyed_noise_is_position_noise_and_keeps_recent_positions():
    noise = KeyedNoise(seed=5, keep=2)
    first = noise(10, 50)
    assert torch.equal(first, position_noise(5, 10, 50)) and noise(10, 50) is first  # computed once
    noise(11, 50), noise(12, 50)  # position 10 is now the least recent of three: dropped
    assert noise(10, 50) is not first and torch.equal(noise(10, 50), first)


def test_a_batch_of_rows_chooses_as_each_row_would_by_hand():
    """choose_rows over rows with different settings, seeds and a processor that reads input_ids
    (repetition penalty) equals, row by row, HF's processors applied to each node's own prefix, plus
    the node's position noise, then argmax (plain greedy rows keep the greedy choice given)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    penalty = RepetitionPenaltyLogitsProcessor(1.3)
    rows = [  # (processors, sampling, history)
        ((), Sampling(), [1, 2, 3]),
        ((), Sampling(do_sample=True, temperature=0.7, seed=1), [4, 5]),
        ((), Sampling(do_sample=True, temperature=0.7, seed=2), [6, 7, 8, 9]),
        ((), Sampling(do_sample=True, top_k=5, top_p=0.8, seed=3), [1]),
        ((penalty,), Sampling(do_sample=True, temperature=1.5, seed=4), [3, 3, 5]),
        ((penalty,), Sampling(), [2, 9]),
    ]
    vocab, width = 12, 4
    tokens = np.array([[3, 5, 6, 0], [5, 1, 2, 7], [9, 4, 0, 0], [1, 2, 3, 4], [5, 3, 11, 3], [9, 9, 2, 0]])
    parents = np.array([[-1, 0, 0, -1], [-1, 0, 1, 2], [-1, 0, -1, -1], [-1, 0, 0, 1], [-1, 0, 1, 0], [-1, 0, 1, -1]])
    sizes = np.array([3, 4, 2, 4, 4, 3])
    logits = torch.randn(len(rows), width, vocab, generator=torch.Generator().manual_seed(0)) * 3  # [B, T, V]
    greedy = logits.argmax(-1)
    choices = [TargetChoice(p, s) for p, s, _ in rows]
    histories = [h for _, _, h in rows]
    chosen = choose_rows(choices, histories, tokens, parents, sizes, logits, greedy)
    for b, (processors, sampling, history) in enumerate(rows):
        n = int(sizes[b])
        prefixes = node_prefixes(history, parents[b, :n].tolist(), tokens[b, :n].tolist())
        for i in range(n):
            scores = logits[b, i][None].clone()
            for processor in [*processors, *(sampling.processors() if sampling.do_sample else [])]:
                scores = processor(torch.tensor([prefixes[i]]), scores)
            if sampling.do_sample:
                depth = len(prefixes[i]) - len(history)
                scores = scores + position_noise(sampling.seed, len(history) + depth, vocab)
            assert int(chosen[b, i]) == int(scores.argmax()), (b, i)
    assert torch.equal(chosen[0], greedy[0])


DRAFTERS = {  # every proposer: prompt lookup and Token Recycling together, and with Hydra's heads
    "combined": {"drafter": Combined(PromptLookup(), TokenRecycling()), "budget": FIXED_BUDGET},
    "hydra_combined": with_heads("hydra", Combined(Heads(), PromptLookup(), TokenRecycling())),
    "feature_combined": with_feature(Combined(Feature(), PromptLookup(), TokenRecycling())),
}
SETTINGS = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=20), dict(temperature=0.3)]


def _settings(case: int) -> dict:
    return SETTINGS[case % len(SETTINGS)] | {"seed": case}


@pytest.fixture(scope="module")
def plain_samples(default_model, cases) -> list[torch.Tensor]:
    """Non-speculative sampling (one node a step) of three cases (two code, one chat), each with its
    own settings (one per SETTINGS entry) and seed."""
    model, _ = default_model
    plain = {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))}
    return [specpass.generate(model, ids, NEW_TOKENS, do_sample=True, options=plain, **_settings(i)).sequences
            for i, (ids, _) in enumerate(cases[:3])]  # fmt: skip


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_speculative_sampling_equals_plain_sampling_with_the_same_seed(default_model, cases, plain_samples, name):
    model, _ = default_model
    taus = []
    for i, ((ids, _), reference) in enumerate(zip(cases[:3], plain_samples, strict=True)):
        out = specpass.generate(model, ids, NEW_TOKENS, do_sample=True, options=DRAFTERS[name], **_settings(i))
        assert torch.equal(out.sequences, reference)
        taus.append(out.stats.tau)
    assert sum(taus) / len(taus) > 1.1  # drafts are accepted while sampling


def test_sampling_eos_inside_an_accepted_draft_and_the_length_limit(default_model, cases):
    model, _ = default_model
    ids, _ = cases[0]
    options = DRAFTERS["combined"]
    full = specpass.generate(model, ids, 64, do_sample=True, temperature=0.3, seed=1, options=options)
    eos, position = token_inside_an_accepted_draft(full.sequences[0, ids.shape[1] :].tolist(), full.stats.steps)
    out = specpass.generate(model, ids, 64, eos_token_id=eos, do_sample=True, temperature=0.3, seed=1, options=options)
    assert torch.equal(out.sequences[0], full.sequences[0, : ids.shape[1] + position + 1])
    assert out.stats.finish_reason == "eos"
    short = specpass.generate(model, ids, 5, do_sample=True, temperature=0.3, seed=1, options=options)
    assert torch.equal(short.sequences, full.sequences[:, : ids.shape[1] + 5]) and short.stats.finish_reason == "length"
