"""ONNX export and the ONNX Runtime lowering (CPU EP): round trip, tree mask, KV commit, errors, lossless."""

import dataclasses
import json
import os
import shutil

import onnxruntime  # noqa: F401 (a test dependency: without it the run fails, never skips)
import pytest
import torch
from conftest import NEW_TOKENS, at_once, padded, tiny_model, translated_once

import specpass
from specpass.backends.onnx.export import export
from specpass.cli import main
from specpass.drafters import DraftTree
from specpass.ir import SlotLayout
from specpass.passes import Pass, PassResult
from specpass.passes.export import ExportGraph, ExportHook

TREE = specpass.Pipeline(specpass.rewrites.TreeAttention(16))
EXPORTED = ("llama", "qwen2", "mistral", "gemma2")  # biases, sliding windows, soft-capping and local/global layers
# (Qwen3 and Gemma 3, q/k norms: exported and decoded on ORT by test_families.py through the CLI)


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory, step_translations):
    """Tiny models of the families, each exported (with the default checks) once; later exports of the
    same step share its ONNX translation."""
    out = {}
    for arch in EXPORTED:
        model = tiny_model(arch)
        directory = str(tmp_path_factory.mktemp(f"onnx-{arch}"))
        with translated_once(step_translations):
            out[arch] = model, export(model, TREE, directory, force=True, progress=False)
    return out


@pytest.mark.parametrize("arch", EXPORTED)
def test_export_round_trip(tiny_exports, arch):
    model, result = tiny_exports[arch]
    files = set(os.listdir(result.directory))
    assert {"model.onnx", "pipeline.json", "manifest.json"} <= files
    manifest = json.load(open(os.path.join(result.directory, "manifest.json")))
    assert manifest["architecture"] == type(model).__name__ and manifest["dtype"] == "float32"
    assert [i["name"] for i in manifest["inputs"]] == ["input_ids", "positions", "past_keys", "past_values",
                                                      "past_mask", "tree_mask"]  # fmt: skip
    head_dim = getattr(model.config, "head_dim", None) or 8  # 8 = hidden / heads where the config has no head_dim
    assert manifest["inputs"][2]["shape"] == [2, "B", 2, "S", head_dim] and manifest["outputs"][0]["shape"] == ["B", "T", 96]
    assert specpass.Pipeline.from_dict(manifest["pipeline"]) == TREE
    assert result.max_abs_diff is not None and result.max_abs_diff < 1e-4  # ORT vs PyTorch, float32
    import onnx

    onnx.checker.check_model(result.onnx_path)
    graph_inputs = [i.name for i in onnx.load(result.onnx_path, load_external_data=False).graph.input]
    assert graph_inputs == [i["name"] for i in manifest["inputs"]]


def test_the_export_check_refuses_an_onnx_model_that_computes_another_function(tiny_exports):
    """check_onnx compares ORT with the PyTorch step: the exported file against the step of the same model
    with its LM head changed by 1e-3 is refused (the bound: 1e-4, or 8 float32 ulps of the largest value)."""
    from specpass.backends.onnx.export import check_onnx, kv_as_io, rewritten_step
    from specpass.common.errors import ExportError
    from specpass.ir import arch_of

    model, result = tiny_exports["llama"]
    other = tiny_model("llama")
    other.load_state_dict(model.state_dict())
    step = kv_as_io(rewritten_step(model, TREE))
    assert max(check_onnx(result.onnx_path, step, arch_of(step), torch.float32, None).values()) < 1e-4
    with torch.no_grad():
        other.lm_head.weight.add_(1e-3)
    changed = kv_as_io(rewritten_step(other, TREE))
    with pytest.raises(ExportError, match="ORT and PyTorch disagree"):
        check_onnx(result.onnx_path, changed, arch_of(changed), torch.float32, None)


def _forward(program, tokens, layout):
    """One sequence's forward: tokens [T] laid out by `layout` (a SlotLayout) -> logits [T, V]."""
    return program.forward(tokens[None], SlotLayout.of((layout,)))[0][0]


def _prefill(program, prompt):
    n = prompt.shape[0]
    layout = SlotLayout.of((SlotLayout.chain(0, n),))
    program.forward(prompt[None], layout)
    program.commit(layout, [range(n)])
    return n


