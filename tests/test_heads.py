"""Draft heads: the DraftHeads pass, the trainer, save/load, trees from heads, lossless decoding with heads."""

import heapq
import itertools
import json
import math
import pathlib

import pytest
import torch
from conftest import peaked_tiny_model, tiny_model

import specpass
import specpass.heads
from specpass.drafters import Candidate, Combined, Heads, PromptLookup, TokenRecycling, draft_row
from specpass.drafters.heads import HeadsSession
from specpass.heads import HeadsMismatchError, load_heads, save_heads
from specpass.heads.io import read_config, shipped_heads
from specpass.heads.modules import HeadsStep, draft_vocabulary
from specpass.research.heads_training import Continuation, TrainConfig, _DraftVocabulary, generate_corpus, train_heads
from specpass.ir import capture, info, verify
from specpass.rewrites import DraftHeads, TreeAttention


def _corpus(model, count=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 96, (1, 6), generator=gen) for _ in range(count)]
    return generate_corpus(model, prompts, max_new_tokens=24, progress=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Tiny llama with Medusa heads (whole vocabulary: the default 8192 exceeds its 96 tokens) and Hydra
    heads (draft vocabulary of 48 tokens) trained on its own greedy continuations."""
    model = peaked_tiny_model()
    corpus, held_out = _corpus(model), _corpus(model, count=4, seed=1)
    out = {}
    for kind, draft_vocab in (("medusa", 8192), ("hydra", 48)):
        directory = str(tmp_path_factory.mktemp(kind))
        config = TrainConfig(design=kind, num_heads=3, prompts=len(corpus), epochs=6, batch_size=16, lr=3e-3,
                             held_out=4, draft_vocab=draft_vocab)  # fmt: skip
        heads, heads_config, losses = train_heads(model, corpus, held_out, config, out_dir=directory, progress=False)
        out[kind] = directory, heads, heads_config, losses
    return model, out, corpus


def test_trainer_lowers_the_loss_and_measures_accuracy(trained):
    _, out, _ = trained
    for kind, (_, _, config, losses) in out.items():
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert last < 0.9 * first, f"{kind}: loss {first:.3f} -> {last:.3f}"
        assert len(config.accuracy) == 3 and all(len(row) == 8 for row in config.accuracy)
        assert all(0.0 <= sum(row) <= 1.0 for row in config.accuracy)
    # Held-out accuracy is not asserted here: a random tiny model's next tokens are a random function
    # that heads can only memorise; the shipped heads' accuracy is measured on the real model.


def test_training_is_deterministic():
    model = tiny_model("llama")
    corpus, held_out = _corpus(model, count=8), _corpus(model, count=2, seed=1)
    config = TrainConfig(num_heads=2, prompts=8, epochs=1, batch_size=16, held_out=2)
    _, _, a = train_heads(model, corpus, held_out, config, progress=False)
    _, _, b = train_heads(model, corpus, held_out, config, progress=False)
    assert a == b


def test_save_load_round_trip_and_wrong_model(trained, tmp_path):
    model, out, _ = trained
    directory, heads, config, _ = out["hydra"]
    loaded, loaded_config = load_heads(directory, model.lm_head)
    assert loaded_config == config
    assert loaded_config.draft_vocab == 48 and torch.equal(loaded.draft_vocab, heads.draft_vocab)  # ids exact
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(b, a.half().float() if a.is_floating_point() else a, msg=name)  # float16
    save_heads(heads, config, str(tmp_path / "fp32"), dtype=torch.float32)
    exact, _ = load_heads(str(tmp_path / "fp32"), model.lm_head)
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), exact.state_dict().values()))
    other = tiny_model("llama", seed=1)
    with pytest.raises(HeadsMismatchError, match="trained for model 96x32-"):
        load_heads(directory, other.lm_head)


@torch.no_grad()
def test_the_heads_graph_padded_to_its_bucket_equals_the_call(trained):
    """What a GPU replays (backends.lowering.draft_buckets): the lowered heads graph on rows padded to
    their bucket (5 rows to 8), its outputs cut back, equals the plain call."""
    from specpass.backends.lowering.draft_buckets import call_in_buckets

    model, out, _ = trained
    pipeline = specpass.Pipeline(TreeAttention(16), DraftHeads("hydra", out["hydra"][0]))
    draft = specpass.compile_program(model, {"pipeline": pipeline, "cache_size": 64}).draft
    gen = torch.Generator().manual_seed(0)
    inputs = dict(hidden=torch.randn(5, model.config.hidden_size, generator=gen),
                  tokens=torch.randint(3, 96, (5, 3), generator=gen), head=torch.tensor([0, 1, 2, 1, 0]))  # fmt: skip
    plain = draft(**inputs)
    padded = call_in_buckets(draft.spec, inputs, lambda bucket, padded_inputs: draft.run(padded_inputs))
    assert [tuple(a.shape) for a in padded] == [tuple(b.shape) for b in plain]
    for a, b in zip(padded, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_pass_adds_a_draft_graph_and_leaves_the_verify_graph_bit_exact(trained):
    model, out, _ = trained
    directory = out["medusa"][0]
    base, _ = specpass.Pipeline(TreeAttention(16)).run(capture(model, cache_size=64))
    with_heads, report = specpass.Pipeline(TreeAttention(16), DraftHeads("medusa", directory)).run(
        capture(model, cache_size=64)
    )
    assert "added a draft graph: 3 medusa heads" in str(report)
    assert with_heads.graph.python_code("self").src == base.graph.python_code("self").src
    draft = with_heads.draft
    assert draft.vocab_head is model.lm_head and draft.embed_tokens is model.model.embed_tokens  # shared, not copied
    roles = {info(n).role.value for n in draft.graph.nodes}
    assert {"draft", "lm_head", "input", "output"} <= roles and "embed" not in roles  # Medusa embeds no token
    verify(with_heads)
    inputs = dict(input_ids=torch.randint(0, 96, (1, 5)), positions=torch.arange(5)[None], kv_len=5,
                  tree_mask=torch.ones(5, 5, dtype=torch.bool).tril()[None], cache_slots=torch.arange(5)[None])  # fmt: skip
    expected = [o.clone() for o in base(**inputs)]
    got = with_heads(**inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))  # bit for bit


def test_pass_refusals_leave_the_graph_unchanged(trained):
    model, out, _ = trained
    gm, _ = specpass.Pipeline(TreeAttention(16), DraftHeads("medusa", out["medusa"][0])).run(capture(model, 64))
    assert "already has a draft graph" in DraftHeads("medusa", out["medusa"][0]).check(gm)
    assert "are hydra heads" in DraftHeads("medusa", out["hydra"][0]).check(capture(model, 64))
    other = capture(tiny_model("llama", seed=1), 64)
    before = other.graph.python_code("self").src
    with pytest.raises(specpass.PassMismatchError, match="trained for model"):
        specpass.Pipeline(DraftHeads("medusa", out["medusa"][0])).run(other)
    assert other.graph.python_code("self").src == before and not hasattr(other, "draft")
    with pytest.raises(specpass.InvalidParameterError, match="design must be one of"):
        DraftHeads("eagle")


def test_the_heads_old_names_still_work_for_one_release(trained, tmp_path):
    """`DraftHeads(kind=...)` (warned), a pipeline JSON naming `kind`, and a heads.json written with
    "kind" all mean `design`; `heads.DraftStep` (warned) is `heads.HeadsStep`."""
    _, out, _ = trained
    with pytest.warns(DeprecationWarning, match="HeadsStep"):
        assert specpass.heads.DraftStep is HeadsStep
    with pytest.raises(AttributeError):
        specpass.heads.NoSuchStep
    with pytest.warns(DeprecationWarning, match=r"DraftHeads\(design=...\)"):
        old = DraftHeads(kind="hydra", heads=out["hydra"][0])
    assert old == DraftHeads(design="hydra", heads=out["hydra"][0]) and old.design == "hydra"
    with pytest.warns(DeprecationWarning):
        parsed = specpass.Pipeline.from_dict({"passes": [{"pass": "DraftHeads", "params": {"kind": "hydra"}}]})
    assert parsed.passes[0].design == "hydra" and '"design": "hydra"' in parsed.to_json() and "kind" not in parsed.to_json()
    written = json.loads((pathlib.Path(out["hydra"][0]) / "heads.json").read_text())
    written["kind"] = written.pop("design")  # as 0.1 wrote it
    (tmp_path / "heads.json").write_text(json.dumps(written))
    assert read_config(str(tmp_path)).design == "hydra"


def test_hydra_path_drafted_level_by_level_equals_step_by_step(trained):
    model, out, _ = trained
    _, heads, config, _ = out["hydra"]
    step = HeadsStep(heads, model.lm_head, model.model.embed_tokens).eval()

    hidden = torch.randn(32)
    session = HeadsSession(Heads(top_k=3, beam=2), _StepDraft(step, config), hidden, root=7)
    HeadsSession.draft_rows([session])
    table = session.table
    for path, candidates in table.items():  # every expanded path: one row, head len(path) - 1, alone
        tokens = torch.zeros(1, 3, dtype=torch.long)
        tokens[0, : len(path)] = torch.tensor(path)
        with torch.no_grad():
            logits, vocab = step(hidden[None], tokens, torch.tensor([len(path) - 1]))
            manual = heads.blocks[len(path) - 1](
                torch.cat((hidden[None], model.model.embed_tokens(tokens[:, : len(path)]).flatten(1)), dim=-1)
            )
            by_hand = model.lm_head(hidden[None] + torch.nn.functional.silu(manual))  # [1, V]
        torch.testing.assert_close(logits, by_hand[:, vocab])  # the draft vocabulary's rows of the LM head
        assert [c[0] for c in candidates] == vocab[logits.topk(3).indices[0]].tolist()
    assert max(len(p) for p in table) == 3  # root + two drafted tokens: heads 1, 2, 3 all ran


class _StepDraft:
    """A heads draft graph as the decode loop hands it to the drafter (eager)."""

    def __init__(self, step, config):
        self.step, self.config = step, config

    def __call__(self, hidden, tokens, head):
        with torch.no_grad():
            return self.step(hidden, tokens, head)


@pytest.mark.parametrize("design", ["medusa", "hydra"])
@pytest.mark.parametrize("temperature", [None, 0.8])
def test_rows_drafted_at_once_propose_what_each_row_proposes_alone(trained, design, temperature):
    """HeadsSession.draft_rows: a batch's rows share each draft call, and every row's table (tokens,
    their draws from its own seeded stream) is the one it drafts alone; the call count shows the sharing."""
    model, out, _ = trained
    _, heads, config, _ = out[design]
    step = HeadsStep(heads, model.lm_head, model.model.embed_tokens).eval()
    drafter = Heads(tree="static" if temperature else "dynamic", top_k=3, beam=2, temperature=temperature)
    hidden, roots, seeds = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)), [7, 11, 7], [0, 5, 9]

    def sessions(draft):
        return [HeadsSession(drafter, draft, h, root=r, seed=s) for h, r, s in zip(hidden, roots, seeds)]

    class _Counting(_StepDraft):
        calls = 0

        def __call__(self, hidden, tokens, head):
            type(self).calls += 1
            return super().__call__(hidden, tokens, head)

    together = sessions(_Counting(step, config))
    for steps in (1, 2):  # the second step's draws continue each row's stream
        HeadsSession.draft_rows(together)
        tables = [s.table for s in together]
        assert _Counting.calls == (1 if design == "medusa" else 3) * steps  # Hydra: one call per head
        for alone, table in zip(sessions(_StepDraft(step, config)), tables):
            for _ in range(steps):
                HeadsSession.draft_rows([alone])
            assert alone.table.keys() == table.keys()
            for key, candidates in table.items():
                assert [c[0] for c in alone.table[key]] == [c[0] for c in candidates]
                assert [c[2][:2] for c in alone.table[key]] == [c[2][:2] for c in candidates]  # (depth, rank)
                for mine, theirs in zip(alone.table[key], candidates):
                    assert mine[2][2] == pytest.approx(theirs[2][2], rel=1e-5, abs=1e-7)  # draft probability
                    assert (mine[3] is None) == (theirs[3] is None) == (temperature is None)
    assert len({tuple(c[0] for v in t.values() for c in v) for t in tables}) > 1  # each row drafts from its own state


def test_draft_vocabulary_is_the_most_frequent_training_tokens(trained):
    model, out, corpus = trained
    _, heads, config, _ = out["hydra"]
    counts = torch.bincount(torch.cat([seq.tokens for seq in corpus]), minlength=96)  # the training corpus
    chosen = heads.draft_vocab
    assert config.draft_vocab == len(chosen) == len(set(chosen.tolist())) == 48
    assert counts[chosen].min() >= counts[[t for t in range(96) if t not in chosen.tolist()]].max()
    assert draft_vocabulary([torch.tensor([5, 3, 3, 9, 9, 1])], 12, 4).tolist() == [3, 9, 1, 5]  # ties: id order
    step = HeadsStep(heads, model.lm_head, model.model.embed_tokens)
    assert torch.equal(step.vocab_head.weight, model.lm_head.weight[chosen])
    assert not hasattr(out["medusa"][1], "draft_vocab") and out["medusa"][2].draft_vocab == 0  # 8192 >= 96 tokens
    with pytest.raises(specpass.InvalidParameterError, match="draft_vocab"):
        TrainConfig(draft_vocab=-1)
    with pytest.raises(specpass.InvalidParameterError, match="held-out"):
        train_heads(model, corpus, [], TrainConfig(held_out=4), progress=False)


def test_training_targets_are_the_teachers_law_on_the_draft_vocabulary():
    weight = torch.randn(10, 4)  # [V, H]
    outputs = _DraftVocabulary(weight, torch.tensor([7, 2, 5]))  # the heads' rows: tokens 7, 2, 5
    assert torch.equal(outputs.weight, weight[[7, 2, 5]])
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0]])  # the teacher's sparse law [2, TOP]
    ids = torch.tensor([[2, 9, 5], [1, 3, 0]])  # position 2 has no mass on the draft vocabulary
    law, rows = outputs.law(probs, ids)
    assert torch.allclose(law[0], torch.tensor([5 / 7, 0.0, 2 / 7])) and rows[0, [0, 2]].tolist() == [1, 2]
    assert law[1].sum() == 0  # no target, so no loss, rather than a law on tokens it cannot propose
    assert outputs.tokens(torch.tensor([2, 0])).tolist() == [5, 7]
    whole = _DraftVocabulary(weight, None)
    assert whole.weight is weight and whole.law(probs, ids)[1] is ids


def test_training_prompts_are_apart_from_every_evaluation_prompt():
    from specpass.research.prompts import CHAT_MODULES, chat_texts, human_eval_problems
    from specpass.research.training_prompts import HELD_OUT_MODULES, documented_functions, training_modules

    modules = training_modules()
    assert not set(modules) & set(CHAT_MODULES)
    assert not set(HELD_OUT_MODULES) & (set(modules) | set(CHAT_MODULES))
    found = documented_functions(modules)
    held_out = documented_functions(HELD_OUT_MODULES)
    assert len(held_out) >= 32 and not {doc for *_, doc in held_out} & {doc for *_, doc in found}
    assert {module for module, *_ in found} <= set(modules)
    packages = [module.split(".")[0] for module, *_ in found]
    assert packages.count("networkx") > 1000 and packages.count("sympy") > 4000
    assert len(packages) - packages.count("networkx") - packages.count("sympy") > 1000  # the standard library
    assert "sympy" not in packages[: TrainConfig().prompts]  # the CPU recipe's prompts come before sympy's
    assert not [module for module in modules if ".tests" in module or "drawing" in module or module == "sympy.this"]
    training_text = "\n".join(doc for *_, doc in found)
    problems = human_eval_problems()
    evaluation = chat_texts(len(CHAT_MODULES)) + [p["prompt"] for p in problems]
    paragraphs = [p.strip() for text in evaluation for p in text.split("\n\n") if len(p.split()) > 8]
    assert len(paragraphs) > 200
    assert not [p for p in paragraphs if p in training_text]  # no evaluation paragraph is trained on
    evaluated_defs = {line.strip() for p in problems for line in p["prompt"].splitlines() if line.startswith("def ")}
    trained_defs = {f"def {name.split('.')[-1]}{signature}:" for _, name, signature, _ in found}
    assert len(evaluated_defs) >= 164 and not evaluated_defs & trained_defs  # no HumanEval function is trained on


def test_training_prompts_give_every_function_both_formats_and_keep_their_prefix(default_model):
    from specpass.research.training_prompts import documented_functions, training_modules, training_prompts

    _, tokenizer = default_model
    functions = documented_functions(training_modules())
    prompts = training_prompts(tokenizer)
    assert len(prompts) == 2 * len(functions)
    assert all(torch.equal(a, b) for a, b in zip(training_prompts(tokenizer, 40), prompts[:40]))
    chat_start = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)[:12]
    for i in (0, 1, 2, 3, len(functions) - 1):
        formats = [tokenizer.decode(p[0]).startswith(chat_start) for p in (prompts[i], prompts[len(functions) + i])]
        assert formats == [i % 2 == 1, i % 2 == 0]  # first pass alternates, second pass the other format
        name = functions[i][1].split(".")[-1]
        assert all(name in tokenizer.decode(p[0]) or functions[i][3][:40] in tokenizer.decode(p[0])
                   for p in (prompts[i], prompts[len(functions) + i]))  # fmt: skip


def test_training_prompts_are_the_same_in_every_process():
    """A default value's repr may hold a memory address (`<object object at 0x7f...>`), which would
    make the recipe's prompts differ from run to run; signatures keep the repr without it."""
    from specpass.research.training_prompts import documented_functions, training_modules

    signatures = [signature for _, _, signature, _ in documented_functions(training_modules())]
    assert any("<object object>" in s for s in signatures)  # there were addresses to strip
    assert not [s for s in signatures if " at 0x" in s]


def test_corpus_states_are_the_models_own_final_normed_states():
    """generate_corpus catches the states of its own forwards (left-padded batches, prefill then one
    token per step); they equal one forward over the finished sequence, so the teacher's law does too."""
    from specpass.research.heads_training import teacher

    model = peaked_tiny_model()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (1, 3 + i % 7), generator=gen) for i in range(10)]
    corpus = generate_corpus(model, prompts, max_new_tokens=12, batch_size=4, progress=False)
    for prompt, seq in zip(prompts, corpus):
        assert torch.equal(seq.tokens[: prompt.shape[1]], prompt[0]) and seq.start == prompt.shape[1] - 1
        with torch.no_grad():
            states = model.model(seq.tokens[None]).last_hidden_state[0]  # [L, H]
        assert seq.hidden.shape == (len(seq.tokens) - 1, states.shape[-1])
        torch.testing.assert_close(seq.hidden, states[:-1], atol=1e-4, rtol=1e-4)
    caught, recomputed = teacher(model, corpus), teacher(model, [Continuation(c.tokens, c.start) for c in corpus])
    ends = torch.tensor(caught.offsets[1:] + [len(caught.tokens)]) - 1  # each sequence's last position
    keep = torch.ones(len(caught.tokens), dtype=torch.bool)
    keep[ends] = False  # generation never computes the last token's state (no position reads it)
    assert torch.equal(caught.ids[keep, 0], recomputed.ids[keep, 0])
    assert not caught.hidden[ends].any()


