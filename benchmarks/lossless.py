"""Losslessness on unseen prompts: every drafter's greedy output against HF `generate` greedy, token for token.

    python benchmarks/lossless.py [--prompts 10] [--max-new-tokens 128] [--configs NAME ...] [--tag T] [--out DIR]

Prompts: HumanEval[140:140+N] (raw code; the benchmark uses 120.., the tests 0..) and the chat
summaries of stdlib docstrings [10:10+N] (the benchmark uses 0..), all disjoint from the draft heads'
training prompts. Float32, on the CPU (or the GPU when there is one). Each configuration runs the
default tree budget (the cost curve). The self-draft rows draft with the model's own layers (an exit
after layer 24; the step without layers 3 and 25; the first 4 layers and the shipped exit adapter,
alone, adaptive, and in the combined tree); `combined_inductor` is the combined tree on the step
compiled whole by inductor (float32). The ONNX Runtime rows export the default model with Hydra heads
once and run the export.
Sampling: each configuration also samples every prompt (settings cycled over SAMPLING, seed = prompt
index) and is compared with plain sampling of the same seed (one-node trees): keyed noise makes them
equal token for token.
Writes lossless-<device>.json (lossless-<tag>-<device>.json with --tag): per configuration, the prompts whose output differed (their index and
the first differing position), greedy and sampled; the run fails (exit 1) when any differs.
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
from specpass.drafters.registry import drafter_by_name

CODE_OFFSET, CHAT_OFFSET = 140, 10
# configuration: (drafter, the passes after TreeAttention(64))
TORCH_CONFIGS = {
    "prompt_lookup": ("prompt-lookup", ()),
    "copy_spec": ("copy-spec", ()),
    "aded": ("aded", ()),
    "token_recycling": ("token-recycling", ()),
    "combined": ("combined", ()),
    "medusa": ("heads", (specpass.rewrites.DraftHeads(design="medusa"),)),
    "hydra": ("heads", (specpass.rewrites.DraftHeads(design="hydra"),)),
    "hydra_combined": ("heads-combined", (specpass.rewrites.DraftHeads(design="hydra"),)),
    "self_draft_exit24": ("self-draft", (specpass.rewrites.EarlyExit(24),)),
    "self_draft_layer_skip_3_25": ("self-draft", (specpass.rewrites.LayerSkip((3, 25)),)),
    "self_draft_adapter": ("self-draft", (specpass.rewrites.EarlyExit(4, adapter="default"),)),
    "self_draft_adapter_adaptive": ("self-draft-adaptive", (specpass.rewrites.EarlyExit(4, adapter="default"),)),
    "combined_self_draft_adapter": ("self-draft-combined", (specpass.rewrites.EarlyExit(4, adapter="default"),)),
    "feature": ("feature", (specpass.rewrites.FeatureDraft(),)),
    "feature_combined": ("feature-combined", (specpass.rewrites.FeatureDraft(),)),
    "combined_inductor": ("combined", ()),
}
LOWERING_OF = {"combined_inductor": "inductor"}  # configurations on another lowering than `auto`
# on ONNX Runtime: (drafter, the draft pass after TreeAttention(64)); one export per draft pass
ORT_CONFIGS = {
    "onnxrt_combined": ("combined", specpass.rewrites.DraftHeads("hydra")),
    "onnxrt_hydra_combined": ("heads-combined", specpass.rewrites.DraftHeads("hydra")),
    "onnxrt_feature_combined": ("feature-combined", specpass.rewrites.FeatureDraft()),
}
SAMPLING = (dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=20), dict(temperature=0.3))


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    """The first position where the sequences [1, L] differ (the shorter length when one is a prefix)."""
    n = min(a.shape[1], b.shape[1])
    diff = (a[0, :n] != b[0, :n]).nonzero()
    return int(diff[0]) if len(diff) else n


def _programs(model, device, tokenizer, export_dir, names):
    programs = {}
    for name, (drafter, passes) in TORCH_CONFIGS.items():
        if name not in names:
            continue
        pipeline = specpass.Pipeline(specpass.rewrites.TreeAttention(max_nodes=64), *passes)
        options = {"drafter": drafter_by_name(drafter), "pipeline": pipeline, "lowering": LOWERING_OF.get(name, "auto")}
        programs[name] = specpass.compile_program(torch.compile(model, backend="specpass", options=options))
    if not set(ORT_CONFIGS) & set(names):
        return programs
    from specpass.backends.onnx.export import export

    cpu_model, _ = specpass.load_default_model()  # the export's check compares ORT CPU with a CPU copy
    exported = {}  # draft pass -> its export's directory
    for name, (drafter, draft) in ORT_CONFIGS.items():
        if name not in names:
            continue
        if draft not in exported:
            exported[draft] = os.path.join(export_dir, draft.name)
            with torch.no_grad():
                export(cpu_model, specpass.Pipeline(specpass.rewrites.TreeAttention(64), draft), exported[draft],
                       tokenizer=tokenizer)  # fmt: skip
        programs[name] = specpass.load_onnx(exported[draft], drafter=drafter_by_name(drafter), device=device,
                                            cuda_graphs=device.type == "cuda")  # fmt: skip
    return programs


def run(prompts_per_set: int, max_new_tokens: int, out_dir: str, names=None, tag: str | None = None) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = specpass.load_default_model(device=device)
    sets = {
        "code": [P.encode_code(tokenizer, p) for p in P.code_prompts(prompts_per_set, CODE_OFFSET)],
        "chat": [P.encode_chat(tokenizer, m) for m in P.chat_messages(prompts_per_set, CHAT_OFFSET)],
    }
    if min(len(ids) for ids in sets.values()) < prompts_per_set:
        raise SystemExit(f"fewer than {prompts_per_set} prompts per set at these offsets")
    names = names or [*TORCH_CONFIGS, *ORT_CONFIGS]
    programs = _programs(model, device, tokenizer, os.path.join(tempfile.mkdtemp(prefix="specpass-"), "onnx"), names)
    results = {name: {"prompts": 0, "differing": [], "tau": 0.0, "sampled_differing": [], "sampled_tau": 0.0}
               for name in programs}  # fmt: skip
    one_node = specpass.compile_program(model, {"budget": 1, "pipeline": specpass.Pipeline(specpass.rewrites.TreeAttention(1))})
    started = time.time()
    for set_name, prompt_ids in sets.items():
        for program in programs.values():
            program.forget()
        for index, ids in enumerate(prompt_ids):
            ids = ids.to(device)
            with torch.no_grad():
                reference = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False).cpu()
            for name, program in programs.items():
                out = specpass.generate(program, ids, max_new_tokens)
                row = results[name]
                row["prompts"] += 1
                row["tau"] += out.stats.new_tokens / out.stats.target_forwards
                if not torch.equal(out.sequences.cpu(), reference):
                    where = _first_difference(out.sequences.cpu(), reference) - ids.shape[1]
                    row["differing"].append({"set": set_name, "index": index, "first_differing_token": where})
            sampling = dict(do_sample=True, seed=index, **SAMPLING[index % len(SAMPLING)])
            sampled = specpass.generate(one_node, ids, max_new_tokens, **sampling).sequences.cpu()
            for name, program in programs.items():
                out = specpass.generate(program, ids, max_new_tokens, **sampling)
                results[name]["sampled_tau"] += out.stats.new_tokens / out.stats.target_forwards
                if not torch.equal(out.sequences.cpu(), sampled):
                    where = _first_difference(out.sequences.cpu(), sampled) - ids.shape[1]
                    results[name]["sampled_differing"].append(
                        {"set": set_name, "index": index, "sampling": sampling, "first_differing_token": where}
                    )
            print(f"{set_name} {index}: {reference.shape[1] - ids.shape[1]} tokens, "
                  f"{time.time() - started:.0f}s", flush=True)  # fmt: skip
    for row in results.values():
        row["tau"] = round(row["tau"] / row["prompts"], 3)  # mean per-prompt tau (a sanity figure, not a benchmark)
        row["sampled_tau"] = round(row["sampled_tau"] / row["prompts"], 3)
    report = {
        **run_identity(device),
        "max_new_tokens": max_new_tokens,
        "prompt_sets": {"code": f"HumanEval[{CODE_OFFSET}:{CODE_OFFSET + prompts_per_set}] raw",
                        "chat": f"stdlib docstring summaries [{CHAT_OFFSET}:{CHAT_OFFSET + prompts_per_set}]"},  # fmt: skip
        "reference": "HF generate, do_sample=False; sampled: specpass one-node trees, same seed and settings",
        "sampling": [dict(s, seed="prompt index") for s in SAMPLING],
        "results": results,
    }
    path = write_report(report, out_dir, f"lossless-{tag}-" if tag else "lossless-")
    for name, row in results.items():
        print(f"{name:24s} {row['prompts']} prompts, {len(row['differing'])} differing, mean tau {row['tau']}; "
              f"sampled: {len(row['sampled_differing'])} differing, mean tau {row['sampled_tau']}")  # fmt: skip
    print(f"wrote {path}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10, help="prompts per set (code, chat)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--configs", nargs="+", choices=[*TORCH_CONFIGS, *ORT_CONFIGS], help="(default: all)")
    parser.add_argument("--tag", help="names the results file: lossless-<tag>-<device>.json")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    report = run(args.prompts, args.max_new_tokens, args.out, args.configs, args.tag)
    rows = report["results"].values()
    return 1 if any(row["differing"] or row["sampled_differing"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