def test_tree_through_ort_equals_chains_branch_by_branch(tiny_exports):
    model, result = tiny_exports["llama"]
    program = specpass.load_onnx(result.directory, cache_size=128)
    n = _prefill(program, torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3)))
    tree = DraftTree((7, 11, 12, 13, 14, 15), (-1, 0, 0, 1, 3, 2), (1.0,) * 6, (None,) * 6)
    tree_logits = _forward(program, torch.tensor(tree.tokens), SlotLayout.tree(n, tree.ancestor_mask()))
    for leaf in (4, 5):
        path, node = [], leaf
        while node >= 0:
            path.insert(0, node)
            node = tree.parents[node]
        chain = torch.tensor([tree.tokens[i] for i in path])
        k = len(path)
        chain_logits = _forward(program, chain, SlotLayout.chain(n, k))
        torch.testing.assert_close(tree_logits[path], chain_logits, rtol=1e-5, atol=1e-5)


def test_kv_commit_across_accepted_and_rejected_nodes(tiny_exports):
    model, result = tiny_exports["qwen2"]
    program = specpass.load_onnx(result.directory, cache_size=128)
    prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(4))
    n = _prefill(program, prompt)
    tree = DraftTree((5, 6, 7, 8), (-1, 0, 0, 2), (1.0,) * 4, (None,) * 4)  # node 1 is rejected
    layout = SlotLayout.of((SlotLayout.tree(n, tree.ancestor_mask()),))
    program.forward(torch.tensor(tree.tokens)[None], layout)
    program.commit(layout, [[0, 2, 3]])
    accepted = torch.cat([prompt, torch.tensor([5, 7, 8])])
    nxt = torch.tensor([9])
    logits = _forward(program, nxt, SlotLayout.chain(n + 3, 1))
    with torch.no_grad():
        expected = model(torch.cat([accepted, nxt])[None]).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", EXPORTED)
def test_ort_decoding_equals_hf_greedy(tiny_exports, arch):
    model, result = tiny_exports[arch]
    # trees of 16, not the measured curve's sizes: timed on a busy core, the curve can pick 1-node trees
    program = specpass.load_onnx(result.directory, cache_size=200, budget=16)
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(seed))
        out = specpass.generate(program, ids, max_new_tokens=40, eos_token_id=[])
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                   eos_token_id=None)  # past the tiny sliding windows (18)
        assert torch.equal(out.sequences, reference)
    assert out.stats.tau > 1.0


def test_cache_grows_past_its_first_bucket(tiny_exports):
    model, result = tiny_exports["llama"]
    program = specpass.load_onnx(result.directory, cache_size=600)
    ids = torch.randint(0, 96, (1, 250), generator=torch.Generator().manual_seed(5))
    out = specpass.generate(program, ids, max_new_tokens=60, eos_token_id=[])
    assert program.keys.shape[3] == 512  # 256 slots, then grown once
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None))


def test_ort_batch_equals_each_row_alone(tiny_exports):
    """B as a dynamic axis of the export: a batch of 3 rows (different prompt lengths, one row ending
    at an EOS, the others at the length limit, so the cache buffers shrink to the live rows) gives
    each row's HF greedy tokens alone; the same program then runs one sequence and a new batch."""
    model, result = tiny_exports["llama"]
    program = specpass.load_onnx(result.directory, cache_size=200, rows=3)
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 12, 4)]
    prompts[1] = prompts[1].repeat(2)  # a repetitive row: prompt lookup drafts it

    def alone(prompt, new=30):
        ids = prompt[None]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             eos_token_id=None)  # fmt: skip
        return out[0, len(prompt) :].tolist()

    references = [alone(p) for p in prompts]
    eos = next(t for t in references[0][3:] if t not in references[1] and t not in references[2])
    ids, mask = padded(prompts)
    out = specpass.generate(program, ids, max_new_tokens=30, attention_mask=mask, eos_token_id=[eos])
    expected = [references[0][: references[0].index(eos) + 1], references[1], references[2]]
    assert [list(t) for t in out.new_tokens] == expected
    assert [s.finish_reason for s in out.stats] == ["eos", "length", "length"]
    assert program.keys.shape[1] < 3  # the rows that finished left the buffers
    single = specpass.generate(program, prompts[2][None], max_new_tokens=30, eos_token_id=[])
    assert single.sequences[0, len(prompts[2]) :].tolist() == references[2]
    again = specpass.generate(program, ids[:2], max_new_tokens=30, attention_mask=mask[:2], eos_token_id=[])
    assert [list(t) for t in again.new_tokens] == references[:2]
    with pytest.raises(specpass.InvalidParameterError, match="holds 3 sequence"):
        specpass.generate(program, torch.zeros(4, 3, dtype=torch.long), max_new_tokens=4)


