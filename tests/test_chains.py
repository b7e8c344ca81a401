"""Drafting every row at once (drafters.chains, drafters.kernels) equals each row's own sessions
and the best-first builder; acceptance over rows equals accept_greedy; the rows' tree arrays."""

import pathlib

import numpy as np
import pytest
import torch

from specpass.backends.runtime.acceptance import accept_rows
from specpass.drafters import (
    Combined, DraftTree, PromptLookup, TargetForward, TokenRecycling, accept_greedy, draft_row, first_branches,
    observe_row,
)  # fmt: skip
from specpass.drafters.prompt_lookup import lookup_branches
from specpass.drafters.chains import ChainDrafting


def _prefill(prompt: list[int], vocab: int, gen: torch.Generator) -> TargetForward:
    n = len(prompt)
    return TargetForward(torch.randint(0, vocab, (n, 8), generator=gen), torch.zeros(n, 4), torch.zeros(n, dtype=torch.long))


def _reference_branches(tokens: list[int], config: PromptLookup) -> list[tuple[int, list[int]]]:
    """Prompt lookup's branches by the definition: longest match, then most recent occurrence; a
    continuation equal to or a prefix of an earlier one skipped."""
    found: list[tuple[int, list[int]]] = []
    last = len(tokens) - 1
    for n in range(config.max_ngram, config.min_ngram - 1, -1):
        if len(tokens) < n:
            continue
        for end in range(last - 1, n - 2, -1):
            if tokens[end + 1 - n : end + 1] != tokens[last + 1 - n :]:
                continue
            continuation = tokens[end + 1 : end + 1 + config.max_depth]
            if any(c[: len(continuation)] == continuation for _, c in found):
                continue
            found.append((n, continuation))
            if len(found) == config.max_branches:
                return found
    return found


def test_lookup_branches_follow_their_definition_over_rows():
    gen = np.random.default_rng(0)
    config = PromptLookup(max_ngram=3, min_ngram=1, max_depth=5, max_branches=4)
    rows = [gen.integers(0, vocab, size).tolist() for vocab, size in [(4, 40), (6, 25), (3, 9), (50, 30), (2, 1), (5, 3)]]
    history = np.full((len(rows), 48), -7, dtype=np.int64)  # junk past each row's end
    for b, row in enumerate(rows):
        history[b, : len(row)] = row
    branches, matched = lookup_branches(history, np.array([len(r) for r in rows]), config)
    for b, row in enumerate(rows):
        got = [(int(n), [t for t in branch if t >= 0]) for n, branch in zip(matched[b], branches[b].tolist()) if n > 0]
        assert got == _reference_branches(row, config)
    assert matched[0].min() > 0 and matched[4].max() == 0  # a long row fills every branch; one token has none


@pytest.mark.parametrize("drafters", ["combined", "lookup", "recycling"])
def test_rows_drafted_at_once_equal_each_rows_best_first_tree(drafters):
    """Random rows and a learned table: every row's tree (tokens, parents, scores, stats keys) is the one
    its own sessions and build_tree make, also after both learn from the same verify steps."""
    gen = torch.Generator().manual_seed(1)
    vocab = 7  # few tokens: many merges, repeated n-grams and score ties
    parts = {"combined": (PromptLookup(max_depth=6), TokenRecycling(top_k=3)), "lookup": (PromptLookup(max_depth=6),),
             "recycling": (TokenRecycling(top_k=3),)}[drafters]  # fmt: skip
    drafter = Combined(*parts)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (12, 5, 20, 2)]
    prefills = [_prefill(p, vocab, gen) for p in prompts]
    rows = drafter.rows(prompts, prefills, drafter.new_memory())
    assert isinstance(rows, ChainDrafting)
    shared = drafter.new_memory()  # the rows share one table, as the rows drafted at once do
    alone = [drafter.sessions(p, f, shared) for p, f in zip(prompts, prefills)]
    histories = [list(p) for p in prompts]
    k = 3 if drafters != "lookup" else 0
    for step in range(6):
        max_nodes, depths = (5, 12, 30)[step % 3], [6, 0, 3, 9]
        trees = rows.draft(histories, max_nodes, depths)
        expected_trees = [draft_row(row, history, max_nodes, depth) for row, history, depth in zip(alone, histories, depths)]
        for b, (row, expected) in enumerate(zip(alone, expected_trees)):
            got = trees.row(b)
            assert got.tokens.tolist() == expected.tokens.tolist() and got.parents.tolist() == expected.parents.tolist()
            assert np.allclose(got.scores, expected.scores, rtol=1e-12)
            keys = [_key(origin, k) for origin in expected.origins]
            assert trees.origins[b, : len(expected)].tolist() == keys
            assert not trees.ancestors[b, len(expected) :, : len(expected)].any()  # padding sees only itself
        # one verify step: random target top-k, the greedy path, then both learn from it
        topk = torch.randint(0, vocab, (len(prompts), trees.width, 8), generator=gen)
        paths = accept_rows(trees.tokens, trees.parents, trees.sizes, topk[..., 0].numpy())
        verified = TargetForward(topk, torch.zeros(len(prompts), trees.width, 4), topk[..., 0])
        rows.observe(trees, verified, paths, histories)
        for b, (row, history, tree) in enumerate(zip(alone, histories, expected_trees)):
            observe_row(row, tree, verified.row(b, len(tree)), paths[b], history)
            history += [tree.tokens[i] for i in paths[b][1:]] + [int(topk[b, paths[b][-1], 0])]
        if k:  # both tables learned the same rows
            assert np.array_equal(shared[-1].by_token, rows.table.by_token)
            assert np.array_equal(shared[-1].by_pair, rows.table.by_pair)


