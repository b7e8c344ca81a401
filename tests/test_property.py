"""A property test: on random tiny models of every supported family (heads, KV heads, head size, layers,
vocabulary, sliding windows, local/global layer patterns, rope scaling), random prompts (with and
without repeats), random tree sizes, fixed budgets, drafters, batch rows, CPU lowerings (eager, oneDNN)
and dtypes (float32, bfloat16), speculative greedy equals the same lowering's one-token greedy of each
prompt alone token for token and logits bit for bit, and in float32 HF greedy token for token. The suite
runs a few derandomized examples per family; `benchmarks/property.py` runs many more
(SPECPASS_PROPERTY_EXAMPLES) and commits the count."""

import json
import os
from dataclasses import dataclass

import hypothesis  # a test dependency: without it the run fails
import pytest
import torch
import transformers
from conftest import TINY_ARCHS, TINY_CONFIGS, padded, recorded_logits

import specpass
from specpass.drafters import Combined, Drafter, DraftSession, PromptLookup, Suffix, TokenRecycling
from specpass.drafters.stats import AcceptanceStats
from specpass.drafters.best_first import Candidate
from specpass.rewrites import TreeAttention

st = hypothesis.strategies

CACHE = 64  # slots: a 20-token prompt, 24 new tokens and a 16-node tree fit
LOG = os.environ.get("SPECPASS_PROPERTY_LOG")  # a file to append each passing example to (JSON lines)
EXAMPLES = int(os.environ.get("SPECPASS_PROPERTY_EXAMPLES", "2"))  # per family (the first: the largest trees and batches)


@dataclass(frozen=True)
class Oracle(Drafter):
    """Knows each prompt's HF greedy continuation and drafts its next `lookahead` tokens behind wrong
    siblings (`decoys`, scored higher, so they come first in the tree and have wrong children of their
    own): the accepted nodes sit after nodes they must not see, and every wrong node is rejected."""

    references: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (prompt, prompt + HF greedy continuation)
    lookahead: int
    decoys: tuple[int, ...]

    def start(self, prompt, prefill, memory=None, draft=None, seed=0) -> DraftSession:
        return _OracleSession(self, next(full for p, full in self.references if p == tuple(prompt)))


class _OracleSession(DraftSession):
    def __init__(self, oracle: Oracle, reference: tuple[int, ...]):
        self.oracle, self.reference, self.stats = oracle, reference, AcceptanceStats({}, default=0.5)

    def candidates(self, tokens):
        n = len(tokens)
        truth = self.reference[n : n + self.oracle.lookahead] if tuple(tokens) == self.reference[:n] else ()
        return _OracleSource(truth, self.oracle.decoys)


class _OracleSource:
    def __init__(self, truth: tuple[int, ...], decoys: tuple[int, ...]):
        self.truth, self.decoys = truth, decoys

    def _level(self, depth: int, on_truth: bool) -> list[Candidate]:
        true = self.truth[depth] if on_truth and depth < len(self.truth) else None
        wrong = 0.9 if on_truth else 0.5  # a true node's wrong siblings come before it, their children last
        out = [Candidate(d, wrong, "decoy", (depth + 1, False)) for d in self.decoys if d != true]
        return out + ([Candidate(true, 0.85, "truth", (depth + 1, True))] if true is not None else [])

    def root_candidates(self) -> list[Candidate]:
        return self._level(0, True)

    def child_candidates(self, token: int, state: tuple[int, bool]) -> list[Candidate]:
        return self._level(*state)


DRAFTERS = ("combined", "oracle", "prompt_lookup", "token_recycling", "suffix")  # each joined by the oracle (lookahead 0: wrong drafts only)


@dataclass(frozen=True)
class Case:
    """One drawn example: the model's config arguments, its prompts and how to decode them."""

    arch: str
    config: dict
    seed: int
    peak: float  # the lm_head's scale: 8 makes the next-token law peaked (drafts accepted), 1 keeps random weights'
    context: float  # the attention output projections' scale: > 1 makes each token's law depend on the others
    prompts: tuple[tuple[int, ...], ...]  # one per batch row
    new_tokens: int
    max_nodes: int  # the tree size, below the narrowest sliding window
    budget: int  # nodes verified per step (fixed: no timed cost curve)
    drafter: str  # one of DRAFTERS
    lookahead: int  # the oracle's
    decoys: tuple[int, ...]  # the oracle's wrong tokens
    lowering: str  # a CPU lowering with the invariant kernels
    dtype: str  # "float32" or "bfloat16"