def test_verifier_rejects_a_draft_graph_that_does_not_read_the_lm_head(trained):
    import copy

    model, out, _ = trained
    for kind, tamper in (("medusa", "copy"), ("hydra", "rows")):
        heads_pass = DraftHeads(kind, out[kind][0])
        gm, _ = specpass.Pipeline(TreeAttention(16), heads_pass).run(capture(model, 64))
        verify(gm)
        heads_pass.verify(gm)  # the heads' own invariants live with the pass that added them
        if tamper == "copy":  # whole vocabulary: the LM head must be shared, not copied
            gm.draft.vocab_head = copy.deepcopy(gm.draft.vocab_head)
            match = "not a copy"
        else:  # draft vocabulary: its rows must be the LM head's rows of that vocabulary
            with torch.no_grad():
                gm.draft.vocab_head.weight[3] += 1e-3
            match = "rows of its draft vocabulary"
        with pytest.raises(specpass.GraphVerificationError, match=match):
            heads_pass.verify(gm)


def expected_length(paths, accuracy) -> float:
    """Expected number of drafted tokens accepted (the bonus token not counted) of a tree of rank paths.

    A node is a rank path (r1, ..., rd): head 1's rank-r1 token, under it head 2's rank-r2 token, and so
    on. With head d's rank-r candidate right with probability accuracy[d-1][r] (given the heads before
    it were right), a node is accepted with the product of the accuracies on its path.
    """
    return sum(math.prod(accuracy[d][r] for d, r in enumerate(path)) for path in paths)