def _key(origin, k: int) -> int:
    """The array form's stats key of a per-row tree's origin (drafters.chains.ChainDrafting)."""
    if origin is None:
        return -1
    source, key = origin
    if isinstance(key, tuple):  # Token Recycling: (table, rank)
        return (0 if key[0] == "tok" else k) + key[1]
    return 2 * k + key  # prompt lookup: the match length


def test_drafters_with_a_rows_source_draft_rows_at_once_and_the_others_row_by_row():
    """Drafter.rows is the one path: members with rows sources (chains, at most one table) draft every
    row at once, in any combination; a member without one, or two tables, make the combination draft
    row by row."""
    from specpass.drafters import PerRowDrafting, Suffix

    prefill = _prefill([1, 2], 5, torch.Generator())
    at_once = (TokenRecycling(), PromptLookup(), Combined(PromptLookup(), TokenRecycling()),
               Combined(PromptLookup(max_ngram=2), PromptLookup(min_ngram=3, max_ngram=4), TokenRecycling()))  # fmt: skip
    for drafter in at_once:
        assert isinstance(drafter.rows([[1, 2]], [prefill], drafter.new_memory()), ChainDrafting), drafter
    for drafter in (Combined(PromptLookup(), Suffix()), Combined(TokenRecycling(), TokenRecycling(top_k=2)), Suffix()):
        assert isinstance(drafter.rows([[1, 2]], [prefill], drafter.new_memory()), PerRowDrafting), drafter


def test_acceptance_over_rows_equals_accept_greedy():
    gen = np.random.default_rng(3)
    trees = []
    for _ in range(40):
        n = int(gen.integers(1, 12))
        parents = [-1] + [int(gen.integers(0, i)) for i in range(1, n)]
        tokens, seen = [int(gen.integers(0, 3))], set()
        for i in range(1, n):  # siblings distinct, as the builders make them
            token = int(gen.integers(0, 3))
            while (parents[i], token) in seen:
                token += 1
            seen.add((parents[i], token))
            tokens.append(token)
        trees.append(DraftTree(tuple(tokens), tuple(parents), (1.0,) * n, (None,) * n))
    rows = DraftTree.stack(trees)
    choices = gen.integers(0, 4, rows.tokens.shape)
    paths = accept_rows(rows.tokens, rows.parents, rows.sizes, choices)
    assert paths == [accept_greedy(t, choices[b].tolist()) for b, t in enumerate(trees)]
    assert any(len(p) > 2 for p in paths)


def test_batch_tree_prefixes_and_first_branches():
    tree = DraftTree((5, 6, 7, 8, 9), (-1, 0, 0, 1, 3), (1.0, 0.5, 0.4, 0.3, 0.2), (None,) * 5)
    rows = DraftTree.stack([tree, DraftTree.chain([1, 2])])
    assert rows.width == 5 and rows.sizes.tolist() == [5, 2]
    assert rows.expected_tokens()[0].tolist() == pytest.approx([1.0, 1.5, 1.9, 2.2, 2.4])
    assert rows.expected_tokens()[1].tolist() == [1.0, 2.0, 2.0, 2.0, 2.0]  # flat past the row's size
    cut = rows.prefix(3)
    assert cut.row(0) == tree.prefix(3) and cut.sizes.tolist() == [3, 2] and cut.parents[1].tolist() == [-1, 0, -1]
    chains = first_branches(rows)
    assert chains.row(0).tokens.tolist() == [5, 6, 8, 9] and chains.row(0).is_chain() and chains.row(1).tokens.tolist() == [1, 2]
    assert chains.ancestors[0].tolist() == np.tril(np.ones((4, 4), dtype=bool)).tolist()
    assert chains.ancestors[1, 2:, :].tolist() == [[False, False, True, False], [False, False, False, True]]


