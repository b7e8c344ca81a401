"""CopySpec (drafters.copy_spec): its chain is the copy after the earliest earlier occurrence of the last
gamma tokens (against a brute-force search), grown step by step as rows advance and drop out; it drafts
every row at once, alone and with the other chain sources; greedy equals HF greedy."""

import numpy as np
import pytest
import torch
from conftest import repeating_rows_tau

from specpass.drafters import Combined, CopySpec, PromptLookup, TokenRecycling
from specpass.drafters.copy_spec import CopyChains


def _copy_by_brute_force(row: list[int], gamma: int, copy: int) -> list[int]:
    """The tokens after the first start s with row[s:s+gamma] == the last gamma tokens, s + gamma < len(row)."""
    n = len(row)
    for s in range(n - gamma):
        if n > gamma and row[s : s + gamma] == row[n - gamma :]:
            return row[s + gamma : s + gamma + copy]
    return []


@pytest.mark.parametrize("gamma, copy", [(3, 10), (1, 4), (2, 16)])
def test_the_chain_is_the_copy_after_the_first_occurrence(gamma, copy):
    gen = torch.Generator().manual_seed(gamma)
    rows = [torch.randint(0, 5, (n,), generator=gen).tolist() for n in (2, 9, 30, 17)]  # few tokens: many repeats
    source = CopyChains(CopySpec(gamma=gamma, copy=copy))
    found = 0
    for step in range(25):
        history = np.full((len(rows), max(map(len, rows)) + 3), -1, dtype=np.int64)  # -1 past each row
        for b, row in enumerate(rows):
            history[b, : len(row)] = row
        chains = source.chains(history, np.array([len(r) for r in rows]))
        assert chains.tokens.shape == (len(rows), 1, copy) and chains.divisors.shape == (len(rows), 1)
        for b, row in enumerate(rows):
            expected = _copy_by_brute_force(row, gamma, copy)
            got = [t for t in chains.tokens[b, 0].tolist() if t >= 0]
            assert got == expected, (step, b)
            found += bool(expected)
        assert chains.keys[0, 0].tolist() == [min(gamma + k, 10) for k in range(copy)]  # the match length extended
        for row in rows:  # each row grows by 1 to 3 tokens, as accepted paths do
            row += torch.randint(0, 5, (1 + step % 3,), generator=gen).tolist()
        if step == 12:  # row 1 finishes: the others go on as rows 0, 1, 2
            source.keep([0, 2, 3])
            rows = [rows[0], rows[2], rows[3]]
    assert found > 20


def test_a_row_with_no_repeat_drafts_nothing_and_the_suffix_never_matches_itself():
    source = CopyChains(CopySpec(gamma=3, copy=5))
    history = np.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 7, 8, 9]])
    chains = source.chains(history, np.array([6, 6]))
    assert chains.tokens[0, 0].tolist() == [-1] * 5  # "4 5 6" occurs only as the suffix
    assert chains.tokens[1, 0].tolist() == [7, 8, 9, -1, -1]  # after "7 8 9" at 0: the copy stops at the end


@pytest.mark.parametrize("drafter", [CopySpec(), Combined(CopySpec(), PromptLookup(), TokenRecycling())],
                         ids=["alone", "combined"])  # fmt: skip
def test_copy_spec_drafts_every_row_at_once_and_equals_hf_greedy(drafter):
    """Rows of different lengths, each with a repeated stretch to copy: drafted at once (also combined),
    every row equal to HF greedy alone, drafts accepted."""
    assert repeating_rows_tau(drafter, seed=11, heads=(10, 19, 7), tail=4, new_tokens=24) > 1.3