def test_ort_batch_refusals(tiny_exports, tmp_path):
    """An export from before batches (batch 1 fixed in its manifest) and bad row counts: clear errors."""
    _, result = tiny_exports["llama"]
    old = tmp_path / "old"
    old.mkdir()
    for name in os.listdir(result.directory):
        os.symlink(os.path.join(result.directory, name), old / name)
    manifest = json.load(open(os.path.join(result.directory, "manifest.json")))
    for entry in manifest["inputs"] + manifest["outputs"]:
        entry["shape"] = [1 if d == "B" else d for d in entry["shape"]]
    os.unlink(old / "manifest.json")
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(specpass.InvalidParameterError, match="exported for one sequence"):
        specpass.load_onnx(str(old), rows=2)
    assert specpass.load_onnx(str(old)).rows == 1  # one sequence still runs on it
    for bad in (0, 2.5):
        with pytest.raises(specpass.InvalidParameterError, match="rows must be an int"):
            specpass.load_onnx(result.directory, rows=bad)


class _Unexportable(Pass):
    def check(self, gm):
        return None

    def rewrite(self, gm):
        return PassResult(gm, False)


def test_a_damaged_export_is_one_clear_error(tiny_exports, tmp_path):
    """A damaged model.onnx or manifest.json: DamagedFileError naming the file and how to remake it."""
    source = tiny_exports["llama"][1].directory
    for name, damage in (("model.onnx", b"\x08\x07garbage"), ("manifest.json", b"{")):
        broken = str(tmp_path / name)
        shutil.copytree(source, broken)
        with open(os.path.join(broken, name), "wb") as f:
            f.write(damage)
        with pytest.raises(specpass.DamagedFileError, match=rf"{name}.*export") as raised:
            specpass.load_onnx(broken)
        assert len(str(raised.value).splitlines()) == 1


def test_an_interrupted_export_leaves_nothing_that_looks_complete(tiny_exports, step_translations, tmp_path, monkeypatch):
    """The export is written beside its directory and renamed into place once checked: interrupted in
    its checks while replacing an export (force), it leaves the old export whole and nothing else."""
    import specpass.backends.onnx.export as onnx_export

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    model = tiny_exports["llama"][0]
    monkeypatch.setattr(onnx_export, "check_onnx", interrupted)
    kept = str(tmp_path / "kept")
    shutil.copytree(tiny_exports["llama"][1].directory, kept)
    before = sorted(os.listdir(kept))
    with pytest.raises(KeyboardInterrupt), translated_once(step_translations):
        export(model, TREE, kept, force=True, progress=False)
    assert os.listdir(tmp_path) == ["kept"] and sorted(os.listdir(kept)) == before
    specpass.load_onnx(kept)


