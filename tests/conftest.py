import collections
import contextlib
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specpass.backends.lowering import gguf as gguf_lowering
from specpass.backends.lowering import onednn
from specpass.research.tiny_models import TINY_ARCHS, TINY_CONFIGS, WINDOW, tiny_model  # noqa: F401 (tests import them here)

# A CPU piece the README promises (oneDNN, the int4 kernel, a C++ compiler for the compiled lowerings): its
# tests skip without it, and the run says so in its summary line ("N skipped: a CPU piece missing") and
# lists the pieces, so a green run never hides a proof that did not run. Test dependencies (hypothesis,
# onnxruntime) are imported outright: without them the run fails.
CPU_PIECE_MISSING = "a CPU piece missing"

needs_onednn = pytest.mark.skipif(
    not onednn.available(torch.device("cpu"), torch.float32), reason=f"{CPU_PIECE_MISSING}: this torch build has no oneDNN"
)

needs_cxx = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
    reason=f"{CPU_PIECE_MISSING}: TorchInductor's CPU code generation needs a C++ compiler",
)

needs_int4_kernel = pytest.mark.skipif(
    not gguf_lowering.available(torch.device("cpu"), torch.float32),
    reason=f"{CPU_PIECE_MISSING}: this torch build has no int4 CPU kernel",
)


def _missing_piece(report) -> str | None:
    """The skip reason of a test skipped for a missing CPU piece (None for any other report)."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    reason = str(report.longrepr[2])
    return reason if CPU_PIECE_MISSING in reason else None


def pytest_report_teststatus(report, config):
    if _missing_piece(report) is not None:
        return "skipped: " + CPU_PIECE_MISSING, "m", "SKIPPED (" + CPU_PIECE_MISSING + ")"
    return None


def pytest_terminal_summary(terminalreporter):
    reasons = collections.Counter(_missing_piece(r) for r in terminalreporter.stats.get("skipped: " + CPU_PIECE_MISSING, []))
    if reasons:
        terminalreporter.write_sep("=", "proofs that did not run: " + CPU_PIECE_MISSING, yellow=True)
        for reason, count in sorted(reasons.items()):
            terminalreporter.write_line(f"{count} test{'s' * (count != 1)}: {reason.split(CPU_PIECE_MISSING + ': ', 1)[-1]}")


def peaked_tiny_model():
    """A random tiny llama whose next-token law is peaked (random weights alone give a near-uniform one)."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def peaked_four_layer_llama(seed: int = 3):
    """A random 4-layer tiny Llama with a peaked next-token law: the smallest model a feature draft
    (three feature layers) can be trained for."""
    import transformers

    from specpass.research.tiny_models import TINY

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(TINY | {"num_hidden_layers": 4}))).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def train_tiny_feature_draft(model, directory: str):
    """A feature draft for a 4-layer model (peaked_four_layer_llama) trained on its continuations of 20
    random prompts, 4 held out, where the model is; saved to `directory`. Returns (corpus, held_out,
    directory, draft, its config, the losses)."""
    from specpass.heads.feature_draft import default_feature_layers
    from specpass.research.feature_training import FeatureTrainConfig, train_feature_draft
    from specpass.research.heads_training import generate_corpus

    layers = default_feature_layers(4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (1, 6), generator=gen) for _ in range(24)]
    corpus = generate_corpus(model, prompts[:20], max_new_tokens=24, progress=False, layers=layers)
    held_out = generate_corpus(model, prompts[20:], max_new_tokens=24, progress=False, layers=layers)
    config = FeatureTrainConfig(epochs=40, sequences=4, steps=3, lr=3e-3, draft_vocab=96, ranks=4)
    draft, result, losses = train_feature_draft(model, corpus, held_out, config, out_dir=directory, progress=False)
    return corpus, held_out, directory, draft, result, losses