def optimal_static_tree(accuracy, budget: int) -> list[tuple[int, ...]]:
    """The `budget` rank paths, closed under prefixes, of largest expected accepted length (Medusa's
    "medusa choices", chosen rather than hand-written): the oracle of the static Heads tree.

    Best-first is optimal: a node's value is at most its parent's (accuracies are <= 1), so the best
    frontier node is always worth at least any node below it, and taking it first loses nothing.
    """
    chosen: list[tuple[int, ...]] = []
    frontier = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(frontier)
    while frontier and len(chosen) < budget:
        neg_value, path = heapq.heappop(frontier)
        chosen.append(path)
        depth = len(path)
        if depth < len(accuracy):
            for r in range(len(accuracy[depth])):
                heapq.heappush(frontier, (neg_value * accuracy[depth][r], (*path, r)))
    return chosen


def test_static_tree_matches_a_brute_force_optimum():
    accuracy = ((0.6, 0.2, 0.1), (0.5, 0.15, 0.1), (0.4, 0.2, 0.05))
    nodes = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    for budget in range(1, 7):
        best = 0.0
        for subset in itertools.combinations(nodes, budget):
            chosen = set(subset)
            if all(p[:-1] in chosen or len(p) == 1 for p in subset):  # closed under prefixes
                best = max(best, expected_length(subset, accuracy))
        tree = optimal_static_tree(accuracy, budget)
        assert len(tree) == budget and abs(expected_length(tree, accuracy) - best) < 1e-12


