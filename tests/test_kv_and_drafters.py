import random

import numpy as np
import pytest
import torch

from specpass.backends.runtime.cost import CostCurve, measure
from specpass.backends.runtime.kv import compact
from specpass.drafters.heads import HeadStats
from specpass.drafters.stats import ProbabilityCalibration
from specpass.drafters import (
    Candidate, Combined, DraftTree, PromptLookup, TokenRecycling, TargetForward, accept_greedy, build_tree,
    draft_row,
)  # fmt: skip
from specpass.common.errors import InvalidParameterError


def _verified(topk: torch.Tensor) -> TargetForward:
    return TargetForward(topk, torch.zeros(topk.shape[0], 4), topk[:, 0])


def test_compact_moves_the_accepted_path_into_place():
    k = torch.arange(2 * 1 * 1 * 10 * 1, dtype=torch.float32).reshape(2, 1, 1, 10, 1)
    v = -k.clone()
    before = k.clone()
    compact(k, v, torch.tensor([0, 0]), torch.tensor([6, 8]), torch.tensor([5, 6]))  # row 0: root@4, nodes at 6 and 8
    assert torch.equal(k[:, :, :, 5], before[:, :, :, 6]) and torch.equal(k[:, :, :, 6], before[:, :, :, 8])
    assert torch.equal(k[:, :, :, :5], before[:, :, :, :5])
    assert torch.equal(v, -k)


def test_ancestor_mask_marks_each_node_and_its_ancestors():
    rng = random.Random(0)
    trees = [DraftTree.chain(range(64)), DraftTree((0,) * 16, (-1,) + (0,) * 15, (1.0,) * 16, (None,) * 16)]
    for n in (1, 2, 8, 16, 64):
        for _ in range(20):
            parents = (-1, *(rng.randrange(i) for i in range(1, n)))
            trees.append(DraftTree((0,) * n, parents, (1.0,) * n, (None,) * n))
    for tree in trees:
        n = len(tree)
        expected = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            node = i
            while node >= 0:  # i itself, then its parent, its parent's parent, ... up to the root
                expected[i, node] = True
                node = tree.parents[node]
        mask = tree.ancestor_mask()
        assert mask.dtype == torch.bool and mask.shape == (n, n) and torch.equal(mask, expected), tree.parents
    assert torch.equal(trees[0].ancestor_mask(), torch.ones(64, 64, dtype=torch.bool).tril())  # a chain


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
    tree = draft_row(sessions, tokens, max_nodes=6, max_depth=4)
    # prompt lookup copies 9 1 2 3 after "1 2 3"; token recycling's successors of 3 are 9 and 8
    assert tree.tokens.tolist() == [3, 9, 1, 2, 3, 8] and tree.parents.tolist() == [-1, 0, 1, 2, 3, 0]
    pairs = [(tree.parents[i], tree.tokens[i]) for i in range(1, len(tree))]
    assert len(pairs) == len(set(pairs))  # one node per (parent, token)
    # both drafters propose 9 after 3: one node, scored and credited by the likelier proposal (the copy)
    assert tree.origins[1] == (0, 3) and tree.scores[1] == sessions[0].stats.rate(3)
    assert sessions[0].stats.rate(3) > max(sessions[1].stats.rate(("tok", 0)), sessions[1].stats.rate(("ctx", 0)))
    assert tree.depths() == [0, 1, 2, 3, 4, 1]
    assert all(a >= b for a, b in zip(tree.scores[1:], tree.scores[2:]))  # best-first: taken by falling score
    for n in range(1, len(tree) + 1):  # every prefix is a tree: the first n nodes, parents before children
        prefix = tree.prefix(n)
        assert len(prefix) == n and prefix.tokens.tolist() == tree.tokens[:n].tolist() and prefix.parents.tolist() == tree.parents[:n].tolist()
        assert prefix.scores.tolist() == tree.scores[:n].tolist() and prefix.origins.tolist() == tree.origins[:n].tolist()
    with pytest.raises(ValueError, match="every parent must precede its child"):
        DraftTree((1, 2, 3), (-1, 2, 0), (1.0,) * 3, (None,) * 3)
    exp = tree.expected_tokens().tolist()
    assert exp == [1.0 + sum(tree.scores[1:n]) for n in range(1, len(tree) + 1)]


