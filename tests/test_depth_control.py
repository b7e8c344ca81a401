"""The adaptive self-draft controller (drafters.depth_control) on synthetic acceptance and cost traces,
and SelfDraft(adaptive=True) end to end: lossless, and off where drafting cannot pay."""

import pytest
import torch
from conftest import self_draft_taus_equal_to_hf_greedy, tiny_model

import specpass
from specpass.drafters import SelfDraft
from specpass.drafters.depth_control import DepthController
from specpass.common.errors import InvalidParameterError
from specpass.rewrites import EarlyExit, TreeAttention


def _run(controller: DepthController, steps: int, accept: float, call: float, rest_on: float, rest_off: float,
         resumed: bool = True) -> list[int]:  # fmt: skip
    """Feeds `steps` steps: each chain token accepted with probability `accept` given its parent (a fixed
    pattern, so the trace is deterministic), a draft call costs `call` s, the rest of a step `rest_on`
    s with the chain on and `rest_off` s off. Returns the depths chosen."""
    rates, chosen = [accept] * controller.max_depth, []
    for step in range(steps):
        depth = controller.choose(rates)
        chosen.append(depth)
        accepted = 0
        while accepted < depth and ((step * 7 + accepted * 3) % 10) / 10 < accept:
            accepted += 1
        calls = depth + 1 if depth else 0
        rest = rest_on if depth else rest_off
        controller.measure(rest + calls * call, calls, calls * call, accepted + 1, accepted, resumed and depth > 0)
    return chosen


def test_it_drafts_deep_when_drafts_are_cheap_and_accepted():
    chosen = _run(DepthController(6), 30, accept=0.9, call=0.002, rest_on=0.030, rest_off=0.034)
    assert chosen[:2] == [6, 0]  # both arms measured first
    assert [i for i, d in enumerate(chosen) if d == 0] == [1, 10, 19, 28]  # one step off after every 8 on
    assert all(d >= 5 for d in chosen if d)


def test_it_turns_off_when_a_call_costs_more_than_its_tokens_and_probes_ever_less_often():
    chosen = _run(DepthController(4), 80, accept=0.3, call=0.025, rest_on=0.030, rest_off=0.034)
    on = [(i, d) for i, d in enumerate(chosen) if d]
    assert on == [(0, 4), (10, 1), (27, 1), (60, 1)]  # one-token probes after 8, 16, 32 steps off


def test_it_turns_back_on_when_acceptance_recovers():
    controller = DepthController(4)
    off = _run(controller, 12, accept=0.2, call=0.010, rest_on=0.030, rest_off=0.034)
    assert off.count(0) >= 10 and off[0] == 4
    rates = [0.95] * 4  # the text became predictable: the next probe's outcomes raise the rates
    depths = []
    for _ in range(12):
        depth = controller.choose(rates)
        depths.append(depth)
        calls = depth + 1 if depth else 0
        controller.measure((0.030 if depth else 0.034) + calls * 0.010, calls, calls * 0.010, depth + 1, depth, True)
    assert depths[-1] == 4 and depths.count(0) < 9


def test_the_depth_follows_the_acceptance_and_cost_arithmetic():
    controller = DepthController(8)
    controller.measure(0.030 + 3 * 0.004, 3, 3 * 0.004, 2, 1, True)  # one step on: calls of 4 ms, rest 30 ms
    controller.measure(0.034, 0, 0.0, 1, 0, False)  # one step off: 34 ms
    rates = [0.8, 0.8, 0.8, 0.2, 0.2, 0.2, 0.2, 0.2]  # the fourth token onward is rarely accepted
    best = controller.choose(rates)
    by_hand = max(range(9), key=lambda d: controller.expected_rate(d, rates))
    assert best == by_hand == 3
    assert controller.expected_rate(3, rates) > controller.expected_rate(0, rates)


def test_a_chain_that_only_repeats_the_other_drafters_tokens_is_turned_off():
    """In a combined tree the chain's accepted tokens count as its own even when prompt lookup proposed
    them too; steps with the chain off show the tokens come anyway, and off wins."""
    controller = DepthController(4)
    rates = [0.9] * 4
    assert controller.choose(rates) == 4
    controller.measure(0.030 + 5 * 0.005, 5, 5 * 0.005, 4, 3, False)  # on: 4 tokens, 3 of them the chain's
    controller.measure(0.030, 0, 0.0, 4, 0, False)  # off: the same 4 tokens, from the other drafters
    assert controller.expected_rate(0, rates) > max(controller.expected_rate(d, rates) for d in range(1, 5))
    assert controller.choose(rates) == 0


def test_adaptive_self_draft_is_lossless_and_the_parameter_is_checked():
    model = tiny_model("llama", seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked next-token law, so drafts get accepted
    options = {"pipeline": specpass.Pipeline(TreeAttention(16), EarlyExit(1)), "drafter": SelfDraft(4, adaptive=True),
               "cache_size": 128, "budget": 5}  # fmt: skip
    assert max(self_draft_taus_equal_to_hf_greedy(model, options)) > 1.0
    with pytest.raises(InvalidParameterError, match="adaptive must be a bool"):
        SelfDraft(4, adaptive="yes")
