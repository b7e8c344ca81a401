"""Clover's draft beside Hydra and the feature draft on the default model, alone and in the combined tree,
on the evaluation prompts (HumanEval[120:] raw and chat summaries [0:]), 64-node trees, in one run.

    python benchmarks/clover.py --clover DIR [--eagle3 DIR] [--prompts 4] [--max-new-tokens 128]

DIR: `specpass train-heads --kind clover --out DIR` (and `--kind feature` for an EAGLE-3 draft trained
with the same recipe, to compare the designs on equal data). Hydra and the feature draft are the ones
shipped (trained on more data). Every configuration runs every prompt in turn on one program (Token
Recycling's table carries over within a set, each set starts cold): new tokens / wall seconds, tau,
and how many outputs differ from HF greedy's (expected 0: float32). HF greedy is timed in the same
run. Writes clover-<device>.json.
"""

from __future__ import annotations

import argparse
import time

import torch

import specpass
from specpass.drafters import Combined, Feature, Heads, PromptLookup, TokenRecycling
from specpass.heads.io import read_feature_config
from specpass.research import prompts as P
from specpass.research.bench import run_identity, timed_generations, write_report
from specpass.rewrites import DraftHeads, FeatureDraft, TreeAttention


def configurations(clover: str, eagle3: str | None) -> dict[str, dict]:
    drafts = {"hydra": DraftHeads(design="hydra"), "feature": FeatureDraft(), "clover": FeatureDraft(clover)}
    if eagle3:
        drafts["eagle3_same_recipe"] = FeatureDraft(eagle3)
    configs = {"plain": {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))}}
    for name, draft in drafts.items():
        alone = Heads() if name == "hydra" else Feature()
        configs[name] = {"pipeline": specpass.Pipeline(TreeAttention(64), draft), "drafter": alone}
        configs[f"{name}_combined"] = {"pipeline": specpass.Pipeline(TreeAttention(64), draft),
                                       "drafter": Combined(alone, PromptLookup(), TokenRecycling())}  # fmt: skip
    return configs


def _trained(directory: str) -> dict:
    """What a trained draft is (its design and held-out top-1 by depth), not where it was written."""
    config = read_feature_config(directory)
    return {"design": config.design, "held_out_top1_by_depth": [row[0] for row in config.accuracy]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clover", required=True, metavar="DIR")
    parser.add_argument("--eagle3", metavar="DIR")
    parser.add_argument("--prompts", type=int, default=4, help="per set (code, chat)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    model, tokenizer = specpass.load_default_model()
    sets = {"code": [P.encode_code(tokenizer, p) for p in P.code_prompts(args.prompts, 120)],
            "chat": [P.encode_chat(tokenizer, m) for m in P.chat_messages(args.prompts, 0)]}  # fmt: skip
    references, hf_seconds = {}, {}
    for set_name, prompts in sets.items():
        started = time.perf_counter()
        references[set_name] = [model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
                                for ids in prompts]  # fmt: skip
        hf_seconds[set_name] = time.perf_counter() - started
    results = {}
    for set_name, prompts in sets.items():
        new = sum(r.shape[1] - ids.shape[1] for r, ids in zip(references[set_name], prompts))
        results[f"hf_greedy/{set_name}"] = {"tokens": new, "seconds": round(hf_seconds[set_name], 2),
                                            "tokens_per_second": round(new / hf_seconds[set_name], 1)}  # fmt: skip
    for name, options in configurations(args.clover, args.eagle3).items():
        program = specpass.compile_program(model, options)
        program.cost_curve  # measured before timing
        specpass.generate(program, P.encode_chat(tokenizer, [{"role": "user", "content": "Say hello."}]), 16)
        for set_name, prompts in sets.items():
            program.forget()
            results[f"{name}/{set_name}"] = timed_generations(program, prompts, references[set_name],
                                                               args.max_new_tokens)  # fmt: skip
            print(name, set_name, results[f"{name}/{set_name}"], flush=True)
    for key, entry in results.items():
        hf = results[f"hf_greedy/{key.split('/')[1]}"]
        entry["x_hf_greedy"] = round(entry["tokens_per_second"] / hf["tokens_per_second"], 3)
    report = {
        **run_identity(torch.device("cpu")),
        "prompts": f"HumanEval[120:{120 + args.prompts}] raw, chat summaries [0:{args.prompts}]",
        "max_new_tokens": args.max_new_tokens,
        "drafts": {"hydra": "shipped", "feature": "shipped", "clover": _trained(args.clover),
                   "eagle3_same_recipe": _trained(args.eagle3) if args.eagle3 else None},  # fmt: skip
        "trees": "TreeAttention(64), the tree size per step from the measured cost curve (the CPU default)",
        "results": results,
    }
    print("wrote", write_report(report, args.out, prefix="clover-"))


if __name__ == "__main__":
    main()
