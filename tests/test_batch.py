"""Batched speculative decoding (backends/runtime/decode.py, the one loop): rows of different lengths in one forward,
ragged acceptance, per-row commits, rows finishing at different steps; every row equals that
sequence decoded alone."""

import pytest
import torch

import specpass
from conftest import (
    FIXED_BUDGET, NEW_TOKENS, needs_cxx, padded, peaked_tiny_model, tiny_model, token_inside_an_accepted_draft,
    with_feature,
    with_heads,
)  # fmt: skip
from specpass.backends.runtime.decode import generate as decode
from specpass.backends.options import CompileOptions
from specpass.backends.runtime.program import SpeculativeProgram
from specpass.drafters import Combined, Feature, Heads, PromptLookup, TokenRecycling
from specpass.common.errors import InvalidParameterError
from specpass.ir import SlotLayout
from specpass.rewrites import EarlyExit, TreeAttention


def _options(drafter=None, pipeline=None, **extra) -> dict:
    options = {"drafter": drafter or Combined(PromptLookup(), TokenRecycling()), "budget": FIXED_BUDGET}
    if pipeline is not None:
        options["pipeline"] = pipeline
    return options | extra


DRAFTERS = {  # prompt lookup and Token Recycling run inside the combined drafter (one all-rows builder), Medusa's
    "combined": _options(),  # heads as Hydra's do (the Heads drafter)
    "hydra": with_heads("hydra", Heads()),
    "feature": with_feature(Feature()),
}


def _continuation(reference: torch.Tensor, prompt: torch.Tensor, limit: int, eos: set[int] = frozenset()) -> list[int]:
    """HF greedy's new tokens, cut at `limit` and after the first of `eos`."""
    tokens = reference[0, prompt.shape[1] :].tolist()[:limit]
    cut = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if cut is None else tokens[: cut + 1]


# ---- the real model (float32, CPU): every row equals HF greedy of that prompt alone ----


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_batch_rows_equal_greedy_alone(default_model, cases, name):
    """Four rows of different prompt lengths, 48 new tokens: one ends at EOS (after 46 tokens) while the
    others go on to the length limit; each equals HF greedy of its prompt alone."""
    model, _ = default_model
    ids, mask = padded([c[0] for c in cases])
    out = specpass.generate(model, ids, max_new_tokens=NEW_TOKENS, attention_mask=mask, options=DRAFTERS[name])
    assert isinstance(out, specpass.BatchGeneration)
    for b, (prompt, reference) in enumerate(cases):
        expected = _continuation(reference, prompt, NEW_TOKENS)
        assert list(out.new_tokens[b]) == expected
        assert out.stats[b].finish_reason == ("length" if len(expected) == NEW_TOKENS else "eos")
        width = ids.shape[1]
        assert out.sequences[b, width - prompt.shape[1] : width + len(expected)].tolist() == reference[0].tolist()[
            : prompt.shape[1] + len(expected)]  # fmt: skip
    assert [s.finish_reason for s in out.stats] == ["length", "eos", "length", "length"]
    assert sum(s.new_tokens for s in out.stats) / sum(s.target_forwards for s in out.stats) > 1.15  # drafts accepted


@pytest.mark.parametrize("rows", [8])
def test_batch_sizes_and_mixed_lengths(default_model, cases, rows):
    """B rows cycling through the four prompts (so prompts repeat), right-padded (B = 1, 2 and 4, left-padded,
    run in the tests above and below; B = 3 on the tiny model: tests/test_gate.py, tests/test_copy_spec.py)."""
    model, _ = default_model
    chosen = [cases[(b * 3) % len(cases)] for b in range(rows)]
    ids, mask = padded([c[0] for c in chosen], left=False)
    new_tokens = 32 if rows < 8 else 20
    out = specpass.generate(model, ids, max_new_tokens=new_tokens, attention_mask=mask, options=_options())
    for b, (prompt, reference) in enumerate(chosen):
        assert list(out.new_tokens[b]) == _continuation(reference, prompt, new_tokens)
    steps = [s.steps for s in out.stats]
    assert any(len({row[i] for row in steps if i < len(row)}) > 1 for i in range(min(map(len, steps))))  # ragged


def test_batch_of_one_and_specpass_alone(default_model, cases):
    """A batch of one padded row equals specpass's own unpadded run, which equals HF greedy."""
    model, _ = default_model
    prompt, reference = cases[1]
    alone = specpass.generate(model, prompt, max_new_tokens=40, options=_options())
    ids, mask = padded([prompt, cases[0][0]])
    padded_one = specpass.generate(model, ids[:1], max_new_tokens=40, attention_mask=mask[:1], options=_options())
    assert torch.equal(alone.sequences, reference[:, : prompt.shape[1] + 40])
    assert torch.equal(padded_one.sequences, alone.sequences)


