"""Early exit by layer on the default model: next-token agreement and tau of the plain exit (the model's
final norm + LM head) and of a trained exit adapter, at each exit layer.

Adapters here are trained on a small corpus (the first --prompts training prompts, their greedy
continuations) so that one run covers every layer: they show how agreement grows with the exit layer,
not the shipped adapter's numbers (its own recipe has more data: docs/experiments.md). Agreement is
measured on the held-out prompts' continuations (training_prompts.held_out_prompts, generated
positions); tau with SelfDraft(depth) on HumanEval[140:140+n] (raw; the drafters' tuning range),
every output compared with HF greedy. Every step verifies the whole chain (budget depth + 1, not the
cost curve), so tau measures acceptance alone and does not depend on the machine's timing: the run
may share the CPU. Writes benchmarks/results/exit-layers-<device>.json and .png.

    python benchmarks/exit_layers.py [--layers 2 4 8 16 24] [--prompts 200] [--decode-prompts 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

import specpass
from specpass.research import prompts as P
from specpass.research.bench import run_identity, write_report
from specpass.drafters import SelfDraft
from specpass.research.exit_training import ExitTrainConfig, exit_data, train_exit_adapter
from specpass.research.heads_training import Continuation, generate_corpus
from specpass.rewrites import EarlyExit, TreeAttention
from specpass.research.training_prompts import held_out_prompts, training_prompts

TUNING_OFFSET = 140


@torch.no_grad()
def _with_layer_states(model, corpus: list[Continuation], layers) -> dict[int, list[Continuation]]:
    """The corpus once per exit layer, with that layer's input stream (one forward per sequence)."""
    out = {k: [] for k in layers}
    for seq in corpus:
        states = model.model(seq.tokens[None, :-1], output_hidden_states=True)
        final = states.last_hidden_state[0].float()
        for k in layers:
            out[k].append(Continuation(seq.tokens, seq.start, final, states.hidden_states[k][0].float()))
    return out


@torch.no_grad()
def _plain_agreement(model, data) -> float:
    """How often the model's own final norm + LM head on the exit stream gives its greedy token."""
    states, greedy = data.exit_hidden[data.generated], data.ids[data.generated, 0]
    hits = sum(int((model.lm_head(model.model.norm(part)).argmax(-1) == want).sum())
               for part, want in zip(states.split(1024), greedy.split(1024)))  # fmt: skip
    return hits / max(len(greedy), 1)


def _tau(model, cases, options) -> dict:
    tokens = forwards = differing = 0
    for ids, reference in cases:
        out = specpass.generate(model, ids, reference.shape[1] - ids.shape[1], options=options)
        differing += int(not torch.equal(out.sequences, reference))
        tokens, forwards = tokens + out.stats.new_tokens, forwards + out.stats.target_forwards
    return {"tau": round(tokens / forwards, 3), "outputs_differing_from_hf_greedy": differing}


def run(layers, prompts: int, decode_prompts: int, depth: int, max_new_tokens: int, out_dir: str) -> dict:
    model, tokenizer = specpass.load_default_model()
    started = time.perf_counter()
    corpus = generate_corpus(model, training_prompts(tokenizer, prompts), max_new_tokens)
    held_out = generate_corpus(model, held_out_prompts(tokenizer, 32), max_new_tokens)
    by_layer, held_by_layer = _with_layer_states(model, corpus, layers), _with_layer_states(model, held_out, layers)
    print(f"corpus and states: {time.perf_counter() - started:.0f} s", flush=True)
    ids_list = [P.encode_code(tokenizer, p) for p in P.code_prompts(decode_prompts, offset=TUNING_OFFSET)]
    with torch.no_grad():
        cases = [(ids, model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)) for ids in ids_list]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in layers:
            directory = os.path.join(tmp, f"layer{k}")
            config = ExitTrainConfig(layer=k, epochs=2)
            _, _, report = train_exit_adapter(model, by_layer[k], held_by_layer[k], config, directory, progress=False)
            row = {"plain_exit_agreement": round(_plain_agreement(model, exit_data(model, held_by_layer[k], k)), 4),
                   "adapter_agreement": round(report["adapter_agreement"], 4)}  # fmt: skip
            for name, adapter in (("plain_exit", None), ("adapter", directory)):
                options = {"pipeline": specpass.Pipeline(TreeAttention(16), EarlyExit(k, adapter=adapter)),
                           "drafter": SelfDraft(depth), "budget": depth + 1}  # fmt: skip
                row[name] = _tau(model, cases, options)
            rows[k] = row
            print(f"layer {k:2d}: {row}", flush=True)
    report = {**run_identity(torch.device("cpu")), "max_new_tokens": max_new_tokens, "depth": depth,
              "adapter_training": f"first {prompts} training prompts, 2 epochs, one block of 1536, 8192-token head",
              "agreement_on": "continuations of 32 held-out prompts (generated positions)",
              "tau_on": f"HumanEval[{TUNING_OFFSET}:{TUNING_OFFSET + decode_prompts}] raw (tuning range)",
              "results": rows}  # fmt: skip
    path = write_report(report, out_dir, "exit-layers-")
    _plot(report, path.removesuffix(".json") + ".png")
    print(f"wrote {path}")
    return report


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [int(k) for k in report["results"]]
    rows = list(report["results"].values())
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(layers, [r["plain_exit_agreement"] for r in rows], "o-", label="plain exit (final norm + LM head)")
    left.plot(layers, [r["adapter_agreement"] for r in rows], "s-", label="exit adapter")
    left.set(xlabel="exit layer k (of 30)", ylabel="top-1 agreement with the full model", ylim=(0, 1))
    right.plot(layers, [r["plain_exit"]["tau"] for r in rows], "o-", label="plain exit")
    right.plot(layers, [r["adapter"]["tau"] for r in rows], "s-", label="exit adapter")
    right.set(xlabel="exit layer k (of 30)", ylabel=f"tau (SelfDraft depth {report['depth']}, whole chain verified)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Early exit by layer, SmolLM2-135M-Instruct float32 ({report['device']}, {report['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 24])
    parser.add_argument("--prompts", type=int, default=200, help="training prompts for the adapters")
    parser.add_argument("--decode-prompts", type=int, default=3)
    parser.add_argument("--depth", type=int, default=4, help="SelfDraft chain depth")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    report = run(args.layers, args.prompts, args.decode_prompts, args.depth, args.max_new_tokens, args.out)
    rows = report["results"].values()
    return 1 if any(r[m]["outputs_differing_from_hf_greedy"] for r in rows for m in ("plain_exit", "adapter")) else 0


if __name__ == "__main__":
    sys.exit(main())
