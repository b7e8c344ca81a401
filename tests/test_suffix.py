"""Suffix drafting (drafters.suffix): the suffix trie against brute-force substring counts, eviction
against a rebuild, the longest match, and greedy equal to HF greedy on the default model, alone and in
the combined tree, across requests that repeat."""

import random

import pytest
import torch
from conftest import NEW_TOKENS, check_default_model_greedy

import specpass
from specpass.drafters import Combined, PromptLookup, Suffix, TokenRecycling
from specpass.drafters.suffix import SuffixTrie
from specpass.common.errors import InvalidParameterError


def _random_sequences(seed: int, count: int = 6, vocab: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def _occurrences(sequences: list[list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(s[i : i + n] == pattern for s in sequences for i in range(len(s) - n + 1))


def _brute_continuations(sequences: list[list[int]], pattern: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    n = len(pattern)
    for s in sequences:
        for i in range(len(s) - n):
            if s[i : i + n] == pattern:
                out[s[i + n]] = out.get(s[i + n], 0) + 1
    return out


def _dump(trie: SuffixTrie) -> dict:
    """The trie as {path: count}, for comparing two tries."""
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            out[(*path, token)] = child.count
            stack.append(((*path, token), child))
    return out


def _trie(sequences: list[list[int]], depth: int = 6, max_tokens: int = 1 << 20) -> SuffixTrie:
    trie = SuffixTrie(depth, max_tokens)
    for sequence in sequences:
        writer = trie.writer()
        for start in range(0, len(sequence), 3):  # written in pieces, as a generation commits tokens
            writer.extend(sequence[start : start + 3])
    return trie


@pytest.mark.parametrize("seed", range(4))
def test_the_trie_counts_every_substring_as_a_brute_force_search_does(seed):
    sequences = _random_sequences(seed)
    trie = _trie(sequences, depth=6)
    dump = _dump(trie)
    substrings = {tuple(s[i : i + n]) for s in sequences for n in range(1, 7) for i in range(len(s) - n + 1)}
    assert set(dump) == substrings  # exactly the substrings of up to `depth` tokens
    for path, count in dump.items():
        assert count == _occurrences(sequences, list(path))
    for path in [p for p in substrings if len(p) < 6]:
        assert trie.continuations(path) == _brute_continuations(sequences, list(path))


@pytest.mark.parametrize("seed", range(4))
def test_the_longest_match_is_the_longest_suffix_with_a_continuation(seed):
    sequences = _random_sequences(seed)
    trie = _trie(sequences, depth=8)
    rng = random.Random(seed)
    for _ in range(20):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        n, node = trie.match(tokens, max_match=5)
        expected = next((k for k in range(min(5, 7, len(tokens)), 0, -1)
                         if _brute_continuations(sequences, tokens[len(tokens) - k :])), 0)  # fmt: skip
        assert n == expected
        if n:
            assert {t: c.count for t, c in node.children.items()} == _brute_continuations(sequences, tokens[-n:])


def test_eviction_leaves_the_trie_of_the_newest_sequences():
    sequences = _random_sequences(7, count=10)
    limit = sum(map(len, sequences[-4:]))  # room for the last four sequences
    trie = _trie(sequences, depth=6, max_tokens=limit)
    kept = [w.sequence for w in trie.writers]
    assert kept == sequences[len(sequences) - len(kept) :] and trie.tokens == sum(map(len, kept)) <= limit
    assert _dump(trie) == _dump(_trie(kept, depth=6))


def test_a_live_sequence_evicted_by_a_larger_one_stops_storing_and_keeps_the_counts_right():
    trie = SuffixTrie(depth=4, max_tokens=10)
    first, second = trie.writer(), trie.writer()  # two batch rows decoding at once
    first.extend([1, 2, 3])
    second.extend([4, 5, 6, 7, 8, 9, 1, 2, 3])  # 12 tokens > 10: the oldest (still live) row goes
    first.extend([3, 3])
    assert first.evicted and first.sequence == [1, 2, 3, 3, 3]
    assert _dump(trie) == _dump(_trie([second.sequence], depth=4))


def test_invalid_parameters_are_refused():
    with pytest.raises(InvalidParameterError, match="Suffix.depth 8 must exceed max_match 8"):
        Suffix(max_match=8, depth=8)
    with pytest.raises(InvalidParameterError, match="max_tokens"):
        Suffix(max_tokens=0)


def test_suffix_drafting_on_the_default_model_equals_hf_greedy(default_model, cases):
    """Alone and in the combined tree: greedy equals HF's on a code and a chat case, with an EOS inside
    an accepted draft and the length limit. Asked again, a prompt drafts from the store of the first
    answer: the same tokens, in fewer target forwards."""
    model, _ = default_model
    for drafter in (Suffix(), Combined(PromptLookup(), TokenRecycling(), Suffix())):
        check_default_model_greedy(model, cases, {"drafter": drafter, "budget": 8}, min_tau=1.1)
    program = specpass.compile_program(model, {"drafter": Suffix(), "budget": 16})
    program.forget()  # the calls above stored their sequences: start from an empty store
    ids, reference = cases[3]
    first, again = (specpass.generate(program, ids, max_new_tokens=NEW_TOKENS) for _ in range(2))
    assert torch.equal(first.sequences, reference) and torch.equal(again.sequences, first.sequences)
    assert again.stats.tau > 2 * first.stats.tau, (first.stats, again.stats)
    program.forget()  # the store goes with Token Recycling's table
    assert specpass.generate(program, ids, max_new_tokens=NEW_TOKENS).stats.tau == first.stats.tau