def test_export_errors(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    with pytest.raises(specpass.UnsupportedArchitectureError, match="supported architectures"):
        export(gpt2, TREE, str(tmp_path / "gpt2"), progress=False)
    with pytest.raises(specpass.ExportError, match="cannot express pass _Unexportable"):
        export(tiny_model(), specpass.Pipeline(_Unexportable()), str(tmp_path / "x"), progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("user data")
    with pytest.raises(specpass.ExportError, match="exists and is not empty; pass --force"):
        export(tiny_model(), TREE, str(tmp_path / "full"), progress=False)
    assert (tmp_path / "full" / "keep.txt").exists()
    with pytest.raises(specpass.SpecpassError, match="no manifest.json"):
        specpass.load_onnx(str(tmp_path / "full"))
    assert main(["generate", "--backend", "onnxrt", "--prompt", "hi"]) == 2  # --model is required


class _Doubled(torch.nn.Module):
    def forward(self, x):
        return (2 * x,)


@dataclasses.dataclass(frozen=True)
class _WithAGraph(_Unexportable):
    """A pass whose export hook adds one graph beside the step and a manifest entry."""

    def export_hook(self, gm, arch, dtype):
        x = torch.arange(arch.hidden_size, dtype=dtype)[None]
        graph = ExportGraph("doubled.onnx", _Doubled(), {"x": x}, ("y",), {"x": {0: torch.export.Dim("n")}})
        return ExportHook("doubled", (graph,), {"file": "doubled.onnx", "width": arch.hidden_size})


def test_a_pass_export_hook_adds_its_graphs_and_its_manifest_entry(step_translations, tmp_path):
    """Pass.export_hook: its graph is exported, checked on ORT and named in the manifest; the pass
    without one is refused naming the passes that have one."""
    import onnxruntime

    with translated_once(step_translations):  # the step is tiny llama's under TREE
        result = export(tiny_model(), specpass.Pipeline(specpass.rewrites.TreeAttention(16), _WithAGraph()),
                        str(tmp_path / "out"), progress=False)  # fmt: skip
    entry = result.manifest["doubled"]
    assert entry["file"] == "doubled.onnx" and entry["width"] == 32 and entry["check_max_abs_diff"] == {"doubled.onnx": 0.0}
    session = onnxruntime.InferenceSession(os.path.join(result.directory, "doubled.onnx"))
    assert session.run(["y"], {"x": torch.ones(3, 32).numpy()})[0].tolist() == [[2.0] * 32] * 3
    with pytest.raises(specpass.ExportError, match="these do: .*KVEviction.*TreeAttention"):
        export(tiny_model(), specpass.Pipeline(_Unexportable()), str(tmp_path / "x"), progress=False)


def test_float16_export_is_checked(tmp_path):
    result = export(tiny_model().half(), TREE, str(tmp_path / "fp16"), progress=False)
    assert result.manifest["dtype"] == "float16" and result.max_abs_diff < 5e-2


@pytest.fixture(scope="module")
def default_export(tmp_path_factory):
    """The default model exported by the CLI with the shipped Hydra heads (draft.onnx beside model.onnx)."""
    directory = str(tmp_path_factory.mktemp("onnx-default") / "out")
    pipeline = specpass.Pipeline(specpass.rewrites.TreeAttention(64), specpass.rewrites.DraftHeads("hydra"))
    assert main(["export", "-o", directory, "--pipeline", pipeline.to_json()]) == 0  # the CLI, as the README runs it
    return directory


def test_default_model_on_ort_equals_hf_greedy(default_export, cases):
    """The combined tree on a code and a chat case (heads + combined: the batch test below, all four cases)."""
    from specpass.drafters.registry import drafter_by_name

    manifest = json.load(open(os.path.join(default_export, "manifest.json")))
    assert manifest["architecture"] == "LlamaForCausalLM" and max(manifest["check"]["max_abs_diff"].values()) < 1e-4
    assert manifest["draft"]["spec"]["config"]["design"] == "hydra" and manifest["draft"]["check_max_abs_diff"] < 1e-4
    program = specpass.load_onnx(default_export, drafter=drafter_by_name("combined"), budget=16)  # no curve to measure
    for ids, reference in cases[::2]:
        out = specpass.generate(program, ids, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out.sequences, reference)


def test_threads_on_one_ort_program_each_get_their_own_exact_output(default_export, cases):
    """Four threads call `generate` at once on one ONNX Runtime program: each output is HF greedy's."""
    program = specpass.load_onnx(default_export, budget=16)
    outs = at_once([lambda ids=ids: specpass.generate(program, ids, max_new_tokens=12) for ids, _ in cases])
    for out, (ids, reference) in zip(outs, cases):
        assert torch.equal(out.sequences, reference[:, : ids.shape[1] + 12])


def test_default_model_batch_on_ort_equals_hf_greedy_alone(default_export, cases):
    """The default model's export (with Hydra heads) decoding the four cases as one batch, drafting with
    heads, prompt lookup and Token Recycling: one row ends at EOS after 46 tokens while the others go
    on to the length limit, each row equal to HF greedy of its prompt alone."""
    from specpass.drafters.registry import drafter_by_name

    program = specpass.load_onnx(default_export, drafter=drafter_by_name("heads-combined"), rows=4, budget=16)
    ids, mask = padded([c[0] for c in cases], pad=2)
    out = specpass.generate(program, ids, max_new_tokens=NEW_TOKENS, attention_mask=mask)
    for b, (prompt, reference) in enumerate(cases):
        assert list(out.new_tokens[b]) == reference[0, prompt.shape[1] :].tolist()
    assert [s.finish_reason for s in out.stats] == ["length", "eos", "length", "length"]


def test_sampling_on_ort_equals_plain_sampling_on_ort(default_export, cases):
    """Speculative sampling through ONNX Runtime (Hydra heads + prompt lookup + Token Recycling) emits
    exactly what one-node sampling on the same export emits with the same seed."""
    from specpass.drafters.registry import drafter_by_name

    plain = specpass.load_onnx(default_export, max_nodes=1)
    program = specpass.load_onnx(default_export, drafter=drafter_by_name("heads-combined"), budget=16)
    taus = []
    for i, (ids, _) in enumerate(cases[:2]):
        settings = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=20)][i % 2] | {"seed": i}
        reference = specpass.generate(plain, ids, 32, do_sample=True, **settings)
        out = specpass.generate(program, ids, 32, do_sample=True, **settings)
        assert torch.equal(out.sequences, reference.sequences)
        taus.append(out.stats.tau)
    assert sum(taus) / len(taus) > 1.1  # drafts are accepted while sampling