def random_draft(draft, std: float = 0.3, seed: int = 0):
    """`draft` (a feature or Clover draft of a small config) with N(0, std) weights and a random draft
    vocabulary, in eval mode."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, std)
        draft.draft_vocab.copy_(torch.randperm(draft.config.vocab_size)[: draft.config.draft_vocab])
    return draft.eval()


def check_drafting_equals_hf_greedy(model, corpus, pipeline, alone, combined, min_tau: float = 1.5) -> None:
    """Greedy with `alone` and with `combined` (the same drafter in a combined tree) under `pipeline` equals
    HF greedy token for token on three prompts of `corpus` (where a trained draft drafts well: tau >
    min_tau) and on two unseen ones; a batch of rows of different lengths equals each row alone."""
    import specpass

    prompts = [c.tokens[: c.start + 1][None] for c in corpus[:3]]
    prompts += [torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 11)]
    taus = []
    for drafter in (alone, combined):
        options = {"pipeline": pipeline, "drafter": drafter, "cache_size": 96, "budget": 12}
        for ids in prompts:
            out = specpass.generate(model, ids, max_new_tokens=24, eos_token_id=[], options=options)
            reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                       eos_token_id=None)  # fmt: skip
            assert torch.equal(out.sequences, reference)
            taus.append(out.stats.tau)
    assert min(taus[:3]) > min_tau, taus
    program = specpass.compile_program(model, {"pipeline": pipeline, "drafter": alone, "cache_size": 96,
                                              "budget": 12}, rows=3)  # fmt: skip
    rows = [prompts[0], prompts[3], prompts[4]]  # 6, 5 and 11 tokens
    ids, mask = padded(rows)
    batch = specpass.generate(program, ids, 20, attention_mask=mask, eos_token_id=[])
    for row, new in zip(rows, batch.new_tokens):
        alone_tokens = model.generate(row, max_new_tokens=20, do_sample=False, eos_token_id=None)
        assert list(new) == alone_tokens[0, row.shape[1] :].tolist()


def check_sampling_equals_one_node_sampling(model, corpus, pipeline, drafter, min_tau: float = 1.2) -> None:
    """Sample-and-match over the drafter's tree: with the same seed, the same tokens as sampling one token a
    step (a budget of 1), on three prompts of `corpus`, with drafts accepted there (mean tau > min_tau)."""
    import specpass

    speculative = {"pipeline": pipeline, "drafter": drafter, "cache_size": 96, "budget": 12}
    plain = {"pipeline": pipeline, "drafter": drafter, "cache_size": 96, "budget": 1}
    taus = []
    for seed, c in enumerate(corpus[:3]):
        ids = c.tokens[: c.start + 1][None]
        settings = dict(do_sample=True, temperature=0.5, seed=seed, eos_token_id=[])
        out = specpass.generate(model, ids, 24, options=speculative, **settings)
        assert torch.equal(out.sequences, specpass.generate(model, ids, 24, options=plain, **settings).sequences)
        taus.append(out.stats.tau)
    assert sum(taus) / len(taus) > min_tau, taus


def at_once(calls: list) -> list:
    """Run the zero-argument `calls` in threads of their own, released together; their results in order."""
    start = threading.Barrier(len(calls))

    def run(call):
        start.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def char_tokenizer(vocab_size: int):
    """A character-level fast tokenizer of `vocab_size` tokens (no download), saved beside a tiny model."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + vocab_size - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def padded(prompts: list[torch.Tensor], left: bool = True, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, P] and attention_mask [B, P] of prompts ([P_b] or [1, P_b]), padded on one side."""
    rows = [p.reshape(-1) for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[b, cols], mask[b, cols] = r, 1
    return ids, mask


def repeating_rows_tau(drafter, seed: int, heads: tuple[int, ...], tail: int, new_tokens: int) -> float:
    """A batch of rows on the peaked tiny model, row b its random head of heads[b] tokens, the head again
    and its first `tail` tokens: asserts the drafter drafts them at once (drafters.chains) and every row
    equals HF greedy of its prompt alone; returns the batch's tau (new tokens / target forwards)."""
    import specpass
    from specpass.drafters import ChainDrafting, TargetForward

    prefill = TargetForward(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    assert isinstance(drafter.rows([[1, 2]], [prefill], drafter.new_memory()), ChainDrafting)
    model = peaked_tiny_model()
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for n in heads:
        head = torch.randint(3, 96, (n,), generator=gen)
        prompts.append(torch.cat([head, head, head[:tail]]))
    ids, mask = padded(prompts)
    out = specpass.generate(model, ids, new_tokens, attention_mask=mask, eos_token_id=[],
                            options={"lowering": "eager", "drafter": drafter, "budget": 8})  # fmt: skip
    for b, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
        assert list(out.new_tokens[b]) == alone[0, len(prompt) :].tolist(), b
    return sum(s.new_tokens for s in out.stats) / sum(s.target_forwards for s in out.stats)


NEW_TOKENS = 48  # the length of the `cases` references: where a test's subject is not a long continuation
FIXED_BUDGET = 8  # trees of 8 nodes: no cost curve to measure (test_tree_budget_follows_the_cost_curve tests it)


def with_heads(kind: str, drafter) -> dict:
    """Options for a drafter that reads the draft heads shipped for the default model."""
    import specpass
    from specpass.rewrites import DraftHeads, TreeAttention

    pipeline = specpass.Pipeline(TreeAttention(64), DraftHeads(kind))
    return {"pipeline": pipeline, "drafter": drafter, "budget": FIXED_BUDGET}


def with_feature(drafter) -> dict:
    """Options for a drafter that reads the feature draft shipped for the default model."""
    import specpass
    from specpass.rewrites import FeatureDraft, TreeAttention

    return {"pipeline": specpass.Pipeline(TreeAttention(64), FeatureDraft()), "drafter": drafter, "budget": FIXED_BUDGET}


def token_inside_an_accepted_draft(continuation: list[int], steps: tuple[int, ...]) -> tuple[int, int]:
    """(token, index in continuation) of a token that first appears in the middle of a multi-token
    step: declared EOS, it ends a generation inside an accepted draft."""
    start = 1  # continuation[0] comes from the prefill
    for emitted in steps:
        for offset in range(emitted - 1):  # not the step's last token: the draft continued past it
            token = continuation[start + offset]
            if token not in continuation[: start + offset]:
                return token, start + offset
        start += emitted
    raise AssertionError("no multi-token step with a fresh token; pick another prompt")


def step_inputs_of(graph, available: dict) -> dict:
    """The entries of `available` that `graph` takes as inputs (its placeholders)."""
    return {n.target: available[n.target] for n in graph.graph.nodes if n.op == "placeholder"}


@torch.no_grad()
def draft_then_resume(gm, ids: torch.Tensor):
    """A step with a cache-sharing draft graph (EarlyExit, LayerSkip): runs the verify step on ids
    [1, T] as a chain from slot 0, then, on a zeroed cache, the draft graph and the resume graph from
    its exit_hidden, asserting that the two give the step's outputs and cache writes bit for bit.
    Returns (draft logits, exit_hidden, the cache (k, v) after the draft, the step's cache (k, v))."""
    from specpass.ir import SlotLayout
    from specpass.ir.draft import draft_graph, resume_graph
    from specpass.ir.split import EXIT_HIDDEN

    inputs = SlotLayout.chain(0, ids.shape[1]).step_inputs(ids)
    logits, hidden = gm(**inputs)[:2]
    k_cache, v_cache = gm.k_cache.clone(), gm.v_cache.clone()
    gm.k_cache.zero_(), gm.v_cache.zero_()
    draft_logits, exit_hidden = draft_graph(gm)(**step_inputs_of(draft_graph(gm), inputs))[:2]  # [1, T, V], [1, T, H]
    drafted = gm.k_cache.clone(), gm.v_cache.clone()
    resumed = resume_graph(gm)(**step_inputs_of(resume_graph(gm), inputs | {EXIT_HIDDEN: exit_hidden}))
    assert torch.equal(resumed[0], logits) and torch.equal(resumed[1], hidden)  # bit for bit: the step's own nodes
    assert torch.equal(gm.k_cache, k_cache) and torch.equal(gm.v_cache, v_cache)  # every draft K/V overwritten
    return draft_logits, exit_hidden, drafted, (k_cache, v_cache)


_COUNTERS: dict[int, "RowCounter"] = {}  # id(weight) -> its counter


class RowCounter:
    """Counts the token rows a linear layer sees: through its module's forward (a hook), or through the
    kernel set's linear on its weight (backends.kernels.linear) in programs compiled under the
    `counted_linears` fixture."""

    def __init__(self, module):
        self.rows = 0
        module.register_forward_hook(self)
        _COUNTERS[id(module.weight)] = self

    def __call__(self, module, args, output):
        self.rows += args[0].shape[-2]


@pytest.fixture
def onednn_linears(monkeypatch):
    """Programs compiled inside the test run every float linear on oneDNN (packed in the oneDNN
    lowering), as a model with large weights does: tiny models' weights are small enough for ATen's mm."""
    from specpass.backends.kernels import linear

    monkeypatch.setattr(linear, "ATEN_MAX_WEIGHT", 0)


@pytest.fixture
def counted_linears(monkeypatch):
    """Programs compiled inside the test count their linears' rows for the RowCounters of the weights."""
    from specpass.backends.kernels import linear

    real = linear.rows_linear

    def counting_rows_linear(x, weight, bias, onednn, sizes):
        counter = _COUNTERS.get(id(weight))
        if counter is not None:
            counter.rows += x.shape[-2]
        return real(x, weight, bias, onednn, sizes)

    monkeypatch.setattr(linear, "rows_linear", counting_rows_linear)
    yield
    _COUNTERS.clear()


def self_draft_taus_equal_to_hf_greedy(model, options: dict) -> list[float]:
    """Self-drafted greedy of three repetitive prompts equals HF greedy (asserted); returns the taus."""
    import specpass

    taus = []
    for seed in range(3):
        ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(seed)).repeat(1, 2)
        out = specpass.generate(model, ids, max_new_tokens=40, eos_token_id=[], options=options)
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                   eos_token_id=None)  # fmt: skip
        assert torch.equal(out.sequences, reference)
        taus.append(out.stats.tau)
    return taus


