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

With --recover-prompts N, each ladder is then fine-tuned by self-distillation from the original
(specpass.research.ladder_training: only the laddered layers learn, on the original's greedy continuations of
the first N training prompts, apart from the prompts and text measured here), measured again
(`recovered`, with the share of the log-perplexity gap it closed) and restored before the next.

Writes benchmarks/results/ladder-quality-<device>.json (ladder-recovery-<device>.json with recovery).

    python benchmarks/ladder_quality.py [--max-new-tokens 128] [--counts 2 4 25%] [--recover-prompts 64]
"""

from __future__ import annotations

import argparse
import inspect
import importlib
import math
import time

import torch
import torch.nn.functional as F

import specpass
from specpass.research import prompts as P
from specpass.backends.runtime.program import forget_programs
from specpass.research.bench import run_identity, write_report
from specpass.research.heads_training import generate_corpus
from specpass.research.ladder_training import LadderTrainConfig, layer_parameters, recover_ladder
from specpass.ir import SlotLayout
from specpass.rewrites import LadderResidual, TreeAttention
from specpass.research.training_prompts import training_prompts

TEXT_MODULES = ("fractions", "textwrap", "shlex", "calendar")
TEXT_TOKENS = 512
CODE_OFFSET, CHAT_OFFSET, PROMPTS = 150, 20, 4


def _ladder_counts(num_layers: int) -> dict[str, int]:
    return {"0": 0, "2": 2, "4": 4, "25%": round(0.25 * num_layers), "50%": num_layers // 2, "100%": num_layers}


@torch.no_grad()
def _text_logits(program, texts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits [T, V] of each text as one prefill through the program's step."""
    return [program.forward(ids[None], SlotLayout.of((SlotLayout.chain(0, len(ids)),)))[0][0].float() for ids in texts]


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def _quality(model, ladder, texts, cases, references, original_logits, max_new_tokens: int) -> tuple[dict, list]:
    """One row of the table for `model` with `ladder` (module docstring), and its text logits."""
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
        expected = reference[0, ids.shape[1] :]
        prefixes.append(_common_prefix(own[0, ids.shape[1] :], expected) / len(expected))
        same_as_own += int(torch.equal(fast.sequences, own))
        tokens += fast.stats.new_tokens
        forwards += fast.stats.target_forwards
    row = {
        "laddered_layers": len(ladder.layers),
        "perplexity": round(math.exp(nll.mean()), 3),
        "perplexity_ratio": round(math.exp(nll.mean() - original_nll.mean()), 4),
        "top1_agreement": round(float(agree.mean()), 4),
        "identical_outputs": f"{identical}/{len(cases)}",
        "common_prefix_fraction": round(sum(prefixes) / len(prefixes), 3),
        "tau_combined": round(tokens / forwards, 3),
        "speculative_equals_own_greedy": f"{same_as_own}/{len(cases)}",
    }
    return row, logits


def _recover(model, ladder, corpus, config: LadderTrainConfig, measure, before: dict) -> dict:
    """Fine-tune the laddered layers (ladder_training), measure the recovered model, restore the weights."""
    layers = ladder.resolved(model.config.num_hidden_layers)
    saved = {name: p.detach().clone() for name, p in layer_parameters(model, layers).items()}
    started = time.perf_counter()
    losses = recover_ladder(model, ladder, corpus, config, progress=False)
    seconds = time.perf_counter() - started
    after, _ = measure(ladder)
    with torch.no_grad():
        for name, p in layer_parameters(model, layers).items():
            p.copy_(saved[name])
    forget_programs(model)
    gap_before, gap_after = math.log(before["perplexity_ratio"]), math.log(after["perplexity_ratio"])
    return {**after, "recovered_log_perplexity_gap": round(1 - gap_after / gap_before, 3),
            "kl_first_step": round(losses[0], 4), "kl_last_step": round(losses[-1], 4),
            "optimizer_steps": len(losses), "training_s": round(seconds)}  # fmt: skip


def run(max_new_tokens: int, out_dir: str, counts: list[str] | None = None, recover_prompts: int = 0,
        recover: LadderTrainConfig = LadderTrainConfig()) -> dict:  # fmt: skip
    model, tokenizer = specpass.load_default_model()
    num_layers = model.config.num_hidden_layers
    texts = [tokenizer(inspect.getsource(importlib.import_module(m)), return_tensors="pt").input_ids[0, :TEXT_TOKENS]
             for m in TEXT_MODULES]  # fmt: skip
    cases = [P.encode_code(tokenizer, p) for p in P.code_prompts(PROMPTS, offset=CODE_OFFSET)]
    cases += [P.encode_chat(tokenizer, m) for m in P.chat_messages(PROMPTS, offset=CHAT_OFFSET)]
    with torch.no_grad():
        references = [model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False) for ids in cases]
    corpus = []
    if recover_prompts:
        started = time.perf_counter()
        corpus = generate_corpus(model, training_prompts(tokenizer, recover_prompts), max_new_tokens, progress=False)
        print(f"recovery corpus: {len(corpus)} sequences, {sum(len(s.tokens) for s in corpus)} tokens, "
              f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
    chosen = {label: n for label, n in _ladder_counts(num_layers).items() if counts is None or label in counts}
    original, original_logits = _quality(model, LadderResidual(), texts, cases, references, None, max_new_tokens)
    print(f"    0 {original}", flush=True)

    def measure(ladder):
        return _quality(model, ladder, texts, cases, references, original_logits, max_new_tokens)

    rows = {"0": original}
    for label, count in chosen.items():
        if not count:
            continue
        ladder = LadderResidual.top(count)
        rows[label], _ = measure(ladder)
        if corpus:
            rows[label]["recovered"] = _recover(model, ladder, corpus, recover, measure, rows[label])
        print(f"{label:>5} {rows[label]}", flush=True)
    report = {**run_identity(torch.device("cpu")), "max_new_tokens": max_new_tokens, "dtype": "float32",
              "text": f"first {TEXT_TOKENS} tokens of the sources of {', '.join(TEXT_MODULES)}",
              "prompts": f"HumanEval[{CODE_OFFSET}:{CODE_OFFSET + PROMPTS}] raw, chat summaries "
                         f"[{CHAT_OFFSET}:{CHAT_OFFSET + PROMPTS}]",
              "retraining": "none" if not corpus else
                            f"'recovered': the laddered layers fine-tuned by self-distillation (ladder_training) on "
                            f"the original's continuations of the first {recover_prompts} training prompts, "
                            f"{recover.epochs} epochs, lr {recover.lr}, {recover.sequences_per_step} sequences a step",
              "results": rows}  # fmt: skip
    prefix = "ladder-recovery-" if corpus else "ladder-quality-"
    print(f"wrote {write_report(report, out_dir, prefix=prefix)}")
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--counts", nargs="+", choices=["2", "4", "25%", "50%", "100%"],
                        help="laddered layers to measure beside 0 (default: all)")
    parser.add_argument("--recover-prompts", type=int, default=0,
                        help="fine-tune each ladder on the continuations of this many training prompts (0: no)")
    parser.add_argument("--recover-epochs", type=int, default=2)
    parser.add_argument("--recover-lr", type=float, default=1e-4)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    run(args.max_new_tokens, args.out, args.counts, args.recover_prompts,
        LadderTrainConfig(epochs=args.recover_epochs, lr=args.recover_lr))


if __name__ == "__main__":
    main()
