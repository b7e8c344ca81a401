"""EMS's parts apart: the Global-Local score alone (no merging) and the merge at two similarities, beside
H2O (the score's global half) and SnapKV (its local half), on the tuning text.

    python benchmarks/ems_ablation.py [--length 2048] [--budget 0.25] [--out benchmarks/results]

Text: `long_context.library_sequences` over `TRAINING_SOURCES` (the text the similarity was chosen on,
kept apart from the evaluation's `EVAL_SOURCES`): one sequence of `length` tokens fed through the decode
path in 32-token pieces, perplexity and 128 greedy tokens against the full cache's (the `specpass
eval-kv` protocol, `research.eval_kv.perplexity_and_continuation`). Each configuration is a fresh
program, float32, one token a step (seconds: the text and the continuation). Writes ems-ablation-<device>.json.
"""

from __future__ import annotations

import argparse
import time

import torch

from specpass.backends.options import CompileOptions
from specpass.backends.runtime.program import SpeculativeProgram
from specpass.drafters.registry import drafter_by_name
from specpass.models import load_default_model
from specpass.passes import Pipeline
from specpass.research.bench import run_identity, write_report
from specpass.research.eval_kv import agreement, perplexity_and_continuation
from specpass.research.long_context import TRAINING_SOURCES, library_sequences
from specpass.rewrites import EMS, H2O, SnapKV, TreeAttention

CHUNK, NEW_TOKENS = 32, 128
CONFIGS = {
    "full": None,
    "h2o": lambda budget: H2O(budget, CHUNK),
    "snapkv": lambda budget: SnapKV(budget, CHUNK),
    "ems-score-only": lambda budget: EMS(budget, CHUNK, similarity=1.0),  # cosine 1: identical centred keys only
    "ems": lambda budget: EMS(budget, CHUNK),
    "ems-similarity-0.95": lambda budget: EMS(budget, CHUNK, similarity=0.95),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budget", type=float, default=0.25, help="cache slots, a fraction of the length")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    ids = library_sequences(tokenizer, args.length, 1, TRAINING_SOURCES)[0]
    slots = int(args.budget * args.length)
    rows, reference = [], None
    for name, make in CONFIGS.items():
        passes = [TreeAttention(CHUNK)] + ([make(slots)] if make else [])
        options = CompileOptions(pipeline=Pipeline(*passes), cache_size=args.length + NEW_TOKENS + CHUNK, budget=1,
                                 drafter=drafter_by_name("combined"))  # fmt: skip
        program, started = SpeculativeProgram(model, options), time.perf_counter()
        ppl, tokens = perplexity_and_continuation(program, ids, CHUNK, NEW_TOKENS)
        seconds = time.perf_counter() - started
        reference = tokens if make is None else reference
        rows.append({"config": name, "perplexity": ppl, "seconds": seconds, **agreement(tokens, reference)})
        print(f"{name:20s} ppl {ppl:8.3f}  first difference {rows[-1]['first_difference']:3d}  {seconds:6.1f} s", flush=True)
    report = run_identity(torch.device("cpu")) | {"length": args.length, "budget": args.budget, "slots": slots,
                                   "text": "TRAINING_SOURCES", "rows": rows}  # fmt: skip
    print("wrote", write_report(report, args.out, prefix="ems-ablation-"))


if __name__ == "__main__":
    main()
