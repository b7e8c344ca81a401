"""Sampling speed: specpass's speculative sampling against HF sampling, in the same run as greedy.

    python benchmarks/sampling.py [--prompts 6] [--max-new-tokens 128] [--out benchmarks/results]

Prompts: the benchmark's (HumanEval[120:], raw, and chat summaries [0:]). Settings: temperature 0.7,
top-p 0.9. Rows, each set on its own: HF greedy, specpass combined tree greedy, HF sampling, HF
assisted sampling (prompt lookup, 10-token chain), specpass one-node sampling, then each drafter
sampling: the prompt-lookup tree, the token-recycling tree, the combined tree, Hydra heads and Hydra +
combined (every speculative output checked against one-node sampling with the same seed).
The question it answers: how much of the greedy speed-up over HF does the combined tree keep when
sampling (speed-up = specpass tokens/s / HF tokens/s with the same decoding).
Writes sampling-<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import specpass
from specpass.research import prompts as P
from specpass.research.bench import CODE_OFFSET, run_identity, write_report
from specpass.drafters.registry import drafter_by_name

SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.9)


def _hf(model, sampling: bool):
    def run(ids, n, seed):
        torch.manual_seed(seed)
        kw = dict(do_sample=True, temperature=0.7, top_p=0.9) if sampling else dict(do_sample=False)
        return model.generate(ids, max_new_tokens=n, **kw)

    return run


def _hf_assisted(model):
    def run(ids, n, seed):
        torch.manual_seed(seed)
        return model.generate(ids, max_new_tokens=n, prompt_lookup_num_tokens=10, do_sample=True, temperature=0.7,
                              top_p=0.9)  # fmt: skip

    return run


def _specpass(program, sampling: bool):
    def run(ids, n, seed):
        kw = dict(SAMPLING, seed=seed) if sampling else {}
        return specpass.generate(program, ids, n, **kw)

    return run


def run(prompts_per_set: int, max_new_tokens: int, out_dir: str) -> dict:
    device = torch.device("cpu")
    model, tokenizer = specpass.load_default_model()
    heads = specpass.Pipeline(specpass.rewrites.TreeAttention(64), specpass.rewrites.DraftHeads("hydra"))
    programs = {  # drafter -> its program (the same compiled step for the first three: one cost curve)
        name: specpass.compile_program(model, {"drafter": drafter_by_name(name)} | ({"pipeline": heads} if "heads" in name else {}))
        for name in ("prompt-lookup", "token-recycling", "combined", "heads", "heads-combined")
    }  # fmt: skip
    combined = programs["combined"]
    one_node = specpass.compile_program(model, {"budget": 1, "pipeline": specpass.Pipeline(specpass.rewrites.TreeAttention(1))})
    for program in programs.values():
        program.cost_curve  # measured before timing
    rows = {
        "hf_greedy": _hf(model, False),
        "specpass_combined_greedy": _specpass(combined, False),
        "hf_sampling": _hf(model, True),
        "hf_assisted_sampling_pld": _hf_assisted(model),
        "specpass_one_node_sampling": _specpass(one_node, True),
        **{f"specpass_{name.replace('-', '_')}_sampling": _specpass(program, True) for name, program in programs.items()},
    }
    sets = {
        "code": [P.encode_code(tokenizer, p) for p in P.code_prompts(prompts_per_set, CODE_OFFSET)],
        "chat": [P.encode_chat(tokenizer, m) for m in P.chat_messages(prompts_per_set, 0)],
    }
    results: dict = {}
    for set_name, prompt_ids in sets.items():
        results[set_name] = {}
        plain_sampled = {}
        for name, runner in rows.items():
            for program in programs.values():
                program.forget()
            tokens = forwards = 0
            seconds = 0.0
            differing = 0
            speculative = name.startswith("specpass_") and name.endswith("_sampling") and "one_node" not in name
            for seed, ids in enumerate(prompt_ids):
                started = time.perf_counter()
                out = runner(ids, max_new_tokens, seed)
                seconds += time.perf_counter() - started
                sequences = out.sequences if isinstance(out, specpass.Generation) else out
                tokens += sequences.shape[1] - ids.shape[1]
                forwards += out.stats.target_forwards if isinstance(out, specpass.Generation) else 0
                if name == "specpass_one_node_sampling":
                    plain_sampled[seed] = sequences
                elif speculative:
                    differing += int(not torch.equal(sequences, plain_sampled[seed]))
            row = {"tokens_per_second": round(tokens / seconds, 2), "new_tokens": tokens}
            if forwards:
                row["tau"] = round(tokens / forwards, 3)
            if speculative:
                row["outputs_differing_from_one_node_sampling"] = differing
            results[set_name][name] = row
            print(f"{set_name} {name:28s} {row}", flush=True)
        r = results[set_name]
        greedy_speedup = r["specpass_combined_greedy"]["tokens_per_second"] / r["hf_greedy"]["tokens_per_second"]
        sampling_speedup = r["specpass_combined_sampling"]["tokens_per_second"] / r["hf_sampling"]["tokens_per_second"]
        r["speedup_kept_when_sampling"] = round(sampling_speedup / greedy_speedup, 3)
        print(f"{set_name}: greedy {greedy_speedup:.2f}x HF greedy, sampling {sampling_speedup:.2f}x HF sampling "
              f"-> {sampling_speedup / greedy_speedup:.0%} kept", flush=True)  # fmt: skip
    report = {**run_identity(device), "max_new_tokens": max_new_tokens, "prompts_per_set": prompts_per_set,
              "sampling": dict(SAMPLING, seed="prompt index"), "results": results}  # fmt: skip
    path = write_report(report, out_dir, "sampling-")
    print(f"wrote {path}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6, help="prompts per set (code, chat)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    report = run(args.prompts, args.max_new_tokens, args.out)
    differing = [row["outputs_differing_from_one_node_sampling"] for rows in report["results"].values()
                 for row in rows.values() if isinstance(row, dict) and "outputs_differing_from_one_node_sampling" in row]  # fmt: skip
    return 1 if any(differing) else 0


if __name__ == "__main__":
    sys.exit(main())
