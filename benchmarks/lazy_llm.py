"""LazyLLM on the default model: time to first token at long prompts against the full prefill, and what
the pruning costs (perplexity of the text's continuation, greedy agreement, passkey retrieval).

    python benchmarks/lazy_llm.py [--lengths 2048 4096 8192] [--passkey-length 4096] [--out benchmarks/results]

Prompts: `long_context.library_sequences` (standard-library source, the KV-eviction evaluation's text),
one sequence per length, its first L tokens the prompt and the next 256 the continuation. Each
configuration is a fresh program (float32, the `auto` lowering, one token a step): its prompt goes
through the decode loop's prefill (pieces of what the logits budget allows), timed twice (best of
two); the continuation is fed one token a step (perplexity); 64 greedy tokens are compared with the
full prefill's. "keep-all" is LazyLLM keeping every token (the prefill graph's own cost); "hf" is HF
generate to its first token on the same prompt. Passkey: `long_context.passkey_prompt`, 5 depths x 1
seed. Writes lazy-llm-<device>.json and .png.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import specpass
from specpass.backends.options import CompileOptions
from specpass.backends.runtime.decode import PREFILL_LOGITS_BYTES, feed
from specpass.backends.runtime.program import SpeculativeProgram
from specpass.backends.runtime.sequence import CacheCursor
from specpass.drafters.registry import drafter_by_name
from specpass.research.bench import run_identity, write_report
from specpass.research.eval_kv import agreement, passkey_hits
from specpass.research.long_context import library_sequences
from specpass.rewrites import LazyLLM, TreeAttention

CONTINUATION, GREEDY = 256, 64
CONFIGS = {
    "full": (),
    "keep-all": (LazyLLM(keep=(1.0, 1.0, 1.0)),),
    "lazy": (LazyLLM(),),
    "lazy-aggressive": (LazyLLM(keep=(0.5, 0.3, 0.15)),),
}
MEASURED = ("full", "lazy", "lazy-aggressive")  # quality measured (keep-all is the full model: tests/test_lazy_llm.py)


def _program(model, passes, cache_size: int) -> SpeculativeProgram:
    options = CompileOptions(pipeline=specpass.Pipeline(TreeAttention(1), *passes), cache_size=cache_size, budget=1,
                             drafter=drafter_by_name("combined"))  # fmt: skip
    return SpeculativeProgram(model, options)  # freed after use


@torch.no_grad()
def _prefill_and_continue(program, prompt: list[int], continuation: list[int]) -> tuple[float, float]:
    """(seconds of the prompt's prefill, perplexity of `continuation` fed one token a step after it)."""
    cursor = CacheCursor()
    piece = max(1, PREFILL_LOGITS_BYTES // (4 * program.vocab_size))
    started = time.perf_counter()
    for logits, _, _ in feed(program, [prompt], [cursor], piece):
        last = logits[0, -1]
    seconds = time.perf_counter() - started
    nll = -last.float().log_softmax(-1)[continuation[0]].item()
    for token, target in zip(continuation, continuation[1:]):
        (logits, _, _), = feed(program, [[token]], [cursor], piece=1)
        nll -= logits[0, -1].float().log_softmax(-1)[target].item()
    return seconds, math.exp(nll / len(continuation))


def run(lengths: list[int], passkey_length: int, out_dir: str) -> dict:
    model, tokenizer = specpass.load_default_model()
    rows = []
    for length in lengths:
        text = library_sequences(tokenizer, length + CONTINUATION, 1)[0]
        prompt, continuation = text[:length].tolist(), text[length:].tolist()
        reference = None
        hf = []
        for _ in range(2):  # HF's own prefill (its generate to the first token), the same prompt
            started = time.perf_counter()
            with torch.no_grad():
                model.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False)
            hf.append(round(time.perf_counter() - started, 3))
        rows.append({"length": length, "config": "hf", "ttft_seconds": hf, "ttft_best": min(hf)})
        print(rows[-1], flush=True)
        for name, passes in CONFIGS.items():
            program = _program(model, passes, length + CONTINUATION + 8)
            out = specpass.generate(program, torch.tensor([prompt]), GREEDY if name in MEASURED else 1, eos_token_id=[])
            row = {"length": length, "config": name, "pipeline": str(program.pipeline).splitlines()[-1],
                   "ttft_seconds": [round(out.stats.prefill_seconds, 3)]}  # fmt: skip
            if name in MEASURED:
                seconds, perplexity = _prefill_and_continue(program, prompt, continuation)
                row["ttft_seconds"].append(round(seconds, 3))
                tokens = out.sequences[0, length:].tolist()
                reference = tokens if name == "full" else reference
                row |= {"perplexity": round(perplexity, 4), "greedy": agreement(tokens, reference)}
            row["ttft_best"] = min(row["ttft_seconds"])
            rows.append(row)
            print(row, flush=True)
            del program
    passkey = {}
    for name in MEASURED if passkey_length else ():
        program = _program(model, CONFIGS[name], passkey_length + 64)
        passkey[name] = passkey_hits(program, tokenizer, passkey_length, seeds=1, depths=5)
        print(name, "passkey", passkey[name], flush=True)
        del program
    report = {**run_identity(torch.device("cpu")), "continuation_tokens": CONTINUATION, "greedy_tokens": GREEDY,
              "configs": {name: [str(p) for p in passes] for name, passes in CONFIGS.items()},
              "rows": rows, "passkey": {"length": passkey_length, "depths": 5, "seeds": 1, "hits": passkey}}  # fmt: skip
    path = write_report(report, out_dir, "lazy-llm-")
    _plot(rows, path.replace(".json", ".png"), report["device"])
    print(f"wrote {path}")
    return report


def _plot(rows: list[dict], path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / (len(CONFIGS) + 1)
    for i, name in enumerate(["hf", *CONFIGS]):
        best = [next(r["ttft_best"] for r in rows if r["length"] == n and r["config"] == name) for n in lengths]
        ax.bar([j + i * width for j in range(len(lengths))], best, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s, best of two)")
    ax.set_title(f"LazyLLM prefill, SmolLM2-135M float32 ({device})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--passkey-length", type=int, default=4096, help="0: skip the passkey")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    run(args.lengths, args.passkey_length, args.out)


if __name__ == "__main__":
    main()
