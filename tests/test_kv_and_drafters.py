import time

import pytest
import torch

from specpass.backends.cost import CostCurve, measure
from specpass.backends.kv import compact
from specpass.drafters.heads import HeadStats
from specpass.drafters.stats import ProbabilityCalibration
from specpass.drafters import (
    Combined, DraftTree, Drafting, PromptLookup, TokenRecycling, Verified, accept_greedy, build_tree, expected_tokens,
)  # fmt: skip


def _verified(topk: torch.Tensor) -> Verified:
    return Verified(topk, torch.zeros(topk.shape[0], 4), topk[:, 0])


def test_compact_moves_the_accepted_path_into_place():
    k = torch.arange(2 * 1 * 1 * 10 * 1, dtype=torch.float32).reshape(2, 1, 1, 10, 1)
    v = -k.clone()
    before = k.clone()
    compact(k, v, torch.tensor([6, 8]), torch.tensor([5, 6]))  # path root@4, nodes at 6 and 8
    assert torch.equal(k[:, :, :, 5], before[:, :, :, 6]) and torch.equal(k[:, :, :, 6], before[:, :, :, 8])
    assert torch.equal(k[:, :, :, :5], before[:, :, :, :5])
    assert torch.equal(v, -k)


def test_accept_greedy_follows_the_targets_choices():
    tree = DraftTree((10, 11, 12, 13, 14), (-1, 0, 0, 2, 3), (1.0,) * 5, (None,) * 5)
    assert accept_greedy(tree, [12, 0, 13, 99, 0]) == [0, 2, 3]
    assert accept_greedy(tree, [7, 0, 0, 0, 0]) == [0]
    assert accept_greedy(tree, [12, 0, 13, 14, 1]) == [0, 2, 3, 4]


def test_prompt_lookup_branches_are_distinct_continuations():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 7, 1, 2, 3]
    session = PromptLookup(max_depth=3).start(tokens, _verified(torch.zeros(len(tokens), 8, dtype=torch.long)))
    branches = session.branches(tokens)
    assert branches[0] == (3, [7, 7, 1]) and branches[1] == (3, [9, 1, 2])


def test_built_tree_prefixes_are_trees_and_merge_duplicates():
    tokens = [1, 2, 3, 9, 1, 2, 3]
    topk = torch.tensor([[2, 5], [3, 6], [9, 4], [1, 1], [2, 0], [3, 0], [9, 8]])
    sessions = Combined(PromptLookup(), TokenRecycling(top_k=2)).sessions(tokens, _verified(topk))
    tree = Drafting(sessions).draft(tokens, max_nodes=6, max_depth=4)
    assert len(tree) == 6 and tree.tokens[0] == 3
    pairs = [(tree.parents[i], tree.tokens[i]) for i in range(1, len(tree))]
    assert len(pairs) == len(set(pairs))  # one node per (parent, token)
    assert tree.tokens[1] == 9  # both drafters agree that 9 follows 3
    assert max(tree.depths()) <= 4
    for n in range(1, len(tree) + 1):
        tree.prefix(n)  # every prefix is a valid tree (parents precede children)
    exp = expected_tokens(tree)
    assert exp[0] == 1.0 and all(b >= a for a, b in zip(exp, exp[1:]))


def test_token_recycling_learns_successors_from_verify_steps():
    session = TokenRecycling(top_k=2).start([1, 2], _verified(torch.tensor([[2, 3], [4, 5]])))
    tree = build_tree(2, [session.candidates([1, 2])], max_nodes=3, max_depth=1)
    assert set(tree.tokens[1:]) <= {4, 5}
    session.observe(tree, _verified(torch.tensor([[8, 9]] * len(tree))), [0], [1, 2])
    again = build_tree(2, [session.candidates([1, 2])], max_nodes=2, max_depth=1)
    assert again.tokens[1] == 8


def test_cost_curve_picks_the_size_with_most_tokens_per_second():
    curve = CostCurve((1, 2, 4, 8), (1.0, 1.1, 1.3, 2.6))
    assert curve.latency(3) == 1.2000000000000002 or abs(curve.latency(3) - 1.2) < 1e-9
    assert curve.best_size([1.0, 1.5, 1.9, 2.2, 2.4, 2.5, 2.6, 2.7]) == 4
    assert curve.best_size([1.0, 1.05, 1.06, 1.07]) == 1
    assert CostCurve((1, 64), (1.0, 1.0)).best_size([1.0, 2.0, 3.0]) == 3


def test_cost_curve_envelope_and_a_single_measured_size():
    eager = CostCurve((1, 4, 16), (1.0, 1.6, 2.4))
    onednn = CostCurve((1, 4, 16), (1.2, 1.3, 1.8))
    assert CostCurve.lower_envelope([eager, onednn]) == CostCurve((1, 4, 16), (1.0, 1.3, 1.8))
    with pytest.raises(ValueError, match="different sizes"):
        CostCurve.lower_envelope([eager, CostCurve((1, 8), (1.0, 2.0))])
    assert onednn.subset([16, 1]) == CostCurve((1, 16), (1.2, 1.8))
    one = CostCurve((1,), (0.5,))
    assert one.latency(1) == one.latency(200) == 0.5  # nothing to extrapolate from: constant