def check_default_model_greedy(model, cases, options: dict, min_tau: float) -> None:
    """On a code and a chat case: greedy equals HF's; then an EOS inside an accepted draft and the
    length limit end the generation where they must."""
    import specpass

    outputs = []
    for ids, reference in cases[::2]:
        outputs.append(specpass.generate(model, ids, max_new_tokens=NEW_TOKENS, options=options))
        assert torch.equal(outputs[-1].sequences, reference)
    ids, reference = cases[0]
    continuation = reference[0, ids.shape[1]:].tolist()
    out = outputs[0]  # its steps cover the whole continuation
    assert out.stats.tau > min_tau
    eos, index = token_inside_an_accepted_draft(continuation, out.stats.steps)
    stopped = specpass.generate(model, ids, max_new_tokens=NEW_TOKENS, options=options, eos_token_id=[eos])
    assert stopped.sequences[0, ids.shape[1]:].tolist() == continuation[: index + 1]
    assert stopped.stats.finish_reason == "eos"
    short = specpass.generate(model, ids, max_new_tokens=7, options=options)
    assert short.sequences[0, ids.shape[1]:].tolist() == continuation[:7] and short.stats.finish_reason == "length"


@pytest.fixture(scope="module")
def step_translations() -> list:
    """The steps this module's exports translated to ONNX, with their programs (see `translated_once`)."""
    return []


