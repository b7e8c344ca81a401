"""The multi-candidate rule against sample-and-match, on drafts with draft probabilities.

    python benchmarks/multi_candidate.py [--prompts 6] [--max-new-tokens 128] [--out benchmarks/results]

Drafts: the shipped Medusa and Hydra heads, candidates drawn without replacement from each head's
softmax at T = 1 (`Heads(tree="static", temperature=1.0)`), cost budget. Target: sampling at T = 1
(and T = 0.7, top-p 0.9 for Hydra). Each pair of rows runs the same prompts with the same seeds,
accepting by the multi-candidate rule (acceptance="auto") or by sample-and-match ("match"), beside
the heads' top-k candidates under sample-and-match (what the combined tree uses). Prompts: the
benchmark's (HumanEval[120:], raw, and chat summaries [0:]). Reported per row: tokens per decode step
(the bonus token included), drafted tokens accepted per step, tau, tokens/s. Every "match" output is
checked against one-node sampling with the same seed. Writes multi-candidate-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import specpass
from specpass.research import prompts as P
from specpass.research.bench import CODE_OFFSET, run_identity, write_report
from specpass.drafters import Heads
from specpass.rewrites import DraftHeads, TreeAttention

SETTINGS = {"T1.0": dict(do_sample=True, temperature=1.0), "T0.7-top-p0.9": dict(do_sample=True, temperature=0.7, top_p=0.9)}


def run(prompts_per_set: int, max_new_tokens: int, out_dir: str) -> dict:
    model, tokenizer = specpass.load_default_model()
    programs = {}
    for kind in ("medusa", "hydra"):
        pipeline = specpass.Pipeline(TreeAttention(64), DraftHeads(kind))
        programs[f"{kind}_drawn"] = specpass.compile_program(model, {"pipeline": pipeline, "drafter": Heads(tree="static", temperature=1.0)})
        programs[f"{kind}_top_k"] = specpass.compile_program(model, {"pipeline": pipeline, "drafter": Heads(tree="static")})
    one_node = specpass.compile_program(model, {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))})
    for program in programs.values():
        program.cost_curve  # measured before timing
    rows = [  # (row name, program, acceptance, setting)
        *[(f"{kind}_drawn_{rule}", f"{kind}_drawn", rule, "T1.0") for kind in ("medusa", "hydra") for rule in ("auto", "match")],
        *[(f"{kind}_top_k_match", f"{kind}_top_k", "match", "T1.0") for kind in ("medusa", "hydra")],
        ("hydra_drawn_auto", "hydra_drawn", "auto", "T0.7-top-p0.9"),
        ("hydra_drawn_match", "hydra_drawn", "match", "T0.7-top-p0.9"),
        ("hydra_top_k_match", "hydra_top_k", "match", "T0.7-top-p0.9"),
    ]
    sets = {
        "code": [P.encode_code(tokenizer, p) for p in P.code_prompts(prompts_per_set, CODE_OFFSET)],
        "chat": [P.encode_chat(tokenizer, m) for m in P.chat_messages(prompts_per_set, 0)],
    }
    results: dict = {}
    for set_name, prompt_ids in sets.items():
        results[set_name] = {}
        references: dict = {}
        for row_name, program_name, rule, setting in rows:
            program = programs[program_name]
            tokens = forwards = steps = 0
            seconds = 0.0
            differing = 0
            for seed, ids in enumerate(prompt_ids):
                sampling = dict(SETTINGS[setting], seed=seed)
                started = time.perf_counter()
                out = specpass.generate(program, ids, max_new_tokens, acceptance=rule, **sampling)
                seconds += time.perf_counter() - started
                tokens += out.stats.new_tokens
                forwards += out.stats.target_forwards
                steps += len(out.stats.steps)
                if rule == "match":
                    key = (setting, seed)
                    if key not in references:
                        references[key] = specpass.generate(one_node, ids, max_new_tokens, **sampling).sequences
                    differing += int(not torch.equal(out.sequences, references[key]))
            per_step = (tokens - len(prompt_ids)) / steps  # the prefill's token is no decode step's
            row = {"setting": setting, "acceptance": rule, "tokens_per_step": round(per_step, 3),
                   "accepted_drafts_per_step": round(per_step - 1, 3), "tau": round(tokens / forwards, 3),
                   "tokens_per_second": round(tokens / seconds, 2), "new_tokens": tokens}  # fmt: skip
            if rule == "match":
                row["outputs_differing_from_one_node_sampling"] = differing
            results[set_name][f"{row_name}@{setting}"] = row
            print(f"{set_name} {row_name:20s} {setting:14s} {row}", flush=True)
        r = results[set_name]
        for kind, setting in (("medusa", "T1.0"), ("hydra", "T1.0"), ("hydra", "T0.7-top-p0.9")):
            rule, match = r[f"{kind}_drawn_auto@{setting}"], r[f"{kind}_drawn_match@{setting}"]
            gain = rule["tokens_per_step"] / match["tokens_per_step"] - 1
            r[f"{kind}_rule_gain_tokens_per_step@{setting}"] = round(gain, 3)
            print(f"{set_name} {kind} {setting}: multi-candidate rule {gain:+.1%} tokens per step over sample-and-match", flush=True)
    report = {**run_identity(torch.device("cpu")),
              "max_new_tokens": max_new_tokens, "prompts_per_set": prompts_per_set,
              "drafts": "Heads(tree='static', temperature=1.0) / Heads(tree='static'), cost budget",
              "seed": "prompt index", "results": results}  # fmt: skip
    path = write_report(report, out_dir, "multi-candidate-")
    print(f"wrote {path}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6, help="prompts per set (code, chat)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    report = run(args.prompts, args.max_new_tokens, args.out)
    differing = [row.get("outputs_differing_from_one_node_sampling", 0) for s in report["results"].values()
                 for row in s.values() if isinstance(row, dict)]  # fmt: skip
    return 1 if any(differing) else 0


if __name__ == "__main__":
    sys.exit(main())
