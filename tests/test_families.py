"""Conformance of every registered family (ir.families) on a tiny random-weight config: tree
verification equals HF's forward on every branch, and speculative greedy decoding with every
training-free drafter equals HF greedy. (Prefill and cached one-token steps: tests/test_capture.py;
ONNX round trips: tests/test_onnx.py; Qwen3 and Gemma 3 are exported and decoded on ORT here, through the CLI.)"""

import pytest
import torch
from conftest import FIXED_BUDGET, TINY_ARCHS, char_tokenizer, tiny_model

import specpass
from specpass.drafters import Combined, DraftTree, PromptLookup, TokenRecycling
from specpass.ir import FAMILIES, SUPPORTED_ARCHITECTURES, SlotLayout, capture
from specpass.backends.lowering.registry import lower
from specpass.rewrites import TreeAttention

PARENTS = (-1, 0, 0, 1, 2, 4, 2)  # root -> 1 -> 3, root -> 2 -> 4 -> 5, 2 -> 6


def test_every_registered_architecture_has_a_tiny_config():
    covered = {type(tiny_model(arch)).__name__ for arch in TINY_ARCHS}
    assert covered == set(SUPPORTED_ARCHITECTURES)
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


@torch.no_grad()
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tree_verification_equals_hf_on_every_branch(arch):
    model = tiny_model(arch, seed=1)
    gm, _ = specpass.Pipeline(TreeAttention(8)).run(capture(model, cache_size=64))
    step = lower(gm, "eager", torch.device("cpu"), 8, 64).step
    prompt = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    step(prompt, SlotLayout.chain(0, 20))
    tree = DraftTree((5, 17, 33, 41, 2, 8, 60), PARENTS, (1.0,) * 7, (None,) * 7)
    logits, _ = step(torch.from_numpy(tree.tokens)[None], SlotLayout.tree(20, tree.ancestor_mask()))  # [1, 7, V]
    for leaf in (3, 5, 6):
        branch, node = [], leaf
        while node >= 0:
            branch.insert(0, node)
            node = PARENTS[node]
        full = torch.cat([prompt, torch.tensor([[tree.tokens[i] for i in branch]])], dim=1)
        torch.testing.assert_close(logits[0, branch], model(full).logits[0, 20:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_speculative_greedy_equals_hf_greedy_with_every_training_free_drafter(arch):
    model = tiny_model(arch, seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked next-token law, so drafts get accepted
    for drafter in (PromptLookup(), TokenRecycling(), Combined(PromptLookup(), TokenRecycling())):
        options = {"pipeline": specpass.Pipeline(TreeAttention(16)), "drafter": drafter, "cache_size": 128,
                   "budget": FIXED_BUDGET}  # fixed trees: tau does not depend on a timed cost curve
        taus = []
        for seed in range(3):
            ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(seed)).repeat(1, 2)
            out = specpass.generate(model, ids, max_new_tokens=40, eos_token_id=[], options=options)
            reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                       eos_token_id=None)  # the mask: token 0 is some configs' pad token
            assert torch.equal(out.sequences, reference), (arch, drafter)
            taus.append(out.stats.tau)
        assert max(taus) > 1.0  # drafts were accepted


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_cli_generates_and_exports_a_saved_model_of_the_family(tmp_path, capsys, arch):
    from specpass.cli import main

    model = tiny_model(arch, seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked: drafts get accepted
    model.save_pretrained(tmp_path / "model")
    char_tokenizer(model.config.vocab_size).save_pretrained(tmp_path / "model")
    prompt = ["--prompt", "the cat sat on the mat; the cat sat on the", "--raw", "--max-new-tokens", "24"]
    trees = ["--pipeline", specpass.Pipeline(TreeAttention(16)).to_json()]  # below the tiny sliding window (18)
    assert main(["generate", "--model", str(tmp_path / "model"), *prompt, *trees]) == 0  # 0: identical to HF greedy
    assert main(["export", str(tmp_path / "model"), "-o", str(tmp_path / "onnx"), *trees]) == 0
    assert main(["generate", "--backend", "onnxrt", "--model", str(tmp_path / "onnx"), *prompt]) == 0
    printed = capsys.readouterr().out
    assert f"({type(model).__name__}, float32)" in printed and printed.count("identical to greedy: True") == 2
    program = specpass.load_onnx(str(tmp_path / "onnx"), budget=8)  # the export against HF itself, not ORT's greedy
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1)).repeat(1, 2)
    out = specpass.generate(program, ids, max_new_tokens=24, eos_token_id=[])
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                               eos_token_id=None)  # fmt: skip
    assert torch.equal(out.sequences, reference)