def test_batch_eos_inside_an_accepted_draft_and_length_limit(default_model, cases):
    model, _ = default_model
    prompt, reference = cases[0]
    alone = specpass.generate(model, prompt, max_new_tokens=NEW_TOKENS, options=_options())
    eos_token, index = token_inside_an_accepted_draft(reference[0, prompt.shape[1] :].tolist(), alone.stats.steps)
    configured = model.generation_config.eos_token_id
    eos = {eos_token, *(configured if isinstance(configured, list) else [configured])}
    ids, mask = padded([c[0] for c in cases])
    out = specpass.generate(model, ids, max_new_tokens=NEW_TOKENS, attention_mask=mask, options=_options(),
                            eos_token_id=sorted(eos))  # fmt: skip
    for b, (p, r) in enumerate(cases):
        assert list(out.new_tokens[b]) == _continuation(r, p, NEW_TOKENS, eos)
    assert out.stats[0].finish_reason == "eos" and len(out.new_tokens[0]) == index + 1
    short = specpass.generate(model, ids, max_new_tokens=7, attention_mask=mask, options=_options())
    for b, (p, r) in enumerate(cases):
        assert list(short.new_tokens[b]) == _continuation(r, p, 7) and short.stats[b].finish_reason == "length"


def test_batch_with_the_cost_budget(default_model, cases):
    """budget="cost": one tree size per step for all rows, from the curve of forwards of all rows."""
    model, _ = default_model
    ids, mask = padded([c[0] for c in cases[:2]])
    options = {"pipeline": specpass.Pipeline(TreeAttention(16))}
    out = specpass.generate(model, ids, max_new_tokens=24, attention_mask=mask, options=options)
    for b, (p, r) in enumerate(cases[:2]):
        assert list(out.new_tokens[b]) == _continuation(r, p, 24)
    program = specpass.compile_program(model, options, rows=2)
    assert program.rows == 2 and program.cost_curve.sizes[-1] == 16


# ---- tiny models: the layout, the commit, rows independent of each other ----


def _program(model, rows: int, **options) -> SpeculativeProgram:
    return SpeculativeProgram(model, CompileOptions.from_mapping({"lowering": "eager", "budget": 4} | options), rows)


def test_rows_layout_inputs():
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root with two children
    layout = SlotLayout.of((SlotLayout.tree(5, tree), SlotLayout.chain(2, 1, evicted=0)))
    inputs = layout.step_inputs(torch.zeros(2, 3, dtype=torch.long))
    assert layout.size == 3 and inputs["kv_len"] == 8
    assert inputs["cache_slots"].tolist() == [[5, 6, 7], [2, 3, 4]]
    assert inputs["positions"].tolist() == [[5, 6, 6], [2, 3, 4]]
    assert torch.equal(inputs["tree_mask"][0], tree)
    assert torch.equal(inputs["tree_mask"][1], torch.eye(3, dtype=torch.bool))  # padding sees only itself
    rows, src, dst = layout.moves([[0, 2], [0]])
    assert (rows, src, dst) == ([0], [7], [6])


def test_rows_forward_equals_each_row_alone():
    """Rows with different prompt lengths and different trees in one forward give each row's logits
    of that row run alone (float32 rounding), and write only their own cache rows."""
    model = tiny_model("qwen2")
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 3)]
    trees = [torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool), torch.ones(2, 2, dtype=torch.bool).tril(),
             torch.ones(1, 1, dtype=torch.bool)]  # fmt: skip
    nodes = [torch.tensor([7, 8, 9]), torch.tensor([10, 11]), torch.tensor([12])]
    batch = _program(model, 3)
    prefill = SlotLayout.of(tuple(SlotLayout.chain(0, len(p)) for p in prompts))
    batch.forward(prefill.pad_tokens(prompts), prefill)
    step = SlotLayout.of(tuple(SlotLayout.tree(len(p), t) for p, t in zip(prompts, trees)))
    logits, _ = batch.forward(step.pad_tokens(nodes), step)  # [3, 3, V]
    for b, (prompt, tree, node_tokens) in enumerate(zip(prompts, trees, nodes)):
        alone = _program(model, 1)
        alone.forward(prompt[None], SlotLayout.of((SlotLayout.chain(0, len(prompt)),)))
        expected, _ = alone.forward(node_tokens[None], SlotLayout.of((SlotLayout.tree(len(prompt), tree),)))  # [1, T_b, V]
        torch.testing.assert_close(logits[b, : len(node_tokens)], expected[0], rtol=1e-5, atol=1e-5)
        written = len(prompt) + len(node_tokens)
        torch.testing.assert_close(batch.k_cache[:, b, :, :written], alone.k_cache[:, 0, :, :written], rtol=1e-5, atol=1e-5)