class _RandomDraft:
    """A draft graph with random logits: the static tree's shape depends only on the rates per (depth, rank)."""

    def __init__(self, config):
        self.config = config
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, hidden, tokens, head):
        vocab = torch.arange(50)
        return torch.randn(len(head), len(vocab), generator=self.generator), vocab


def _rank_paths(tree) -> list[tuple[int, ...]]:
    """Each drafted node's rank path, from the heads' stats keys (depth, rank, probability)."""
    paths = [()]
    for i in range(1, len(tree)):
        paths.append((*paths[tree.parents[i]], tree.origins[i][1][1]))
    return paths[1:]


@pytest.mark.parametrize("kind, beam", [("medusa", 8), ("hydra", 8), ("hydra", 64)])
def test_static_heads_tree_is_the_optimal_static_tree(kind, beam):
    """Alone, the static Heads drafter's n-node tree is optimal_static_tree(rates, n - 1) over the
    session's running rates per (depth, rank), which start at the accuracies of heads.json: Medusa and
    a Hydra beam of at least n - 1 for every n up to 64 nodes. Hydra's default beam (8) drafts depth
    d + 1 only under the 8 best depth-d paths: larger trees whose optimum goes under another path
    (on the shipped Hydra heads: from 49 nodes on) are the best among the drafted paths instead."""
    config = read_config(shipped_heads(kind))
    session = HeadsSession(Heads(tree="static", beam=beam), _RandomDraft(config), torch.zeros(8), root=7)
    assert all(isinstance(c, Candidate) for c in session.candidates([7]).root_candidates())
    for outcomes in range(2):
        if outcomes:  # verify steps move the rates away from the priors: the tree follows them
            for depth, rank, accepted in ((0, 0, False), (0, 0, False), (0, 1, True), (1, 0, False), (2, 3, True)):
                session.stats.record((depth, rank, 0.5), accepted)
        rates = [[session.stats.rate((d, r)) for r in range(len(row))] for d, row in enumerate(config.accuracy)]
        assert (rates == [list(row) for row in config.accuracy]) == (outcomes == 0)
        drafted = set(_rank_paths(draft_row([session], [7], max_nodes=1 << 20, max_depth=64)))
        for n in range(2, 65):
            tree = draft_row([session], [7], max_nodes=n, max_depth=64)
            got, best = _rank_paths(tree), optimal_static_tree(rates, n - 1)
            assert len(got) == len(set(got)) == n - 1
            if set(best) <= drafted:
                assert set(got) == set(best), (n, sorted(set(got) ^ set(best)))
            else:  # only a narrow Hydra beam drafts too few paths
                assert kind == "hydra" and beam < n - 1
                assert expected_length(got, rates) < expected_length(best, rates)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_decoding_with_heads_equals_hf_greedy(trained, kind, tree):
    model, out, _ = trained
    pipeline = specpass.Pipeline(TreeAttention(16), DraftHeads(kind, out[kind][0]))
    for drafter in (Heads(tree=tree), Combined(Heads(tree=tree), PromptLookup(), TokenRecycling())):
        options = {"pipeline": pipeline, "drafter": drafter, "cache_size": 200}
        for seed in range(3):
            ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(100 + seed))
            result = specpass.generate(model, ids, max_new_tokens=30, options=options)
            assert torch.equal(result.sequences, model.generate(ids, max_new_tokens=30, do_sample=False))


