"""Tuning the feature drafter's depth and beam in the combined tree, on tuning prompts (HumanEval[0:4]
raw and chat [40:44]; the benchmark reports HumanEval[120:] and chat [0:]), Hydra + combined beside:
tokens/s and tau over 128 new tokens, each configuration in turn in one process.

    python benchmarks/feature_tuning.py

Prints one JSON line per configuration. A configuration repeated later in the process reuses its
cached program (equal options), whose Token Recycling memory the first pass filled: a higher tau.
"""
import json
import specpass
from specpass.research import prompts as P
from specpass.drafters import Combined, Feature, Heads, PromptLookup, TokenRecycling
from specpass.rewrites import DraftHeads, FeatureDraft, TreeAttention

model, tok = specpass.load_default_model()
prompts = [P.encode_code(tok, p) for p in P.code_prompts(4, 0)] + [P.encode_chat(tok, m) for m in P.chat_messages(4, 40)]
CONFIGS = [("hydra", None), (6, 8), (3, 4), (2, 4), (3, 8), (4, 4), ("hydra", None), (3, 4)]
for depth, beam in CONFIGS:
    if depth == "hydra":
        opts = {"pipeline": specpass.Pipeline(TreeAttention(64), DraftHeads(design="hydra")),
                "drafter": Combined(Heads(), PromptLookup(), TokenRecycling())}
    else:
        opts = {"pipeline": specpass.Pipeline(TreeAttention(64), FeatureDraft()),
                "drafter": Combined(Feature(depth=depth, beam=beam), PromptLookup(), TokenRecycling())}
    program = specpass.compile_program(model, opts)
    program.cost_curve
    specpass.generate(program, prompts[0], 16)
    toks = secs = fw = 0
    for ids in prompts:
        out = specpass.generate(program, ids, 128)
        toks += out.stats.new_tokens; secs += out.stats.seconds; fw += out.stats.target_forwards
    print(json.dumps({"depth": depth, "beam": beam, "tok_s": round(toks / secs, 1), "tau": round(toks / fw, 2)}), flush=True)