def test_commit_leaves_the_other_rows_bit_identical():
    model = tiny_model("llama")
    batch = _program(model, 3)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    layout = SlotLayout.of(tuple(SlotLayout.tree(c, tree) for c in (4, 6, 2)))
    batch.forward(torch.randint(0, 96, (3, 3)), layout)
    before_k, before_v = batch.k_cache.clone(), batch.v_cache.clone()
    committed = batch.commit(layout, [[0], [0, 2], [0, 1]])  # only row 1 moves: node 2 -> slot 7
    assert committed == [5, 8, 4]
    for cache, before in ((batch.k_cache, before_k), (batch.v_cache, before_v)):
        assert torch.equal(cache[:, 0], before[:, 0]) and torch.equal(cache[:, 2], before[:, 2])
        assert torch.equal(cache[:, 1, :, 7], before[:, 1, :, 8])
        assert torch.equal(cache[:, 1, :, :7], before[:, 1, :, :7])
    batch.keep_rows([0, 2], slots=6)  # row 1's sequence ended: row 2 moves up
    assert torch.equal(batch.k_cache[:, 1, :, :6], before_k[:, 2, :, :6])
    assert torch.equal(batch.k_cache[:, 0], before_k[:, 0])


def _hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def test_rows_do_not_depend_on_each_other_and_mix_matching_and_unmatched_prompts():
    """A repetitive prompt (prompt lookup matches, multi-token steps) beside random ones (no match):
    each row equals HF greedy alone, whatever the other rows are; rows accept different lengths."""
    model = peaked_tiny_model()
    repetitive = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(1)).repeat(3).tolist()
    others = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 13, 6)]
    program = _program(model, 3, drafter=PromptLookup())
    expected = {tuple(p): _hf_greedy(model, p, 30) for p in [repetitive, *others]}
    for batch in ([repetitive, others[0], others[1]], [others[2], repetitive]):
        out = decode(program, batch, max_new_tokens=30, eos_token_ids=[])
        for prompt, tokens in zip(batch, out.new_tokens):
            assert list(tokens) == expected[tuple(prompt)]
        row = batch.index(repetitive)
        assert max(out.stats[row].steps) > 1 and out.stats[row].target_forwards < 30
        assert out.sequences.shape == (len(batch), max(map(len, batch)) + 30)


def test_hf_hook_runs_a_padded_batch():
    """Every row padded (one more column than the longest prompt needs): HF's layout, the input as given."""
    model = peaked_tiny_model()
    prompts = [torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 11)]
    ids, mask = padded(prompts)
    column = torch.zeros(2, 1, dtype=torch.long)  # a padding column in front of every row
    ids, mask = torch.cat([column, ids], 1), torch.cat([column, mask], 1)
    hook = specpass.custom_generate({"lowering": "eager", "drafter": PromptLookup()})
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, custom_generate=hook,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    for b, prompt in enumerate(prompts):
        assert out[b, ids.shape[1] :].tolist() == _hf_greedy(model, prompt[0].tolist(), 12)
        assert torch.equal(out[b, : ids.shape[1]], ids[b])


def test_batch_requests_are_clear_errors():
    model = tiny_model("llama")
    ids = torch.randint(0, 96, (2, 5))
    bad = [
        ({"attention_mask": torch.ones(2, 4, dtype=torch.long)}, "shape"),
        ({"attention_mask": torch.full((2, 5), 2)}, "only 0"),
        ({"attention_mask": torch.tensor([[1, 0, 1, 1, 1], [1] * 5])}, "between tokens"),
        ({"attention_mask": torch.tensor([[0] * 5, [1] * 5])}, "row 0's prompt is empty"),
        ({"seed": [1, 2, 3], "do_sample": True}, "one per row"),
        ({"options": {"lowering": "eager"}, "max_new_tokens": 0}, "max_new_tokens"),
    ]
    for kwargs, message in bad:
        kwargs = {"max_new_tokens": 4} | kwargs
        with pytest.raises(InvalidParameterError, match=message):
            specpass.generate(model, ids, **kwargs)
    with pytest.raises(InvalidParameterError, match="holds 2 sequence"):
        decode(_program(model, 2), [[1, 2], [3], [4]], max_new_tokens=2, eos_token_ids=[])


