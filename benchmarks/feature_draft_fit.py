"""Is a feature draft short of data or of capacity? Its chain accuracy on sequences it trained on beside
held-out ones, for one or more trained drafts of the default model.

    python benchmarks/feature_draft_fit.py DRAFT_DIR [DRAFT_DIR ...] [--train 64] [--held-out 32] [--tag T]

Both sets are the trainer's own kind of sequence, generated here the trainer's way (`generate_corpus`
with the draft's feature layers): the model's greedy continuations (128 tokens) of the first `--train`
training prompts (every draft trained on at least these: the prompt list keeps its prefix whatever the
count) and of the first `--held-out` held-out prompts. Accuracy is `measure_chain_accuracy`'s: how often
the step-j chain's top-1 / top-8 is the model's greedy token at generated positions.

Reading it: train ≈ held-out and both low says the draft is short of capacity or optimisation (more
data would not help); train well above held-out says it is short of data (it learns its corpus
rather than the model). Writes feature-draft-fit-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from specpass.research.feature_training import measure_chain_accuracy
from specpass.heads.io import load_feature_draft
from specpass.research.heads_training import generate_corpus
from specpass.models import load_default_model
from specpass.research import bench
from specpass.research.training_prompts import held_out_prompts, training_prompts


def _summary(accuracy) -> dict:
    return {"top1": [row[0] for row in accuracy], "top8": [round(sum(row), 4) for row in accuracy]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafts", nargs="+", help="feature-draft directories (specpass train-heads --kind feature)")
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--held-out", type=int, default=32)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_default_model()
    drafts = {path: load_feature_draft(path, model.lm_head).float().eval() for path in args.drafts}
    layers = {draft.config.feature_layers for draft in drafts.values()}
    if len(layers) != 1:
        raise SystemExit(f"the drafts read different layers {layers}: compare drafts of one layout")
    (layers,) = layers
    sets = {
        "train": generate_corpus(model, training_prompts(tokenizer, args.train), 128, layers=layers),
        "held_out": generate_corpus(model, held_out_prompts(tokenizer, args.held_out), 128, layers=layers),
    }
    rows = {}
    for path, draft in drafts.items():
        steps = len(draft.config.accuracy) or 4
        name = os.path.basename(os.path.normpath(path))
        rows[name] = {kind: _summary(measure_chain_accuracy(model, draft, corpus, steps, 8)) for kind, corpus in sets.items()}
        print(name, json.dumps(rows[name]))
    report = {**bench.run_identity(torch.device("cpu")), "train_prompts": args.train, "held_out_prompts": args.held_out,
              "drafts": rows}  # fmt: skip
    print("wrote", bench.write_report(report, args.out_dir, f"feature-draft-fit-{args.tag}-" if args.tag else "feature-draft-fit-"))


if __name__ == "__main__":
    main()
