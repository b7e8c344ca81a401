"""Self-drafting on the default model: tau and tokens/s by exit layer (EarlyExit) or skipped layers
(LayerSkip), and chain depth.

Beside it, in the same run: HF greedy, specpass one-node trees (the lowering alone) and the
training-free combined tree. Every output is compared with HF greedy. Prompts: HumanEval[140:140+n]
(raw; the drafters' tuning range, never the bench's evaluation prompts). Writes
benchmarks/results/self-draft-<device>.json.

    python benchmarks/self_draft.py [--prompts 4] [--max-new-tokens 128] [--kinds exit skip] [--search 2 4 6]

--search N...: also LayerSkip with the sets `specpass.research.skip_search` finds (greedy, teacher-forced
agreement) on the model's own continuations of two other tuning prompts (HumanEval[150:152]), one
row per size N; the search's agreement per size goes into the JSON.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import specpass
from specpass.research import prompts as P
from specpass.research.bench import run_identity, write_report
from specpass.drafters import SelfDraft
from specpass.rewrites import EarlyExit, LayerSkip, TreeAttention

TUNING_OFFSET = 140
SETTINGS = ((8, 2), (16, 2), (20, 2), (24, 2), (24, 4), (27, 4))  # (exit layer, chain depth)
SKIP_SETTINGS = (((25, 27), 4), (tuple(range(20, 24)), 4), (tuple(range(12, 18)), 2))  # (skipped layers, depth)
SEARCH_OFFSET = 150  # the search's text: the model's continuations of HumanEval[150:152], not the measured prompts


def _rate(run, cases) -> dict:
    tokens, seconds, forwards, differing = 0, 0.0, 0, 0
    for ids, reference in cases:
        start = time.perf_counter()
        out = run(ids)
        seconds += time.perf_counter() - start
        sequences = out.sequences if hasattr(out, "sequences") else out
        differing += int(not torch.equal(sequences, reference))
        tokens += sequences.shape[1] - ids.shape[1]
        forwards += out.stats.target_forwards if hasattr(out, "stats") else sequences.shape[1] - ids.shape[1]
    return {"tokens_per_second": round(tokens / seconds, 2), "tau": round(tokens / forwards, 3),
            "outputs_differing_from_hf_greedy": differing}  # fmt: skip


def _searched(model, tokenizer, sizes, max_new_tokens: int) -> tuple[dict, dict]:
    """({row name: (skip set, depth)}, the search's report) for skip sets of each size in `sizes`."""
    from specpass.research.skip_search import search_skip_sets

    with torch.no_grad():
        text = torch.cat([model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
                          for ids in (P.encode_code(tokenizer, p) for p in P.code_prompts(2, offset=SEARCH_OFFSET))],
                         dim=1)  # fmt: skip
    started = time.perf_counter()
    found = search_skip_sets(model, text, max(sizes))
    report = {"text": f"HF greedy continuations of HumanEval[{SEARCH_OFFSET}:{SEARCH_OFFSET + 2}]",
              "positions": found.positions, "forwards": found.forwards,
              "seconds": round(time.perf_counter() - started, 1),
              "sets": [list(s) for s in found.sets], "agreement": list(found.agreement)}  # fmt: skip
    print("search", report, flush=True)
    return {f"layer_skip_searched{n}_depth4": (found.sets[n - 1], 4) for n in sizes}, report


def run(prompts: int, max_new_tokens: int, out_dir: str, kinds=("exit", "skip"), search=()) -> dict:
    model, tokenizer = specpass.load_default_model()
    ids_list = [P.encode_code(tokenizer, p) for p in P.code_prompts(prompts, offset=TUNING_OFFSET)]
    with torch.no_grad():
        cases = [(ids, model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)) for ids in ids_list]
    rows = {"hf_greedy": _rate(lambda ids: model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False), cases)}
    configs = {"specpass_one_node": {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))},
               "specpass_combined": {}}  # fmt: skip
    for layer, depth in SETTINGS if "exit" in kinds else ():
        configs[f"self_draft_exit{layer}_depth{depth}"] = {
            "pipeline": specpass.Pipeline(TreeAttention(16), EarlyExit(layer)), "drafter": SelfDraft(depth)}
    skips = {f"layer_skip_{'_'.join(map(str, skip))}_depth{depth}": (skip, depth)
             for skip, depth in (SKIP_SETTINGS if "skip" in kinds else ())}  # fmt: skip
    searched, search_report = _searched(model, tokenizer, search, max_new_tokens) if search else ({}, None)
    for name, (skip, depth) in (skips | searched).items():
        configs[name] = {"pipeline": specpass.Pipeline(TreeAttention(16), LayerSkip(skip)), "drafter": SelfDraft(depth)}
    for name, options in configs.items():
        specpass.compile_program(model, options)  # built (and its cost curve measured) before timing
        rows[name] = _rate(lambda ids: specpass.generate(model, ids, max_new_tokens, options=options), cases)
        print(f"{name:28s} {rows[name]}", flush=True)
    report = {**run_identity(torch.device("cpu")), "max_new_tokens": max_new_tokens,
              "prompts": f"HumanEval[{TUNING_OFFSET}:{TUNING_OFFSET + prompts}] raw (tuning range)",
              "exit_head": "the model's own final norm + LM head (no adapter); layer skip: the layers left "
                           "out, verified from the first of them", "results": rows,
              **({"skip_search": search_report} if search_report else {})}  # fmt: skip
    print(f"wrote {write_report(report, out_dir, 'self-draft-')}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--kinds", nargs="*", choices=("exit", "skip"), default=["exit", "skip"])
    parser.add_argument("--search", type=int, nargs="*", default=[], help="LayerSkip set sizes to search")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    report = run(args.prompts, args.max_new_tokens, args.out, args.kinds, args.search)
    return 1 if any(row["outputs_differing_from_hf_greedy"] for row in report["results"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