def _sampled_by_hand(model, prompt: torch.Tensor, seed: int, temperature: float, new_tokens: int) -> list[int]:
    """Plain sampling written out, with nothing of specpass's decoding: HF's forward over the whole prefix,
    HF's temperature warper, then the Gumbel-max draw keyed by (seed, absolute position) that the README
    defines (backends.runtime.sampling.position_noise)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper

    from specpass.backends.runtime.sampling import position_noise

    ids, warp = prompt.reshape(1, -1), TemperatureLogitsWarper(temperature)
    with torch.no_grad():
        for _ in range(new_tokens):
            scores = warp(ids, model(ids).logits[:, -1].float())  # [1, V]
            token = (scores[0] + position_noise(seed, ids.shape[1], scores.shape[-1])).argmax()
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return ids[0, prompt.numel() :].tolist()


def test_sampled_rows_equal_plain_sampling_of_each_prompt_alone():
    """Sampling keys its noise by (seed, position): a row sampled speculatively in a batch gives the tokens
    of its prompt sampled alone with one-node trees (plain sampling, the README's promise) and the tokens
    of plain sampling written out by hand over HF's forward, with the row's seed."""
    model = peaked_tiny_model()
    prompts = [torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (6, 10, 3)]
    seeds = [3, 4, 5]
    ids, mask = padded(prompts)
    sampling = {"max_new_tokens": 16, "do_sample": True, "temperature": 0.7, "eos_token_id": []}
    out = specpass.generate(model, ids, attention_mask=mask, seed=seeds, options=_options(lowering="eager"), **sampling)
    assert sum(s.new_tokens - 1 - len(s.steps) for s in out.stats) > 0, "no draft token accepted: not speculative"
    one_node = {"lowering": "eager", "budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))}
    for b, (prompt, seed) in enumerate(zip(prompts, seeds)):
        alone = specpass.generate(model, prompt, seed=seed, options=one_node, **sampling)
        assert alone.stats.steps == (1,) * 15  # one token per step: nothing speculative
        assert list(out.new_tokens[b]) == alone.sequences[0, prompt.shape[1] :].tolist()
        assert list(out.new_tokens[b]) == _sampled_by_hand(model, prompt, seed, 0.7, 16)


def test_a_rows_step_padded_to_a_replay_bucket_leaves_the_real_rows_unchanged():
    """What the CUDA-graph lowerings replay for a batch (backends.lowering.cudagraphs), run on the CPU: two live
    rows of a four-row cache padded to 8 tokens and 4 rows give the live rows' logits of the unpadded
    step, write the live rows' real K/V as it does and touch no committed slot of a live row."""
    model = tiny_model("llama")
    program = _program(model, 4)
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 4)]
    prefill = SlotLayout.of(tuple(SlotLayout.chain(0, len(p)) for p in prompts))
    program.forward(prefill.pad_tokens(prompts), prefill)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    layout = SlotLayout.of((SlotLayout.tree(7, tree), SlotLayout.chain(4, 2)))
    tokens = layout.pad_tokens([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])  # [2, 3]
    committed = [program.k_cache[:, b, :, :n].clone() for b, n in enumerate((7, 4))]
    expected, _ = program.forward(tokens, layout)  # [2, 3, V]
    real = [program.k_cache[:, 0, :, 7:10].clone(), program.k_cache[:, 1, :, 4:6].clone()]
    inputs = layout.padded(8, 4).step_inputs(tokens)
    assert inputs["input_ids"].shape == (4, 8) and inputs["kv_len"] == 15
    assert inputs["cache_slots"][2:].tolist() == [list(range(8))] * 2  # padding rows: dead cache rows' first slots
    inputs["kv_len"] = 256  # a bucket's attended length: slots past each row's tree are hidden
    got = program.step.run.run_graph(inputs)[0]  # [4, 8, V]
    torch.testing.assert_close(got[0, :3], expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, :2], expected[1, :2], rtol=1e-5, atol=1e-5)
    for b, n in enumerate((7, 4)):
        assert torch.equal(program.k_cache[:, b, :, :n], committed[b])
    torch.testing.assert_close(program.k_cache[:, 0, :, 7:10], real[0])
    torch.testing.assert_close(program.k_cache[:, 1, :, 4:6], real[1])
    with pytest.raises(ValueError, match="cannot pad"):
        layout.padded(2, 2)


