"""Does the feature draft gain from more data at equal optimizer steps? (issue 53, the data-versus-capacity
question.) Two arms resume the shipped draft with the same schedule and the same number of steps:

* own:       the CPU recipe's corpus (the model's continuations of the first training prompts), 2 epochs;
* own+text:  the same corpus plus as many chunks of teacher-forced local text, 1 epoch: the source files
             of the training prompts' own modules (TRAIN_MODULES, networkx, sympy; never the chat
             evaluation modules, the held-out ones or HumanEval), cut into pieces of --chunk tokens.
             Text costs one forward pass a token, where a continuation costs a generation.

Both arms are measured on the trainer's held-out continuations (32 prompts of other modules), beside
the starting draft. The features and the teacher's states are computed once, for both arms.

Usage: python benchmarks/feature_data.py --corpus FILE [--text 2200] [--chunk 256] [--out benchmarks/results]
Writes OUT/feature-data-<device>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import random
import time
import warnings

import torch

import specpass
from specpass.research.feature_training import FeatureTrainConfig, measure_chain_accuracy, train_feature_draft, with_features
from specpass.heads.io import load_feature_draft, shipped_heads
from specpass.research.heads_training import Continuation, generate_corpus
from specpass.research.bench import run_identity, write_report
from specpass.research.training_prompts import held_out_prompts, training_modules

SHIPPED = shipped_heads("feature")  # the shipped feature draft


def text_chunks(tokenizer, count: int, chunk: int, seed: int = 0) -> list[torch.Tensor]:
    """`count` pieces of `chunk` tokens of the training modules' source files, in a seeded random order."""
    import importlib

    pieces, seen = [], set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in training_modules():
            try:
                path = inspect.getsourcefile(importlib.import_module(name))
            except Exception:  # a module without a source file, or one that fails to import here
                continue
            if path is None or path in seen:
                continue
            seen.add(path)
            with open(path, encoding="utf-8", errors="replace") as f:
                ids = tokenizer(f.read(), return_tensors="pt").input_ids[0]
            pieces += [ids[i : i + chunk] for i in range(0, len(ids) - chunk + 1, chunk)]
    random.Random(seed).shuffle(pieces)
    if len(pieces) < count:
        raise SystemExit(f"only {len(pieces)} pieces of {chunk} tokens in the training modules' sources")
    return pieces[:count]


def with_bf16_features(model, corpus: list[Continuation], layers) -> list[Continuation]:
    """The corpus with its features (kept as bfloat16: the trainer's own precision for them) and states."""
    out = []
    for part in range(0, len(corpus), 500):  # a bounded float32 peak
        for seq in with_features(model, corpus[part : part + 500], layers):
            out.append(dataclasses.replace(seq, layer_states=seq.layer_states.to(torch.bfloat16)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="the CPU recipe's cached corpus (train-heads --corpus FILE)")
    parser.add_argument("--text", type=int, default=2200, help="pieces of local text added in the second arm")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:7.0f} s] {message}", flush=True)

    model, tokenizer = specpass.load_default_model()
    start = load_feature_draft(SHIPPED, model.lm_head)
    layers = start.config.feature_layers
    own = [Continuation(tokens, begin) for tokens, begin in torch.load(args.corpus)]
    text = [Continuation(piece, 0) for piece in text_chunks(tokenizer, args.text, args.chunk)]
    log(f"{len(own)} continuations ({sum(len(c.tokens) for c in own)} tokens), {len(text)} text pieces")
    own, text = with_bf16_features(model, own, layers), with_bf16_features(model, text, layers)
    log("features and states computed")
    held_out = generate_corpus(model, held_out_prompts(tokenizer, 32), 128, layers=layers)
    log("held-out continuations generated")
    report = {**run_identity(torch.device("cpu")), "text_pieces": len(text), "chunk": args.chunk,
              "own_sequences": len(own), "start": {"accuracy": measure_chain_accuracy(model, start.float(), held_out, 4, 8)}}  # fmt: skip
    for arm, corpus, epochs in (("own", own, 2), ("own+text", own + text, 1)):
        config = FeatureTrainConfig(prompts=len(own), epochs=epochs, lr=1e-3)
        began = time.time()
        _, result, losses = train_feature_draft(model, corpus, held_out, config, progress=True,
                                                start=load_feature_draft(SHIPPED, model.lm_head))  # fmt: skip
        report[arm] = {"epochs": epochs, "steps": len(losses), "seconds": round(time.time() - began),
                       "loss_last_50": sum(losses[-50:]) / 50, "accuracy": result.accuracy}  # fmt: skip
        log(f"{arm}: held-out top-1 by depth {[row[0] for row in result.accuracy]}")
        print("wrote", write_report(report, args.out, "feature-data-"), flush=True)


if __name__ == "__main__":
    main()