def test_drawn_heads_on_ort(default_export, cases):
    """Heads drawn at T = 1 through ONNX Runtime: sample-and-match ("match") emits one-node sampling's
    tokens; the multi-candidate rule gives the same tokens for the same seed and accepts drafts."""
    plain = specpass.load_onnx(default_export, max_nodes=1)
    drawn = specpass.drafters.Heads(tree="static", temperature=1.0)
    program = specpass.load_onnx(default_export, drafter=drawn, budget=16)  # fixed trees: the rule's tokens repeat
    ids, _ = cases[0]
    settings = dict(do_sample=True, temperature=0.7, top_p=0.9, seed=5)
    reference = specpass.generate(plain, ids, 32, **settings)
    assert torch.equal(specpass.generate(program, ids, 32, acceptance="match", **settings).sequences, reference.sequences)
    ruled = specpass.generate(program, ids, 32, **settings)
    assert torch.equal(specpass.generate(program, ids, 32, **settings).sequences, ruled.sequences)
    assert ruled.stats.tau > 1.1


def test_cli_generate_on_ort(default_export, capsys):
    assert main(["generate", "--backend", "onnxrt", "--model", default_export, "--max-new-tokens", "24",
                 "--prompt", "Write a Python function that reverses a string."]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "identical to greedy: True" in printed and "plain greedy (ORT)" in printed


def test_cli_exports_a_local_hf_directory(step_translations, tmp_path, capsys):
    model = tiny_model("mistral")
    model.save_pretrained(tmp_path / "hf")
    out = tmp_path / "out"
    too_deep = specpass.Pipeline(specpass.rewrites.TreeAttention(64)).to_json()  # trees as deep as the window (18)
    assert main(["export", str(tmp_path / "hf"), "-o", str(out), "--no-check", "--pipeline", too_deep]) == 2
    assert "use max_nodes < 18" in capsys.readouterr().err and not out.exists()
    with translated_once(step_translations):  # the step is tiny mistral's under TREE
        assert main(["export", str(tmp_path / "hf"), "-o", str(out), "--no-check"]) == 0  # the default fits the window
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["architecture"] == "MistralForCausalLM" and manifest["check"] == "skipped"
    assert manifest["pipeline"]["passes"] == [{"pass": "TreeAttention", "params": {"max_nodes": 17}}]
    assert main(["export", str(tmp_path / "hf"), "-o", str(out), "--pipeline", TREE.to_json()]) == 2  # no --force
    assert main(["export", str(tmp_path / "missing"), "-o", str(tmp_path / "o2")]) == 2
