"""Does a program's output depend on the thread count? Teacher-forced logits at each thread count, bit for bit.

    python benchmarks/thread_count.py [--prompts 4] [--tokens 96] [--threads 1 2] [--out benchmarks/results]

For each CPU lowering of the default model (float32 and bfloat16 `auto`, `gguf`, and `gguf-compiled`
where a C++ compiler is at hand): a program of one-node trees; per prompt (the benchmark's code and chat
evaluation prompts, alternating) its greedy continuation at the first thread count, then the prompt and
that continuation as one chain forward at every thread count, and its last 8 tokens one at a time. Since
a program is one function (checked at build: tests/test_invariance.py), the chain's logits are every
token's; the one-token steps are compared too. Reported per lowering: tokens whose logits differ
between thread counts (of all compared), the largest difference, and whether the greedy tokens change.
Writes thread-count-<device>.json.
"""

from __future__ import annotations

import argparse
import shutil

import torch

import specpass
from specpass.ir.layout import SlotLayout
from specpass.research import prompts as P
from specpass.research.bench import CODE_OFFSET, run_identity, write_report

ONE_AT_A_TIME = 8  # last tokens also run as one-token steps


def prompts(count: int, tokenizer) -> list[torch.Tensor]:
    code = [P.encode_code(tokenizer, p) for p in P.code_prompts((count + 1) // 2, CODE_OFFSET)]
    chat = [P.encode_chat(tokenizer, m) for m in P.chat_messages(count // 2)]
    return [ids for pair in zip(code, chat + [None]) for ids in pair if ids is not None][:count]


def logits_of(program, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [n, V] of `tokens` [n] (one chain forward), then of the last ONE_AT_A_TIME one at a time."""
    n = tokens.shape[0]
    whole = _forward(program, tokens, SlotLayout.chain(0, n))
    head = n - ONE_AT_A_TIME
    _forward(program, tokens[:head], SlotLayout.chain(0, head))
    program.compact(SlotLayout.of([SlotLayout.chain(0, head)]), [list(range(head))])
    alone = []
    for i in range(head, n):
        alone.append(_forward(program, tokens[i : i + 1], SlotLayout.chain(i, 1)))
        program.compact(SlotLayout.of([SlotLayout.chain(i, 1)]), [[0]])
    return torch.cat([whole, *alone])  # [n + ONE_AT_A_TIME, V]


def _forward(program, tokens: torch.Tensor, layout: SlotLayout) -> torch.Tensor:
    rows = SlotLayout.of([layout])
    return program.forward(rows.pad_tokens([tokens]), rows)[0][0].float().cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    configs = {"float32_auto": (torch.float32, "auto"), "bfloat16_auto": (torch.bfloat16, "auto"),
               "gguf": (torch.float32, "gguf")}  # fmt: skip
    if shutil.which("c++") or shutil.which("g++"):
        configs["gguf_compiled"] = (torch.float32, "gguf-compiled")
    results = {}
    first = args.threads[0]
    for name, (dtype, lowering) in configs.items():
        model, tokenizer = specpass.load_default_model(dtype=dtype)
        torch.set_num_threads(first)
        program = specpass.compile_program(model, specpass.CompileOptions(budget=1, lowering=lowering))
        compared = differing = tokens_changed = 0
        gap = 0.0
        for ids in prompts(args.prompts, tokenizer):
            torch.set_num_threads(first)
            out = specpass.generate(program, ids, args.tokens, eos_token_id=[])
            chain = out.sequences[0]
            reference = logits_of(program, chain)
            for threads in args.threads[1:]:
                torch.set_num_threads(threads)
                got = logits_of(program, chain)
                rows_differ = (got != reference).any(-1)
                compared += rows_differ.numel()
                differing += int(rows_differ.sum())
                gap = max(gap, (got - reference).abs().max().item())
                tokens_changed += int((got.argmax(-1) != reference.argmax(-1)).sum())
        results[name] = {"tokens_compared": compared, "tokens_whose_logits_differ": differing,
                         "largest_difference": gap, "argmax_changed": tokens_changed}  # fmt: skip
        print(name, results[name], flush=True)
        torch.set_num_threads(first)
    report = {**run_identity(torch.device("cpu")), "threads": args.threads, "prompts": args.prompts,
              "greedy_tokens": args.tokens, "one_at_a_time": ONE_AT_A_TIME, "results": results}  # fmt: skip
    print("wrote", write_report(report, args.out, prefix="thread-count-"))


if __name__ == "__main__":
    main()