def test_one_tree_type_for_a_row_and_a_batch():
    """A batch's row is the one-row tree it was stacked from (arrays without the row axis, its drawn
    laws and origins kept); the old batch name still works for one release, warned."""
    import specpass.drafters as drafters
    from specpass.drafters.tree import DraftLaw, Drawn

    law = DraftLaw(np.array([4, 9]), np.array([0.75, 0.25]))
    drawn = DraftTree((3, 4, 9), (-1, 0, 0), (1.0, 0.75, 0.25), (None, (0, "r0"), (0, "r1")),
                      (None, Drawn(law, 0, 0), Drawn(law, 1, 1)))  # fmt: skip
    plain = DraftTree.chain([7, 8])
    batch = DraftTree.stack([drawn, plain])
    assert len(batch) == 2 and batch.tokens.shape == (2, 3) and batch.ancestor_mask().shape == (2, 3, 3)
    assert batch.row(0) == drawn and batch.row(0) != drawn.prefix(2)
    assert batch.row(1).tokens.tolist() == [7, 8] and batch.row(1).drawn.tolist() == [None, None]
    assert batch.row(0).drawn[2].law is law and batch.origins[1].tolist() == [None, None, None]
    assert len(drawn) == 3 and drawn.ancestor_mask().tolist() == [[True, False, False], [True, True, False],
                                                                  [True, False, True]]  # fmt: skip
    with pytest.raises(ValueError, match="every parent must precede its child"):
        DraftTree((1, 2), (-1, 1))
    with pytest.warns(DeprecationWarning, match="DraftTree"):
        assert drafters.TreeRows is DraftTree
    with pytest.raises(AttributeError):
        drafters.NoSuchTree


def _documented_drafter() -> dict:
    """The example of docs/design.md ("Adding a drafter that drafts every row at once"), run as written."""
    text = (pathlib.Path(__file__).parents[1] / "docs" / "design.md").read_text()
    section = text[text.index("**Adding a drafter that drafts every row at once**") :]
    start = section.index("```python\n") + len("```python\n")
    code = section[start : section.index("\n```", start)]
    namespace: dict = {"__name__": "documented_drafter"}
    exec(compile(code, "docs/design.md", "exec"), namespace)  # noqa: S102 - the docs' own example
    return namespace


def test_the_documented_drafter_drafts_rows_at_once_alone_and_combined_and_is_lossless():
    """A drafter written as the docs show (a ChainSource, nothing else) drafts every row at once alone
    and beside prompt lookup and Token Recycling, row by row beside Suffix (its per-row session comes
    from its chains), and in each case equals HF greedy with its phrases accepted."""
    from conftest import FIXED_BUDGET, peaked_tiny_model

    import specpass
    from specpass.drafters import PerRowDrafting, Suffix

    phrase_book = _documented_drafter()["PhraseBook"]
    model = peaked_tiny_model()
    ids = torch.tensor([[5, 17, 33, 8, 21, 40, 9]])
    greedy = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    continuation = greedy[0, ids.shape[1] :].tolist()
    book = phrase_book(phrases=(tuple(continuation[3:9]), tuple(continuation[12:16])))
    prefill = _prefill(ids[0].tolist(), 96, torch.Generator())
    for drafter, form in ((book, ChainDrafting), (Combined(book, PromptLookup(), TokenRecycling()), ChainDrafting),
                          (Combined(book, Suffix()), PerRowDrafting)):  # fmt: skip
        assert isinstance(drafter.rows([ids[0].tolist()], [prefill], drafter.new_memory()), form), drafter
        program = specpass.compile_program(model, {"drafter": drafter, "budget": FIXED_BUDGET, "lowering": "eager"})
        out = specpass.generate(program, ids, max_new_tokens=24, eos_token_id=[])
        assert torch.equal(out.sequences, greedy), drafter
        assert out.stats.target_forwards < 24 - 4, (drafter, out.stats)  # the phrases were drafted and accepted
