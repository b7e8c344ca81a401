"""What the ladder-residual rewrite costs the default model without retraining (issue 26).

For the top 0, 2, 4, 25 %, 50 % and 100 % of SmolLM2-135M-Instruct's 30 layers laddered
(rewrites.LadderResidual.top), float32 on the CPU:

- `perplexity_ratio`: perplexity of the laddered model / the original's, on held-out text (the first
  TEXT_TOKENS tokens of each of TEXT_MODULES' Python sources, one prefill each through the step);
- `top1_agreement`: fraction of those positions where the laddered model's next-token argmax is the
  original's;
- greedy agreement over 128 new tokens on code and chat prompts (HumanEval[150:154], chat summaries
  [20:24]; nothing is tuned on them): `identical_outputs`, and `common_prefix_fraction`, the mean
  fraction of HF greedy's continuation (original model) generated before the first difference;
- `tau_combined`: τ of the training-free combined tree on the laddered model, and whether its output
  equals the laddered model's own one-node greedy (speculation adds no change of its own).

Writes benchmarks/results/ladder-quality-<device>.json.

    python benchmarks/ladder_quality.py [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import inspect
import importlib
import math

import torch
import torch.nn.functional as F

import specpass
from specpass import prompts as P
from specpass.bench import run_identity, write_report
from specpass.ir import SlotLayout
from specpass.rewrites import LadderResidual, TreeAttention

TEXT_MODULES = ("fractions", "textwrap", "shlex", "calendar")
TEXT_TOKENS = 512
CODE_OFFSET, CHAT_OFFSET, PROMPTS = 150, 20, 4


def _ladder_counts(num_layers: int) -> dict[str, int]:
    return {"0": 0, "2": 2, "4": 4, "25%": round(0.25 * num_layers), "50%": num_layers // 2, "100%": num_layers}


@torch.no_grad()
def _text_logits(program, texts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits [T, V] of each text as one prefill through the program's step."""
    return [program.forward(ids, SlotLayout.chain(0, len(ids)))[0].float() for ids in texts]


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def run(max_new_tokens: int, out_dir: str) -> dict:
    model, tokenizer = specpass.load_default_model()
    num_layers = model.config.num_hidden_layers
    texts = [tokenizer(inspect.getsource(importlib.import_module(m)), return_tensors="pt").input_ids[0, :TEXT_TOKENS]
             for m in TEXT_MODULES]  # fmt: skip
    cases = [P.encode_code(tokenizer, p) for p in P.code_prompts(PROMPTS, offset=CODE_OFFSET)]
    cases += [P.encode_chat(tokenizer, m) for m in P.chat_messages(PROMPTS, offset=CHAT_OFFSET)]
    with torch.no_grad():
        references = [model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False) for ids in cases]
    original_logits = None
    rows = {}
    for label, count in _ladder_counts(num_layers).items():
        ladder = LadderResidual.top(count)
        one_node = {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1), ladder)}
        combined = {"pipeline": specpass.Pipeline(TreeAttention(), ladder)}
        logits = _text_logits(specpass.compile_program(model, one_node), texts)
        original_logits = logits if original_logits is None else original_logits
        nll = torch.cat([F.cross_entropy(lg[:-1], ids[1:], reduction="none") for lg, ids in zip(logits, texts)])
        original_nll = torch.cat([F.cross_entropy(lg[:-1], ids[1:], reduction="none")
                                  for lg, ids in zip(original_logits, texts)])  # fmt: skip
        agree = torch.cat([(lg.argmax(-1) == og.argmax(-1)).float() for lg, og in zip(logits, original_logits)])
        identical, prefixes, same_as_own, tokens, forwards = 0, [], 0, 0, 0
        for ids, reference in zip(cases, references):
            own = specpass.generate(model, ids, max_new_tokens, options=one_node).sequences
            fast = specpass.generate(model, ids, max_new_tokens, options=combined)
            identical += int(torch.equal(own, reference))
            expected = reference[0, ids.shape[1]:]
            prefixes.append(_common_prefix(own[0, ids.shape[1]:], expected) / len(expected))
            same_as_own += int(torch.equal(fast.sequences, own))
            tokens += fast.stats.new_tokens
            forwards += fast.stats.target_forwards
        rows[label] = {
            "laddered_layers": count,
            "perplexity": round(math.exp(nll.mean()), 3),
            "perplexity_ratio": round(math.exp(nll.mean() - original_nll.mean()), 4),
            "top1_agreement": round(float(agree.mean()), 4),
            "identical_outputs": f"{identical}/{len(cases)}",
            "common_prefix_fraction": round(sum(prefixes) / len(prefixes), 3),
            "tau_combined": round(tokens / forwards, 3),
            "speculative_equals_own_greedy": f"{same_as_own}/{len(cases)}",
        }
        print(f"{label:>5} {rows[label]}", flush=True)
    report = {**run_identity(torch.device("cpu")), "max_new_tokens": max_new_tokens, "dtype": "float32",
              "text": f"first {TEXT_TOKENS} tokens of the sources of {', '.join(TEXT_MODULES)}",
              "prompts": f"HumanEval[{CODE_OFFSET}:{CODE_OFFSET + PROMPTS}] raw, chat summaries "
                         f"[{CHAT_OFFSET}:{CHAT_OFFSET + PROMPTS}]",
              "retraining": "none", "results": rows}  # fmt: skip
    print(f"wrote {write_report(report, out_dir, prefix='ladder-quality-')}")
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    run(args.max_new_tokens, args.out)


if __name__ == "__main__":
    main()