def test_heads_drafter_needs_heads_in_the_pipeline():
    model = tiny_model("llama")
    with pytest.raises(specpass.InvalidParameterError, match="needs draft heads in the pipeline"):
        specpass.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, options={"drafter": Heads()})


def test_training_positions_cover_the_prompt_and_accuracy_positions_only_the_generated_text():
    from specpass.research.heads_training import _batch, _positions, teacher

    corpus = [Continuation(torch.arange(10), start=3), Continuation(torch.arange(20, 26), start=1)]
    assert _positions(corpus, [0, 10], 2, generated_only=True).tolist() == [3, 4, 5, 6, 11, 12]
    assert _positions(corpus, [0, 10], 2, generated_only=False).tolist() == [0, 1, 2, 3, 4, 5, 6, 10, 11, 12]
    data = teacher(peaked_tiny_model(), corpus)
    assert data.offsets == [0, 10] and data.hidden.shape == (16, 32)
    torch.testing.assert_close(data.probs.sum(-1), torch.ones(16))
    h, tokens, probs, ids = _batch(data, torch.tensor([11]), 2)  # sequence 2, t = 1
    assert tokens.tolist() == [[22, 23]] and torch.equal(h[0], data.hidden[11])
    assert torch.equal(ids[0], data.ids[12:14]) and torch.equal(probs[0], data.probs[12:14])


