"""Early-exit self-drafting on the default model: tau and tokens/s by exit layer and chain depth.

Beside it, in the same run: HF greedy, specpass one-node trees (the lowering alone) and the
training-free combined tree. Every output is compared with HF greedy. Prompts: HumanEval[140:140+n]
(raw; the drafters' tuning range, never the bench's evaluation prompts). Writes
benchmarks/results/self-draft-<device>.json.

    python benchmarks/self_draft.py [--prompts 4] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import specpass
from specpass import prompts as P
from specpass.bench import run_identity, write_report
from specpass.drafters import SelfDraft
from specpass.rewrites import EarlyExit, TreeAttention

TUNING_OFFSET = 140
SETTINGS = ((8, 2), (16, 2), (20, 2), (24, 2), (24, 4), (27, 4))  # (exit layer, chain depth)


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


def run(prompts: int, max_new_tokens: int, out_dir: str) -> dict:
    model, tokenizer = specpass.load_default_model()
    ids_list = [P.encode_code(tokenizer, p) for p in P.code_prompts(prompts, offset=TUNING_OFFSET)]
    with torch.no_grad():
        cases = [(ids, model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)) for ids in ids_list]
    rows = {"hf_greedy": _rate(lambda ids: model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False), cases)}
    configs = {"specpass_one_node": {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))},
               "specpass_combined": {}}  # fmt: skip
    for layer, depth in SETTINGS:
        configs[f"self_draft_exit{layer}_depth{depth}"] = {
            "pipeline": specpass.Pipeline(TreeAttention(16), EarlyExit(layer)), "drafter": SelfDraft(depth)}
    for name, options in configs.items():
        specpass.compile_program(model, options)  # built (and its cost curve measured) before timing
        rows[name] = _rate(lambda ids: specpass.generate(model, ids, max_new_tokens, options=options), cases)
        print(f"{name:28s} {rows[name]}", flush=True)
    report = {**run_identity(torch.device("cpu")), "max_new_tokens": max_new_tokens,
              "prompts": f"HumanEval[{TUNING_OFFSET}:{TUNING_OFFSET + prompts}] raw (tuning range)",
              "exit_head": "the model's own final norm + LM head (no adapter)", "results": rows}  # fmt: skip
    print(f"wrote {write_report(report, out_dir, 'self-draft-')}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    report = run(args.prompts, args.max_new_tokens, args.out)
    return 1 if any(row["outputs_differing_from_hf_greedy"] for row in report["results"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