def test_probability_calibration_learns_how_often_each_decile_is_accepted():
    cal = ProbabilityCalibration(bins=10, strength=2.0)
    assert cal("head 0", 0.5) == 0.5  # nothing seen yet: the drafter's own probability
    for i in range(100):  # overconfident: drafts at p = 0.5 accepted a quarter of the time
        cal.record("head 0", 0.5, accepted=i % 4 == 0)
    ratio = (25 + 2) / (50 + 2)
    assert abs(cal("head 0", 0.5) - 0.5 * ratio) < 1e-12
    assert abs(cal("head 0", 0.55) - 0.55 * ratio) < 1e-12  # the same decile, order kept within it
    assert cal("head 0", 0.9) == 0.9 and cal("head 1", 0.5) == 0.5  # other deciles, other keys
    for _ in range(20):  # underconfident: drafts at p = 0.2 always accepted
        cal.record("head 1", 0.2, accepted=True)
    assert abs(cal("head 1", 0.2) - 0.2 * (20 + 2) / (4 + 2)) < 1e-12
    assert cal("head 1", 0.29) == 1.0  # a probability, capped at 1
    cal.record("head 1", 1.0, accepted=True)  # p = 1 falls in the last decile
    assert cal("head 1", 0.95) == 0.95


def test_head_stats_feed_both_trees():
    stats = HeadStats({(1, 0): 0.5})
    stats.record((1, 0, 0.8), accepted=False)
    assert stats.rate((1, 0)) == (0 + 0.5 * 8) / (1 + 8)  # the static tree's rate per (depth, rank)
    assert stats.calibration(1, 0.8) == 0.8 * 2 / (0.8 + 2)  # the dynamic tree's calibration per depth
    assert stats.calibration(2, 0.8) == 0.8


def test_cost_curve_times_fast_steps_until_enough_time_has_passed():
    calls = {}

    def forward(delay):
        def run(tokens, positions, mask, start):
            calls[delay, len(tokens)] = calls.get((delay, len(tokens)), 0) + 1
            time.sleep(delay)

        return run

    slow = measure(forward(0.012), torch.device("cpu"), (1, 4), repeats=5, min_seconds=0.05)
    assert calls[0.012, 1] == calls[0.012, 4] == 2 + 5  # warm-up + repeats: 5 x 12 ms passes 50 ms
    assert all(0.012 <= s < 0.1 for s in slow.seconds)
    measure(forward(0.0005), torch.device("cpu"), (1, 4), repeats=5, min_seconds=0.05)
    assert calls[0.0005, 1] > 2 + 5 and calls[0.0005, 4] > 2 + 5  # sub-ms steps: more runs, to 50 ms of samples


def test_token_recycling_table_is_inherited_by_the_next_generation():
    drafter = TokenRecycling(top_k=2)
    memory = drafter.new_memory()
    first = drafter.start([1, 2], _verified(torch.tensor([[2, 3], [4, 5]])), memory)
    tree = build_tree(2, [first.candidates([1, 2])], max_nodes=3, max_depth=1)
    first.observe(tree, _verified(torch.tensor([[8, 9]] * len(tree))), [0], [1, 2])
    second = drafter.start([7], _verified(torch.tensor([[6, 6]])), memory)  # a new prompt, same program: hot start
    inherited = build_tree(2, [second.candidates([7, 2])], max_nodes=2, max_depth=1)
    assert inherited.tokens[1] == 8
    cold = drafter.start([7], _verified(torch.tensor([[6, 6]])))
    assert len(build_tree(2, [cold.candidates([7, 2])], max_nodes=2, max_depth=1)) == 1  # nothing known about 2


def test_successor_table_evicts_the_least_recently_written_pair():
    table = TokenRecycling(max_pairs=2).new_memory()
    table.write(1, 2, [3])
    table.write(2, 3, [4])
    table.write(1, 2, [5])  # rewritten: now the most recent
    table.write(3, 4, [6])
    assert list(table.by_pair) == [(1, 2), (3, 4)] and table.by_pair[1, 2] == [5]
    assert table.by_token == {2: [5], 3: [4], 4: [6]}  # one row per token, bounded by the vocabulary


def test_combined_drafter_memory_is_one_per_member():
    drafter = Combined(PromptLookup(), TokenRecycling())
    memory = drafter.new_memory()
    assert memory[0] is None and len(memory[1]) == 0
    sessions = drafter.sessions([1, 2, 1], _verified(torch.tensor([[2, 0], [1, 0], [2, 0]])), memory)
    assert sessions[1].table is memory[1] and len(memory[1]) == 2