def most_first(high: int, low: int):
    """An int in [low, high], `high` first: Hypothesis starts from (and shrinks toward) its simplest
    example, and here the largest trees, batches and lookaheads are what can catch a wrong mask."""
    return st.integers(0, high - low).map(lambda k: high - k)


@st.composite
def configs(draw, arch: str) -> dict:
    """Config arguments for a random tiny model of `arch`, within what the family allows."""
    heads = draw(st.sampled_from([4, 2, 1]))
    head_dim = draw(st.sampled_from([16, 8]))  # rope pairs; Phi-3's half-rotary head stays even
    layers = draw(most_first(3, 1))
    config = dict(vocab_size=draw(st.integers(48, 160)), hidden_size=heads * head_dim,
                  intermediate_size=draw(st.sampled_from([16, 64])), num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0])),
                  max_position_embeddings=256, rope_theta=draw(st.sampled_from([100.0, 10000.0])))  # fmt: skip
    extra = dict(TINY_CONFIGS[arch][2])
    if "head_dim" in extra:  # Qwen3 and Gemma: a head size of their own, not hidden / heads
        extra["head_dim"] = draw(st.sampled_from([8, 16]))
        if "query_pre_attn_scalar" in TINY_CONFIGS[arch][2]:
            extra["query_pre_attn_scalar"] = draw(st.sampled_from([8, 16, 32]))
    if "sliding_window" in extra:
        extra["sliding_window"] = draw(most_first(24, 6))
    if "layer_types" in extra:  # Gemma: each layer local or global
        extra["layer_types"] = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                             min_size=layers, max_size=layers))  # fmt: skip
    if "max_window_layers" in extra:
        extra["max_window_layers"] = draw(st.integers(0, layers))
    if "no_rope_layers" in extra:  # SmolLM3: 1 = the layer uses rope
        extra["no_rope_layers"] = draw(st.lists(st.sampled_from([0, 1]), min_size=layers, max_size=layers))
    if "rope_scaling" in extra and extra["rope_scaling"]["rope_type"] == "llama3":
        extra["rope_scaling"] = extra["rope_scaling"] | {
            "factor": draw(st.sampled_from([2.0, 8.0, 32.0])),
            "original_max_position_embeddings": draw(st.sampled_from([8, 16, 64])),
        }
    if "rope_scaling" in extra and extra["rope_scaling"]["rope_type"] == "longrope":
        pairs = head_dim // 2
        factor = st.lists(st.sampled_from([1.0, 1.5, 2.0, 4.0, 8.0]), min_size=pairs, max_size=pairs)
        extra["rope_scaling"] = {"rope_type": "longrope", "short_factor": draw(factor), "long_factor": draw(factor)}
        extra["original_max_position_embeddings"] = draw(st.sampled_from([CACHE, 128]))  # exact below it
    if "embedding_multiplier" in extra:  # Granite's four scales
        for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            extra[key] = draw(st.sampled_from([0.1, 0.5, 1.0, 4.0]))
    return config | extra


@st.composite
def prompts(draw, vocab: int) -> tuple[int, ...]:
    """A random prompt of 1-20 tokens; half of them a piece repeated, so prompt lookup finds matches."""
    token = st.integers(3, vocab - 1)  # 0-2: pad, BOS and EOS in some configs
    piece = draw(st.lists(token, min_size=1, max_size=10))
    return tuple(piece * draw(st.sampled_from([2, 1])))


