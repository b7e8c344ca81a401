"""Self-speculation on the evaluation prompts: every self-draft mode beside the baselines, one run.

Rows: HF greedy and HF early exit (`assistant_early_exit` at the adapter's layer: the model's first
layers + its own LM head as the assistant), specpass one-node trees and the training-free combined
tree (the best settings without self-speculation), then the self-drafts: the plain exit and the
shipped exit adapter at the adapter's layer (chains of 2 and 4, and adaptive), layer skip with the
set the search found (docs/experiments.md), and the combined tree with the adapter's chain as one more
proposer (static and adaptive). Prompts: the benchmark's evaluation sets (HumanEval[120:120+n] raw,
and chat prompts [0:n]); every output is compared with HF greedy. Also the cost of one adapter draft
call against a one-token verify step (medians over 50 calls each, mid-cache).
Writes benchmarks/results/self-draft-eval-<device>.json.

    python benchmarks/self_draft_eval.py [--prompts 5] [--max-new-tokens 128] [--rows NAME ...] [--tag T]

--rows: only these rows (the HF and specpass baselines named among them), e.g. to re-measure the
adaptive rows beside one-node and the combined tree; --tag names the file self-draft-eval-<tag>-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import specpass
from specpass.research import prompts as P
from specpass.research.bench import CODE_OFFSET, run_identity, write_report
from specpass.drafters import Combined, PromptLookup, SelfDraft, TokenRecycling
from specpass.heads.exit_adapter import read_exit_adapter_config
from specpass.heads.io import shipped_heads
from specpass.ir.layout import SlotLayout
from specpass.rewrites import EarlyExit, LayerSkip, TreeAttention

SEARCHED_SKIP = (3, 25)  # skip_search's set of 2 on HumanEval[150:152] continuations (2026-11-26)


def _rows(layer: int) -> dict[str, dict]:
    adapter = specpass.Pipeline(TreeAttention(16), EarlyExit(layer, adapter="default"))
    adapter_tree = specpass.Pipeline(TreeAttention(64), EarlyExit(layer, adapter="default"))
    return {
        "specpass_one_node": {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))},
        "specpass_combined": {"pipeline": specpass.Pipeline(TreeAttention(64))},
        f"plain_exit{layer}_depth2": {"pipeline": specpass.Pipeline(TreeAttention(16), EarlyExit(layer)),
                                      "drafter": SelfDraft(2)},
        f"adapter{layer}_depth2": {"pipeline": adapter, "drafter": SelfDraft(2)},
        f"adapter{layer}_depth4": {"pipeline": adapter, "drafter": SelfDraft(4)},
        f"adapter{layer}_adaptive": {"pipeline": adapter, "drafter": SelfDraft(4, adaptive=True)},
        "layer_skip_3_25_depth4": {"pipeline": specpass.Pipeline(TreeAttention(16), LayerSkip(SEARCHED_SKIP)),
                                   "drafter": SelfDraft(4)},
        f"combined_adapter{layer}": {"pipeline": adapter_tree,
                                     "drafter": Combined(SelfDraft(4), PromptLookup(), TokenRecycling())},
        f"combined_adapter{layer}_adaptive": {
            "pipeline": adapter_tree, "drafter": Combined(SelfDraft(4, adaptive=True), PromptLookup(), TokenRecycling())},
    }  # fmt: skip


def _measure(run, cases) -> dict:
    tokens = forwards = differing = 0
    seconds = 0.0
    for ids, reference in cases:
        out, new, calls, spent = run(ids, reference.shape[1] - ids.shape[1])
        differing += int(not torch.equal(out, reference))
        tokens, forwards, seconds = tokens + new, forwards + calls, seconds + spent
    return {"tokens_per_second": round(tokens / seconds, 2), "tau": round(tokens / max(forwards, 1), 3),
            "outputs_differing_from_hf_greedy": differing}  # fmt: skip


def _speedups(results: dict, baseline: str) -> dict:
    """Each row's tokens/s over `baseline`'s, per prompt set."""
    return {name: {s: round(row[s]["tokens_per_second"] / results[baseline][s]["tokens_per_second"], 3) for s in row}
            for name, row in results.items()}  # fmt: skip


def _specpass(model, options):
    def run(ids, max_new_tokens):
        out = specpass.generate(model, ids, max_new_tokens, options=options)
        return out.sequences, out.stats.new_tokens, out.stats.target_forwards, out.stats.seconds

    return run


def _hf(model, **kwargs):
    """HF generate; its tau is not measured (an early-exit assistant's forwards are the model's own
    calls too), so it reports one target forward per token."""

    def run(ids, max_new_tokens):
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
        spent = time.perf_counter() - started
        return out, out.shape[1] - ids.shape[1], out.shape[1] - ids.shape[1], spent

    return run


@torch.no_grad()
def _call_costs(model, layer: int) -> dict:
    """Median seconds of one adapter draft call and of one one-token verify step, at slot 300."""
    options = {"pipeline": specpass.Pipeline(TreeAttention(16), EarlyExit(layer, adapter="default")),
               "drafter": SelfDraft(4)}  # fmt: skip
    program = specpass.compile_program(model, options)
    layout = SlotLayout.tree(300, torch.ones(1, 1, dtype=torch.bool))
    ids = torch.tensor([[1]])

    def median(fn) -> float:
        for _ in range(5):
            fn()
        times = []
        for _ in range(50):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    draft = median(lambda: program.draft(**layout.step_inputs(ids)))
    verify = median(lambda: program.forward(ids, SlotLayout.of((layout,))))
    return {"draft_call_ms": round(draft * 1e3, 3), "one_token_verify_ms": round(verify * 1e3, 3),
            "ratio": round(draft / verify, 3)}  # fmt: skip


def run(prompts: int, max_new_tokens: int, out_dir: str, rows: list[str] | None = None, tag: str | None = None) -> dict:
    model, tokenizer = specpass.load_default_model()
    layer = read_exit_adapter_config(shipped_heads("exit_adapter")).layer
    sets = {"code": [P.encode_code(tokenizer, p) for p in P.code_prompts(prompts, CODE_OFFSET)],
            "chat": [P.encode_chat(tokenizer, m) for m in P.chat_messages(prompts)]}  # fmt: skip
    with torch.no_grad():
        cases = {name: [(ids, model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)) for ids in ids_list]
                 for name, ids_list in sets.items()}  # fmt: skip
    costs = _call_costs(model, layer)
    print("costs", costs, flush=True)
    runners = {"hf_greedy": _hf(model), f"hf_early_exit{layer}": _hf(model, assistant_early_exit=layer)}
    configs = _rows(layer)
    if rows:
        unknown = set(rows) - set(runners) - set(configs)
        if unknown:
            raise SystemExit(f"unknown rows {sorted(unknown)}; choose from {[*runners, *configs]}")
        runners = {name: runner for name, runner in runners.items() if name in rows}
        configs = {name: options for name, options in configs.items() if name in rows}
    for name, options in configs.items():
        specpass.compile_program(model, options)  # built (and its cost curve measured) before timing
        runners[name] = _specpass(model, options)
    results = {name: {} for name in runners}
    for name, runner in runners.items():
        for set_name, set_cases in cases.items():
            results[name][set_name] = _measure(runner, set_cases)
        print(f"{name:32s} {results[name]}", flush=True)
    report = {**run_identity(torch.device("cpu")), "max_new_tokens": max_new_tokens,
              "prompt_sets": {"code": f"HumanEval[{CODE_OFFSET}:{CODE_OFFSET + prompts}] raw",
                              "chat": f"chat prompts [0:{prompts}]"},
              "exit_adapter": {"layer": layer, "held_out_agreement": read_exit_adapter_config(
                  shipped_heads("exit_adapter")).agreement},
              "hf_tau": "not measured (reported as 1.0)", "draft_call_cost": costs, "results": results,
              **({"speedup_over_specpass_combined": _speedups(results, "specpass_combined")}
                 if "specpass_combined" in results else {})}  # fmt: skip
    print(f"wrote {write_report(report, out_dir, f'self-draft-eval-{tag}-' if tag else 'self-draft-eval-')}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rows", nargs="+", help="only these rows (default: all)")
    parser.add_argument("--tag", help="names the results file")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    report = run(args.prompts, args.max_new_tokens, args.out, args.rows, args.tag)
    rows = report["results"].values()
    return 1 if any(row[s]["outputs_differing_from_hf_greedy"] for row in rows for s in row) else 0


if __name__ == "__main__":
    sys.exit(main())