@contextlib.contextmanager
def translated_once(translations: list):
    """Inside, `export` runs torch.onnx.export on a step (~10 s for a tiny model) only when `translations`
    holds no step of the same code, outputs, dtype and weights, and otherwise reuses that step's ONNX
    program; the rest of an export (the passes, the passes' own graphs, saving, the ORT checks, the
    manifest) it still does itself."""
    from specpass.backends.onnx import export

    translate = export._torch_export

    def once(step, arch, dtype):
        key, state = (step.graph.python_code("self").src, arch, dtype, export.output_names(step)), step.state_dict()
        for seen, weights, program in translations:
            if seen == key and weights.keys() == state.keys() and all(torch.equal(weights[k], state[k]) for k in state):
                return program
        translations.append((key, {k: t.clone() for k, t in state.items()}, translate(step, arch, dtype)))
        return translations[-1][2]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "_torch_export", once)
        yield


@pytest.fixture(scope="session")
def default_model():
    import specpass

    torch.manual_seed(0)
    return specpass.load_default_model()


@pytest.fixture(scope="session")
def cases(default_model, tmp_path_factory):
    """(prompt ids, HF greedy with NEW_TOKENS = 48 new tokens) for HumanEval 0 and 2 (raw) and chat
    summaries 0 and 2: code 2's continuation ends at EOS after 46 tokens, the others at the length limit.
    Computed once per test run: pytest-xdist workers share this run's temporary root, and the first
    worker to get there writes the references (with their prompts) under a lock for the others."""
    from filelock import FileLock

    from specpass.research import prompts

    model, tokenizer = default_model
    code = [prompts.encode_code(tokenizer, p) for p in prompts.code_prompts(3, offset=0)[::2]]
    chat = [prompts.encode_chat(tokenizer, m) for m in prompts.chat_messages(3, offset=0)[::2]]
    inputs = code + chat
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"hf_greedy_cases_{NEW_TOKENS}.pt"
    with FileLock(f"{shared}.lock"):
        if shared.exists():
            stored = torch.load(shared)
            assert all(torch.equal(ids, s) for ids, (s, _) in zip(inputs, stored, strict=True))
            return stored
        computed = [(ids, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)) for ids in inputs]
        torch.save(computed, shared)
        return computed