def test_export_with_heads_runs_losslessly_on_ort(trained, tmp_path):
    from specpass.backends.onnx.export import export

    model, out, _ = trained
    pipeline = specpass.Pipeline(TreeAttention(16), DraftHeads("hydra", out["hydra"][0]))
    result = export(model, pipeline, str(tmp_path), progress=False)
    draft = result.manifest["draft"]
    assert draft["file"] == "draft.onnx" and draft["check_max_abs_diff"] < 1e-4
    assert draft["spec"]["kind"] == "heads" and draft["spec"]["config"]["design"] == "hydra"
    program = specpass.load_onnx(str(tmp_path), drafter=Combined(Heads(), PromptLookup()), cache_size=200)
    assert program.draft.config == out["hydra"][2]
    for seed in range(3):
        ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(200 + seed))
        got = specpass.generate(program, ids, max_new_tokens=30)
        assert torch.equal(got.sequences, model.generate(ids, max_new_tokens=30, do_sample=False))
    with open(tmp_path / "draft.onnx", "r+b") as f:  # the draft graph cut short: one line naming it
        f.truncate(f.seek(0, 2) // 2)
    with pytest.raises(specpass.DamagedFileError, match=r"draft\.onnx.*export it again") as raised:
        specpass.load_onnx(str(tmp_path), drafter=Combined(Heads(), PromptLookup()), cache_size=200)
    assert len(str(raised.value).splitlines()) == 1


def test_cli_trains_heads_for_the_default_model(default_model, tmp_path, capsys):
    from specpass.cli import main

    out = tmp_path / "heads"
    argv = ["train-heads", "--kind", "hydra", "--out", str(out), "--heads", "2", "--prompts", "6",
            "--max-new-tokens", "8", "--held-out", "2", "--epochs", "1", "--corpus", str(tmp_path / "corpus.pt")]  # fmt: skip
    assert main(argv) == 0
    assert "wrote" in capsys.readouterr().out and (out / "heads.safetensors").exists()
    _, config = load_heads(str(out), default_model[0].lm_head)
    assert config.design == "hydra" and config.num_heads == 2 and len(config.accuracy) == 2
    assert main(argv) == 0  # the second run reads the cached corpus
    assert "corpus: 6 sequences from" in capsys.readouterr().out


def test_cli_generates_with_the_shipped_heads(capsys):
    from specpass.cli import main

    assert main(["generate", "--heads", "hydra", "--drafter", "heads-combined", "--max-new-tokens", "24",
                 "--prompt", "Write a Python function that reverses a string."]) == 0  # fmt: skip
    assert "identical to greedy: True" in capsys.readouterr().out