@st.composite
def cases(draw, arch: str) -> Case:
    config = draw(configs(arch))
    window = config.get("sliding_window") or 10**9
    max_nodes = draw(most_first(min(16, window - 1), 1))
    budget = max(1, max_nodes - draw(st.integers(0, 3)))  # mostly the whole tree
    rows = draw(most_first(3, 1))
    return Case(arch=arch, config=config, seed=draw(st.integers(0, 2**16)), peak=draw(st.sampled_from([1.0, 8.0])),
                context=draw(st.sampled_from([16.0, 4.0])),
                prompts=tuple(draw(prompts(config["vocab_size"])) for _ in range(rows)),
                new_tokens=draw(most_first(24, 1)), max_nodes=max_nodes, budget=budget,
                drafter=draw(st.sampled_from(DRAFTERS)), lookahead=draw(most_first(8, 0)),
                decoys=tuple(draw(st.sets(st.integers(3, config["vocab_size"] - 1), min_size=1, max_size=3))),
                lowering=draw(st.sampled_from(["onednn", "eager"])), dtype=draw(st.sampled_from(["float32", "bfloat16"])))  # fmt: skip


def build(case: Case) -> transformers.PreTrainedModel:
    model_class, config_class, _ = TINY_CONFIGS[case.arch]
    torch.manual_seed(case.seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**case.config)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(case.peak)
        for name, weight in model.named_parameters():
            if name.endswith("o_proj.weight"):  # random init leaves attention a small part of the residual stream
                weight.mul_(case.context)
    return model.to(getattr(torch, case.dtype))


def hf_greedy(model, prompt: tuple[int, ...], new_tokens: int) -> tuple[int, ...]:
    alone = torch.tensor([prompt])
    out = model.generate(alone, attention_mask=torch.ones_like(alone), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return tuple(out[0].tolist())


def drafter_of(case: Case, references) -> Drafter:
    oracle = Oracle(tuple(zip(case.prompts, references)), case.lookahead, case.decoys)
    joined = {"oracle": (), "prompt_lookup": (PromptLookup(),), "token_recycling": (TokenRecycling(),),
              "suffix": (Suffix(),), "combined": (PromptLookup(), TokenRecycling(), Suffix())}[case.drafter]  # fmt: skip
    return Combined(oracle, *joined)


def check(case: Case) -> None:
    """Speculative greedy (each row of a batch) equals the lowering's one-token greedy of the prompt
    alone, tokens and logits bit for bit; in float32 it equals HF greedy too."""
    model = build(case)
    references = [hf_greedy(model, prompt, case.new_tokens) for prompt in case.prompts]
    options = {"pipeline": specpass.Pipeline(TreeAttention(case.max_nodes)), "drafter": drafter_of(case, references),
               "budget": case.budget, "cache_size": CACHE, "lowering": case.lowering}  # fmt: skip
    rows, logits = decode(specpass.compile_program(model, options, rows=len(case.prompts)), case)
    one_node = specpass.compile_program(model, options | {"budget": 1})
    for row, row_logits, prompt, reference in zip(rows, logits, case.prompts, references, strict=True):
        (alone,), (alone_logits,) = decode(one_node, case, [prompt])
        assert row == alone and torch.equal(row_logits, alone_logits), case
        if case.dtype == "float32":
            assert tuple(row) == reference[len(prompt) :], case


def decode(program, case: Case, prompts=None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each row's new tokens and committed logits [N, V] of `prompts` (default: the case's) in one call."""
    prompts = case.prompts if prompts is None else prompts
    ids, mask = padded([torch.tensor(p) for p in prompts])
    with recorded_logits(program) as logits:
        out = specpass.generate(program, ids, case.new_tokens, attention_mask=mask, eos_token_id=[])
    rows = [out.sequences[0, ids.shape[1] :].tolist()] if len(prompts) == 1 else list(map(list, out.new_tokens))
    return rows, [torch.stack(row) for row in logits]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_speculative_greedy_equals_hf_greedy_on_random_models(arch):
    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))  # fmt: skip
    @hypothesis.given(cases(arch))
    def property_holds(case):
        check(case)
        if LOG:  # benchmarks/property.py counts the examples that passed
            with open(LOG, "a") as f:
                f.write(json.dumps({"arch": case.arch, "drafter": case.drafter, "rows": len(case.prompts),
                                    "max_nodes": case.max_nodes, "new_tokens": case.new_tokens,
                                    "lowering": case.lowering, "dtype": case.dtype}) + "\n")  # fmt: skip

    property_holds()