def pytest_configure(config):
    """Under pytest-xdist the workers share the cores: each gets its share of threads (four OpenMP
    threads on two cores spin against each other: one test took 10x longer), and so do the CLI and
    torchrun subprocesses a worker starts, through OMP_NUM_THREADS. The controller hands out files in
    collection order (LONGEST_FILES first), not by their number of tests (xdist's default reorder)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


# The files that take the most worker time (docs/experiments.md, "Test suite time"), longest first.
# pytest-xdist (--dist loadfile) hands whole files to whichever worker is free, in collection order:
# with these first and the short files last, the workers finish together instead of one running a
# long file alone at the end.
LONGEST_FILES = ("test_onnx.py", "test_batch.py", "test_generate.py", "test_invariance.py", "test_sampling.py",
                 "test_kv_eviction.py", "test_tensor_parallel.py", "test_hf_hook.py", "test_gguf_lowering.py",
                 "test_gguf_compiled.py", "test_multi_candidate.py", "test_heads.py", "test_draft_designs.py", "test_families.py",
                 "test_program_state.py", "test_mixture.py", "test_property.py", "test_readme.py", "test_early_exit.py",
                 "test_exit_adapter.py", "test_hidden_transfer.py", "test_sparse_attention.py", "test_suffix.py", "test_models.py", "test_feature_draft.py", "test_layer_skip.py",
                 "test_lazy_llm.py", "test_lowering.py", "test_lowering_rewrites.py", "test_streaming.py", "test_ladder_residual.py", "test_trim_kv.py")  # 250 s down to 20 s each (2026-12-06); the others take < 20 s  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: each file's order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def recorded_logits(program):
    """Inside the block, `program` records, per sequence of each generate call (rows in prompt order), the
    logits [V] of every token it commits, prompt and emitted tokens in order: the logits each next token
    was chosen from. Yields the list of lists (one per sequence of the last call)."""
    records: list[list[torch.Tensor]] = []
    live: list[int] = []
    last: dict[str, torch.Tensor] = {}
    forward, verify, commit, keep_rows = program.forward, program.verify, program.commit, program.keep_rows

    def recording(run):
        def call(*args):
            logits, *rest = run(*args)  # forward: (logits, hidden); verify: (logits, hidden, resumed)
            last["logits"] = logits.detach().float().cpu()
            return (logits, *rest)

        return call

    def committing(layout, paths):
        if all(c == 0 for c in layout.committed):  # a new call's first forward
            records[:] = [[] for _ in paths]
            live[:] = range(len(paths))
        for b, path in enumerate(paths):
            records[live[b]].extend(last["logits"][b, list(path)])
        return commit(layout, paths)

    def keeping(keep, slots):
        live[:] = [live[i] for i in keep]
        return keep_rows(keep, slots)

    program.forward, program.verify = recording(forward), recording(verify)
    program.commit, program.keep_rows = committing, keeping
    try:
        yield records
    finally:
        del program.forward, program.verify, program.commit, program.keep_rows
