"""Drafts trained here beside Hydra and the feature draft on the default model, alone and in the combined
tree, on the evaluation prompts (HumanEval[120:] raw and chat summaries [0:]), 64-node trees, in one run.

    python benchmarks/trained_drafts.py --drafts DIR [DIR ...] [--hidden-transfer DIR] [--prompts 4]
        [--max-new-tokens 128]

--drafts: directories of `specpass train-heads --kind clover|chimera|feature --out DIR` (any design of
the feature draft's interface, each named by its design in the results; two of one design get _2,
_3, ...); --hidden-transfer: one of `--kind hidden-transfer`. Hydra and the feature draft are the ones
shipped (trained on more data). Every configuration runs every prompt in turn on one program (Token
Recycling's table carries over within a set, each set starts cold): new tokens / wall seconds, tau,
and how many outputs differ from HF greedy's (expected 0: float32). HF greedy is timed in the same
run. Writes trained-drafts-<device>.json and a PNG of it (`--replot JSON`: only the PNG, from a JSON).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import specpass
from specpass.drafters import Combined, Feature, Heads, PromptLookup, PseudoTokens, TokenRecycling
from specpass.heads.hidden_transfer import read_transfer_config
from specpass.heads.io import read_feature_config
from specpass.research import prompts as P
from specpass.research.bench import run_identity, timed_generations, write_report
from specpass.rewrites import DraftHeads, FeatureDraft, HiddenTransfer, TreeAttention


def configurations(drafts: dict[str, str], hidden_transfer: str | None) -> dict[str, dict]:
    """The plain step, then each draft alone and in the combined tree: `drafts` {name: directory} of the
    feature draft's interface, besides the shipped Hydra and feature draft and a hidden transfer."""
    passes = {"hydra": (DraftHeads(design="hydra"), Heads()), "feature": (FeatureDraft(), Feature())}
    passes |= {name: (FeatureDraft(directory), Feature(depth=_depth(directory))) for name, directory in drafts.items()}
    if hidden_transfer:
        passes["hidden_transfer"] = (HiddenTransfer(hidden_transfer), PseudoTokens())
    configs = {"plain": {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))}}
    for name, (draft, alone) in passes.items():
        configs[name] = {"pipeline": specpass.Pipeline(TreeAttention(64), draft), "drafter": alone}
        configs[f"{name}_combined"] = {"pipeline": specpass.Pipeline(TreeAttention(64), draft),
                                       "drafter": Combined(alone, PromptLookup(), TokenRecycling())}  # fmt: skip
    return configs


def _depth(directory: str) -> int:
    """The Feature drafter's default depth, or a Chimera draft's head count where that is fewer."""
    heads = read_feature_config(directory).parallel_heads
    return min(Feature().depth, heads) if heads else Feature().depth


def _named(directories: list[str]) -> dict[str, str]:
    """{design (_2, _3, ... for repeats): directory}."""
    names: dict[str, str] = {}
    for directory in directories:
        design = read_feature_config(directory).design
        name, n = design, 1
        while name in names:
            n += 1
            name = f"{design}_{n}"
        names[name] = directory
    return names


def _trained(directory: str) -> dict:
    """What a trained draft is (its design and held-out top-1 by depth), not where it was written."""
    config = read_feature_config(directory)
    return {"design": config.design, "held_out_top1_by_depth": [row[0] for row in config.accuracy]}


def _trained_transfer(directory: str) -> dict:
    config = read_transfer_config(directory)
    return {"layer": config.layer, "pseudo_tokens": config.pseudo_tokens,
            "held_out_top1_by_pseudo_token": [row[0] for row in config.accuracy]}  # fmt: skip


def plot(report: dict, path: str) -> None:
    """Tokens/s against HF greedy per configuration, code and chat side by side, tau on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    names = [key.split("/")[0] for key in results if key.endswith("/code") and not key.startswith("hf_greedy")]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.5))
    for offset, set_name in ((-0.2, "code"), (0.2, "chat")):
        ratios = [results[f"{n}/{set_name}"]["x_hf_greedy"] for n in names]
        bars = ax.barh([i + offset for i in range(len(names))], ratios, height=0.4, label=set_name)
        for bar, n in zip(bars, names):
            ax.text(bar.get_width() + 0.01, bar.get_y() + 0.2, f"tau {results[f'{n}/{set_name}']['tau']:.2f}",
                    va="center", fontsize=7)  # fmt: skip
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s / HF greedy's (same run)")
    ax.set_title(f"trained drafts, {report['device']}, {report['date']}, {report['max_new_tokens']} new tokens", fontsize=9)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafts", nargs="*", default=[], metavar="DIR", help="trained drafts of the feature draft's interface")
    parser.add_argument("--hidden-transfer", metavar="DIR")
    parser.add_argument("--prompts", type=int, default=4, help="per set (code, chat)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--replot", metavar="JSON", help="draw the PNG of a results JSON and stop")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.replot.removesuffix(".json") + ".png")
        return
    model, tokenizer = specpass.load_default_model()
    sets = {"code": [P.encode_code(tokenizer, p) for p in P.code_prompts(args.prompts, 120)],
            "chat": [P.encode_chat(tokenizer, m) for m in P.chat_messages(args.prompts, 0)]}  # fmt: skip
    references, hf_seconds = {}, {}
    for set_name, prompts in sets.items():
        started = time.perf_counter()
        references[set_name] = [model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
                                for ids in prompts]  # fmt: skip
        hf_seconds[set_name] = time.perf_counter() - started
    results = {}
    for set_name, prompts in sets.items():
        new = sum(r.shape[1] - ids.shape[1] for r, ids in zip(references[set_name], prompts))
        results[f"hf_greedy/{set_name}"] = {"tokens": new, "seconds": round(hf_seconds[set_name], 2),
                                            "tokens_per_second": round(new / hf_seconds[set_name], 1)}  # fmt: skip
    drafts = _named(args.drafts)
    for name, options in configurations(drafts, args.hidden_transfer).items():
        program = specpass.compile_program(model, options)
        program.cost_curve  # measured before timing
        specpass.generate(program, P.encode_chat(tokenizer, [{"role": "user", "content": "Say hello."}]), 16)
        for set_name, prompts in sets.items():
            program.forget()
            results[f"{name}/{set_name}"] = timed_generations(program, prompts, references[set_name],
                                                               args.max_new_tokens)  # fmt: skip
            print(name, set_name, results[f"{name}/{set_name}"], flush=True)
    for key, entry in results.items():
        hf = results[f"hf_greedy/{key.split('/')[1]}"]
        entry["x_hf_greedy"] = round(entry["tokens_per_second"] / hf["tokens_per_second"], 3)
    report = {
        **run_identity(torch.device("cpu")),
        "prompts": f"HumanEval[120:{120 + args.prompts}] raw, chat summaries [0:{args.prompts}]",
        "max_new_tokens": args.max_new_tokens,
        "drafts": {"hydra": "shipped", "feature": "shipped", **{n: _trained(d) for n, d in drafts.items()},
                   "hidden_transfer": _trained_transfer(args.hidden_transfer) if args.hidden_transfer else None},
        "trees": "TreeAttention(64), the tree size per step from the measured cost curve (the CPU default)",
        "results": results,
    }
    path = write_report(report, args.out, prefix="trained-drafts-")
    plot(report, path.removesuffix(".json") + ".png")
    print("wrote", path, "and its PNG")


if __name__ == "__main__":
    main()
