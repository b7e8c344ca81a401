"""ADED (drafters.aded): the tri-gram table (from a corpus, by hand; the update), the search's paths on
tables whose answer is known, drafting every row at once, and greedy equal to HF greedy."""

import numpy as np
import pytest
from conftest import repeating_rows_tau

import specpass
from specpass.drafters import Aded, Combined, PromptLookup, TokenRecycling
from specpass.drafters.aded import AdedChains, TrigramTable, search


def test_the_corpus_table_is_each_pairs_likeliest_successors_by_count():
    corpus = [[1, 2, 3, 1, 2, 3, 1, 2, 4], [1, 2, 5, 7, 1, 2, 3]]
    table = TrigramTable.from_corpus(corpus, successors=2)
    # (1, 2) is followed by 3 three times, 4 once, 5 once: 3, then 4 (ties by token id), not renormalised
    assert table.successors_of(1, 2) == {3: 3 / 5, 4: 1 / 5}
    assert table.successors_of(2, 3) == {1: 1.0} and table.successors_of(9, 9) == {}
    by_hand = {}
    for seq in corpus:
        for a, b, c in zip(seq, seq[1:], seq[2:]):
            by_hand.setdefault((a, b), []).append(c)
    for pair, followers in by_hand.items():
        assert set(table.successors_of(*pair)) <= set(followers) and len(table.successors_of(*pair)) <= 2


def test_the_update_bumps_each_trigram_caps_it_and_replaces_the_lightest():
    table = TrigramTable(successors=2)
    table.bump([1, 2, 3, 1, 2, 3], amount=0.5, cap=0.8)  # (1,2)->3 twice: 0.5, then capped at 0.8
    assert table.successors_of(1, 2) == {3: 0.8} and table.successors_of(2, 3) == {1: 0.5}
    table.bump([1, 2, 4], amount=0.5, cap=0.8)
    assert table.successors_of(1, 2) == {3: 0.8, 4: 0.5}
    table.bump([1, 2, 5], amount=0.1, cap=0.8)  # full, and 0.1 outweighs nothing: dropped
    assert table.successors_of(1, 2) == {3: 0.8, 4: 0.5}
    table.rows[(1, 2)][4] = 0.05
    table.bump([1, 2, 5], amount=0.1, cap=0.8)  # now it outweighs 4
    assert table.successors_of(1, 2) == {3: 0.8, 5: 0.1}


def test_a_table_with_one_successor_per_pair_gives_its_chain_first():
    table = TrigramTable()
    table.rows = {(1, 2): {3: 1.0}, (2, 3): {4: 1.0}, (3, 4): {5: 1.0}, (4, 5): {6: 1.0}, (5, 6): {7: 1.0}}
    paths = search(table, 1, 2, Aded(iterations=20, depth=4), np.random.default_rng(0))
    assert paths == [[3, 4], [3, 4, 5], [3, 4, 5, 6], [3, 4, 5, 6, 7]]  # by visits: every round passes the
    # shallower nodes; each path extended by its heaviest successor; four levels searched


def test_the_search_follows_the_heavier_branch_and_ranks_paths_by_visits():
    """Two branches under the root: 3 (weight 0.9) leading on, 8 (0.1) a dead end. The heavy branch
    gets more visits, so its paths come first; every path is a walk through the table."""
    table = TrigramTable()
    table.rows = {(1, 2): {3: 0.9, 8: 0.1}, (2, 3): {4: 0.7, 9: 0.3}, (3, 4): {5: 1.0}, (4, 5): {6: 1.0}}
    config = Aded(iterations=150, depth=4, paths=24)
    paths = search(table, 1, 2, config, np.random.default_rng(1))
    assert paths[0][0] == 3 and [3, 4, 5, 6] in [p[:4] for p in paths]
    assert len(paths) == len({tuple(p) for p in paths}) <= config.paths
    for path in paths:
        walk = [1, 2, *path]
        assert all(c in table.successors_of(a, b) for a, b, c in zip(walk, walk[1:], walk[2:]))
    assert search(table, 1, 2, config, np.random.default_rng(1)) == paths  # one seed, one search
    assert search(table, 7, 7, config, np.random.default_rng(1)) == []  # an unknown pair drafts nothing


def test_chains_rank_the_paths_and_the_prompt_seeds_the_table():
    source = AdedChains(Aded(iterations=40, depth=3, paths=4), TrigramTable())
    history = np.array([[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, -1, -1, -1, -1, -1]])
    chains = source.chains(history, np.array([8, 3]))
    assert chains.tokens.shape == (2, 4, 4) and chains.tokens[0, 0].tolist() == [7, 5, -1, -1]  # most visited
    assert [7, 5, 6, 7] in chains.tokens[0].tolist()  # the prompt's loop, three levels deep and extended
    assert (chains.tokens[1] == -1).all()  # (2, 3) was never followed
    assert chains.keys[0, 0].tolist() == [0, 1, 2, 3] and chains.divisors[0].tolist() == [1, 2, 3, 4]


def test_invalid_parameters_are_refused():
    for bad in ({"bump": 0.0}, {"cap": float("inf")}, {"window": 2}, {"iterations": 0}, {"corpus": {(1, 2): {3: 1}}}):
        with pytest.raises(specpass.InvalidParameterError, match="Aded"):
            Aded(**bad)


@pytest.mark.parametrize("drafter", [Aded(), Combined(Aded(), PromptLookup(), TokenRecycling())], ids=["alone", "combined"])
def test_aded_drafts_every_row_at_once_and_equals_hf_greedy(drafter):
    """Rows of different lengths that repeat themselves, 64 tokens (the table learns the model's own loops:
    tau 3.1 alone, 1.1 over the first 24): drafted at once, every row equal to HF greedy alone."""
    assert repeating_rows_tau(drafter, seed=12, heads=(9, 16, 6), tail=3, new_tokens=64) > 1.5
