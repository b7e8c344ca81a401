"""Suffix drafting on a workload whose outputs repeat across requests, beside the combined tree without it.

    python benchmarks/suffix.py [--prompts 6] [--max-new-tokens 128] [--out benchmarks/results]

Each configuration gets a fresh program and decodes the evaluation prompts (HumanEval[120:], raw, and
chat summaries [0:]) twice: round 1 is the normal benchmark (the store holds only what this round has
decoded so far), round 2 asks the same prompts again (the store holds round 1's answers; Token
Recycling's table carries over as well, its paper's hot start). Configurations: the combined tree
(prompt lookup + Token Recycling) and the same with the suffix proposer, default cost budget. Per round:
tokens/s, τ, outputs equal to HF greedy. Writes suffix-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import specpass
from specpass.research import prompts as P
from specpass.research.bench import CODE_OFFSET, evaluation_sets, run_identity, write_report
from specpass.drafters import Combined, PromptLookup, Suffix, TokenRecycling

CONFIGS = {"combined": lambda: Combined(PromptLookup(), TokenRecycling()),
           "combined_suffix": lambda: Combined(PromptLookup(), TokenRecycling(), Suffix())}  # fmt: skip


def run(prompts_per_set: int, max_new_tokens: int, out_dir: str) -> dict:
    model, tokenizer = specpass.load_default_model()
    sets = {
        "code": [P.encode_code(tokenizer, p) for p in P.code_prompts(prompts_per_set, CODE_OFFSET)],
        "chat": [P.encode_chat(tokenizer, m) for m in P.chat_messages(prompts_per_set, 0)],
    }
    references = {name: [model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False) for ids in prompts]
                  for name, prompts in sets.items()}  # fmt: skip
    results: dict = {}
    for config, drafter in CONFIGS.items():
        results[config] = {}
        for set_name, prompts in sets.items():
            program = specpass.compile_program(model, {"drafter": drafter()})
            program.cost_curve  # measured before timing
            program.forget()  # each set starts with an empty store and table (programs are shared by options)
            for round_name in ("round_1_new", "round_2_asked_again"):
                tokens = forwards = differing = 0
                seconds = 0.0
                for ids, reference in zip(prompts, references[set_name]):
                    start = time.perf_counter()
                    out = specpass.generate(program, ids, max_new_tokens=max_new_tokens)
                    seconds += time.perf_counter() - start
                    tokens += out.stats.new_tokens
                    forwards += out.stats.target_forwards
                    differing += int(not torch.equal(out.sequences, reference))
                results[config].setdefault(set_name, {})[round_name] = {
                    "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 1),
                    "tau": round(tokens / forwards, 3), "outputs_differing_from_hf_greedy": differing}  # fmt: skip
                print(config, set_name, round_name, results[config][set_name][round_name], flush=True)
    for set_name in sets:
        for round_name in ("round_1_new", "round_2_asked_again"):
            base, with_suffix = (results[c][set_name][round_name] for c in CONFIGS)
            results.setdefault("ratios", {}).setdefault(set_name, {})[round_name] = {
                "tau": round(with_suffix["tau"] / base["tau"], 3),
                "tokens_per_second": round(with_suffix["tokens_per_second"] / base["tokens_per_second"], 3)}  # fmt: skip
    report = {**run_identity(torch.device("cpu")), **evaluation_sets(prompts_per_set, max_new_tokens),
              "configs": {c: repr(d()) for c, d in CONFIGS.items()}, "results": results}  # fmt: skip
    print(write_report(report, out_dir, "suffix-"))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    report = run(args.prompts, args.max_new_tokens, args.out)
    differing = sum(r["outputs_differing_from_hf_greedy"] for c in CONFIGS for s in report["results"][c].values()
                    for r in s.values())  # fmt: skip
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