def test_build_tree_reads_candidates_as_named_or_bare_tuples():
    class Source:
        def __init__(self, make):
            self.make = make

        def root_candidates(self):
            return [self.make(5, 0.5, "a", 0), self.make(6, 0.25, "b", 0), self.make(7, 0.0, "c", 0)]

        def child_candidates(self, token, state):
            return [self.make(token + 10, 0.5, "a", state + 1)] if state < 2 else []

    named = build_tree(1, [Source(Candidate)], max_nodes=8, max_depth=8)
    bare = build_tree(1, [Source(lambda *fields: tuple(fields))], max_nodes=8, max_depth=8)
    assert named == bare
    # 5 (0.5); 6 and 15 (0.25, ties in push order); 16 and 25 (0.125); 26 (0.0625); 7 (probability 0) never
    assert named.tokens.tolist() == [1, 5, 6, 15, 16, 25, 26] and named.parents.tolist() == [-1, 0, 0, 1, 2, 3, 4]
    assert named.scores.tolist() == [1.0, 0.5, 0.25, 0.25, 0.125, 0.125, 0.0625]
    assert tuple(named.origins[1:4]) == ((0, "a"), (0, "b"), (0, "a"))
    assert Candidate(5, 0.5, "a", 0) == (5, 0.5, "a", 0) and Candidate(5, 0.5, "a", 0).probability == 0.5


def test_token_recycling_learns_successors_from_verify_steps():
    session = TokenRecycling(top_k=2).start([1, 2], _verified(torch.tensor([[2, 3], [4, 5]])))
    candidates = [Candidate(*c) for c in session.candidates([1, 2]).root_candidates()]  # bare tuples: hot path
    # the prefill's top-2 after 2 (4, 5), once by token and once by the pair (1, 2)
    assert [(c.token, c.key, c.state) for c in candidates] == [(4, ("tok", 0), 2), (5, ("tok", 1), 2),
                                                               (4, ("ctx", 0), 2), (5, ("ctx", 1), 2)]  # fmt: skip
    assert [c.probability for c in candidates] == [session.stats.rate(c.key) for c in candidates]
    tree = build_tree(2, [session.candidates([1, 2])], max_nodes=3, max_depth=1)
    assert tree.tokens.tolist() == [2, 4, 5] and tree.origins[1] == (0, ("ctx", 0))  # the pair's rank 0 is likelier
    session.observe(tree, _verified(torch.tensor([[8, 9]] * len(tree))), [0], [1, 2])
    again = build_tree(2, [session.candidates([1, 2])], max_nodes=3, max_depth=1)
    assert again.tokens.tolist() == [2, 8, 9]


def test_token_recycling_reads_as_many_target_candidates_as_its_top_k():
    assert TokenRecycling().target_topk == 8 and TokenRecycling(top_k=64).target_topk == 64
    assert Combined(PromptLookup(), TokenRecycling(top_k=32)).target_topk == 32  # the loop hands everyone 32
    for bad in (0, 1.5, True):
        with pytest.raises(InvalidParameterError, match="TokenRecycling.top_k must be an int"):
            TokenRecycling(top_k=bad)
    ranks = torch.arange(100, 120).repeat(2, 1)  # [2, 20]: more columns than the drafter reads
    drafter = TokenRecycling(top_k=16)
    session = drafter.start([1, 2], _verified(ranks), drafter.new_memory())
    assert session.table.by_token[2].tolist() == list(range(100, 116))  # ranks 0..15, not capped at 8
    tree = build_tree(2, [session.candidates([1, 2])], max_nodes=64, max_depth=1)
    assert set(tree.tokens[1:]) == set(range(100, 116))
    session.observe(tree, _verified(torch.arange(200, 220).repeat(len(tree), 1)), [0], [1, 2])
    assert session.table.by_token[100].tolist() == list(range(200, 216))