@needs_cxx
def test_inductor_rows_equal_hf_greedy_alone():
    """The inductor lowering (in-place per-row cache writes) decodes a batch whose every row equals HF
    greedy of its prompt alone."""
    model = peaked_tiny_model()
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11, 8)]
    inductor = _program(model, 3, drafter=PromptLookup(), lowering="inductor")
    assert inductor.step.run.lowering == "inductor"
    out = decode(inductor, prompts, max_new_tokens=20, eos_token_ids=[])
    assert [list(t) for t in out.new_tokens] == [_hf_greedy(model, p, 20) for p in prompts]


def _self_draft_rows(model, pipeline, drafter, prompts: list[list[int]], new: int = 30):
    """The loop over a self-drafting program against HF greedy of each prompt alone; returns the
    program's count of resumed forwards (steps verified from the exit states the drafts left)."""
    program = _program(model, len(prompts), pipeline=pipeline, drafter=drafter, budget=5)
    resumed = {"calls": 0}
    verify = program.verify

    def counted(*args):
        out = verify(*args)  # (logits, hidden, whether a hook resumed it above the exit)
        resumed["calls"] += out[2]
        return out

    program.verify = counted
    out = decode(program, prompts, max_new_tokens=new, eos_token_ids=[])
    for prompt, tokens in zip(prompts, out.new_tokens):
        assert list(tokens) == _hf_greedy(model, prompt, new)
    return resumed["calls"], out


@pytest.mark.parametrize("skip", [None, (1,)])
def test_self_draft_rows_equal_greedy_alone(skip):
    """EarlyExit(1) (draft with layer 0 and the exit) and LayerSkip((1,)) self-drafts in a batch: each
    row's chain is drafted in its own cache row, the verify resumes above the exit for all rows at
    once, and every row equals HF greedy alone."""
    from specpass.drafters import SelfDraft
    from specpass.rewrites import LayerSkip

    model = peaked_tiny_model()
    draft_pass = EarlyExit(1) if skip is None else LayerSkip(skip)
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 11, 8)]
    resumed, out = _self_draft_rows(model, specpass.Pipeline(TreeAttention(8), draft_pass), SelfDraft(3), prompts)
    assert resumed > 0 and max(s.tau for s in out.stats) > 1.2


def test_self_draft_in_the_combined_tree_rows_equal_greedy_alone():
    """The self-draft as one proposer beside prompt lookup: mixed trees are verified by the whole
    forward (no resume), which writes the self-drafted slots again; rows still equal HF greedy."""
    from specpass.drafters import SelfDraft

    model = peaked_tiny_model()
    repetitive = torch.randint(3, 96, (7,), generator=torch.Generator().manual_seed(1)).repeat(3).tolist()
    prompts = [repetitive, torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(9)).tolist()]
    pipeline = specpass.Pipeline(TreeAttention(8), EarlyExit(1))
    _self_draft_rows(model, pipeline, Combined(SelfDraft(3), PromptLookup()), prompts)


def test_self_draft_batch_on_the_default_model(default_model, cases):
    """The shipped exit adapter (layer 4) drafting two rows of the real model (code and chat, one ending
    at EOS after 46 tokens, one at the length limit): each row equals HF greedy alone."""
    from specpass.drafters import SelfDraft

    model, _ = default_model
    chosen = [cases[1], cases[3]]
    ids, mask = padded([c[0] for c in chosen])
    options = _options(SelfDraft(4), specpass.Pipeline(TreeAttention(16), EarlyExit(4, adapter="default")))
    out = specpass.generate(model, ids, max_new_tokens=48, attention_mask=mask, options=options)
    for b, (prompt, reference) in enumerate(chosen):
        assert list(out.new_tokens[b]) == _continuation(reference, prompt, 48)
    assert sorted(s.finish_reason for s in out.stats) == ["eos", "length"]


def test_one_seed_rule_for_rows_in_the_hf_hook():
    """The hook samples every row with its one seed, as specpass.generate does with one seed: a row
    samples exactly what its prompt samples alone (two copies of one prompt give the same tokens)."""
    model = peaked_tiny_model()
    prompt = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(8))
    other = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(5))
    ids, mask = padded([prompt, other, prompt])
    hook = specpass.custom_generate({"lowering": "eager", "drafter": PromptLookup()})
    sample = {"do_sample": True, "temperature": 0.9, "max_new_tokens": 16, "custom_generate": hook, "seed": 11,
              "eos_token_id": None, "pad_token_id": 0}  # fmt: skip
    batch = model.generate(ids, attention_mask=mask, **sample)
    for b, row in ((0, prompt), (1, other)):
        alone = model.generate(row, attention_mask=torch.ones_like(row), **sample)
        assert batch[b, ids.shape[1] :].tolist() == alone[0, row.shape[1] :].tolist()
    assert torch.equal(batch[0], batch[2])
