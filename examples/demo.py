"""Speculative generation on the embedded default model, beside plain greedy.

    python examples/demo.py ["your prompt"]
"""

import sys
import time

import torch

import specpass
from specpass.research.prompts import encode_chat

prompt = sys.argv[1] if len(sys.argv) > 1 else "Write a Python function that returns the n-th Fibonacci number."

model, tokenizer = specpass.load_default_model()  # SmolLM2-135M-Instruct, float32, CPU
fast = torch.compile(
    model,
    backend="specpass",  # found through the torch_dynamo_backends entry point
    options={
        "pipeline": specpass.Pipeline(specpass.rewrites.TreeAttention(max_nodes=64)),
        "drafter": specpass.drafters.Combined(specpass.drafters.PromptLookup(), specpass.drafters.TokenRecycling()),
    },
)
ids = encode_chat(tokenizer, [{"role": "user", "content": prompt}])
program = specpass.compile_program(fast)  # capture -> passes -> lowering, checked to be one function
# Warm-up, before timing, as any benchmark does: the cost curve is measured, and the drafting kernels
# (numba) compile on their first call (cached on disk after the first run). Then the drafter forgets it.
specpass.generate(fast, ids, max_new_tokens=8)
model.generate(ids, max_new_tokens=8, do_sample=False)
program.forget()

t0 = time.perf_counter()
greedy = model.generate(ids, max_new_tokens=128, do_sample=False)
greedy_rate = (greedy.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)
out = specpass.generate(fast, ids, max_new_tokens=128)

print(tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True))
print(f"\nplain greedy : {greedy_rate:6.1f} tokens/s, tau 1.00")
print(f"specpass     : {out.stats.tokens_per_second:6.1f} tokens/s, tau {out.stats.tau:.2f} "
      f"({out.stats.tokens_per_second / greedy_rate:.2f}x)")  # fmt: skip
print(f"identical to plain greedy: {torch.equal(out.sequences, greedy)}")
print(out.stats)