def test_cost_curve_picks_the_size_with_most_tokens_per_second():
    curve = CostCurve((1, 2, 4, 8), (1.0, 1.1, 1.3, 2.6))
    assert abs(curve.latency(3) - 1.2) < 1e-12 and abs(curve.latency(16) - 5.2) < 1e-12  # past 8: extrapolated
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
    """On an injected clock that each forward advances by its delay (powers of two: exact sums): a
    15.6 ms step is timed the five repeats asked for (78 ms > 62.5 ms); a 0.49 ms step until 62.5 ms of
    samples have been taken (128 of them)."""
    now = [0.0]
    calls = {}

    def forward(delay):
        def run(tokens, layout):
            assert layout.size == len(tokens) and layout.kv_len == 256  # a chain after 256 - T cached slots
            assert torch.equal(layout.ancestors[0], torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril())
            calls[delay, len(tokens)] = calls.get((delay, len(tokens)), 0) + 1
            now[0] += delay

        return run

    def clock():
        return now[0]

    slow, fast, enough = 2.0**-6, 2.0**-11, 2.0**-4
    curve = measure(forward(slow), torch.device("cpu"), (1, 4), repeats=5, min_seconds=enough, clock=clock)
    assert calls[slow, 1] == calls[slow, 4] == 1 + 5 and curve.seconds == (slow, slow)  # warm-up + repeats
    curve = measure(forward(fast), torch.device("cpu"), (1, 4), repeats=5, min_seconds=enough, clock=clock)
    assert calls[fast, 1] == calls[fast, 4] == 1 + 128 and curve.seconds == (fast, fast)  # until 62.5 ms of samples


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


def test_successor_table_keeps_the_latest_row_per_token_and_pair_in_bounded_slots():
    table = TokenRecycling(top_k=2, max_pairs=1000).new_memory()

    def write(previous, token, successors):
        table.write(np.array([previous]), np.array([token]), np.array([successors]))

    write(1, 2, [3, 7])
    write(2, 3, [4, 8])
    write(1, 2, [5, 9])  # rewritten: the later row wins
    write(3, 4, [6, -1])
    assert table.after_token(np.array([2, 3, 4, 5])).tolist() == [[5, 9], [4, 8], [6, -1], [-1, -1]]
    assert table.after_pair(np.array([1, 2, 9]), np.array([2, 3, 2])).tolist() == [[5, 9], [4, 8], [-1, -1]]
    assert table.pair_keys.shape == (1024,) and len(table) == 3  # slots: max_pairs to a power of two
    table = TokenRecycling(top_k=2, max_pairs=4).new_memory()
    for previous in range(100):  # many pairs into 4 slots: each lookup is the pair's own row or nothing
        write(previous, 50, [previous, previous + 1])
    hits = table.after_pair(np.arange(100), np.full(100, 50))
    assert all(row in ([p, p + 1], [-1, -1]) for p, row in enumerate(hits.tolist())) and (hits[:, 0] >= 0).sum() <= 4
    table.write(np.array([-1]), np.array([5000]), np.array([[1, 2]]))  # ids past the table's rows grow it
    assert table.after_token(np.array([5000])).tolist() == [[1, 2]]


def test_combined_drafter_memory_is_one_per_member():
    drafter = Combined(PromptLookup(), TokenRecycling())
    memory = drafter.new_memory()
    assert memory[0] is None and len(memory[1]) == 0
    sessions = drafter.sessions([1, 2, 1], _verified(torch.tensor([[2, 0], [1, 0], [2, 0]])), memory)
    assert sessions[1].table is memory[1] and len(memory[1]) == 2
