"""Per family: the conformance of the captured step against HF's forward, and the capture time.

Tokens/s and τ mean nothing on tiny random-weight models, so for every family in
`specpass.research.tiny_models` this records what does: the largest |logit difference| between the captured
step and HF's forward (prefill of 40 tokens, 10 cached one-token steps, a 7-node tree verified on top
of a 20-token prompt, each node against HF on its branch), whether speculative greedy (the combined
prompt-lookup + Token Recycling tree) equals HF greedy on 3 prompts, and the time `capture` takes
(median of 3). The embedded default model (30 layers, real weights) gives a real-size capture time.
`--lowerings inductor onnxrt` also runs that greedy check on the inductor lowering and, exported, on
ONNX Runtime (minutes: a compile and an export a family); `--archs` picks tiny configs.

    python benchmarks/families.py            # writes benchmarks/results/families-<device>.json
    python benchmarks/families.py --archs mixtral gpt-oss --lowerings inductor onnxrt --prefix families-moe-
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import specpass
from specpass.research.bench import run_identity, write_report
from specpass.drafters import Combined, DraftTree, PromptLookup, TokenRecycling
from specpass.backends.lowering.registry import lower
from specpass.ir import SlotLayout, capture
from specpass.rewrites import TreeAttention
from specpass.research.tiny_models import TINY_ARCHS, tiny_model

PARENTS = (-1, 0, 0, 1, 2, 4, 2)  # root -> 1 -> 3, root -> 2 -> 4 -> 5, 2 -> 6
CACHE = 128


def capture_seconds(model, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        capture(model, cache_size=CACHE)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def step_differences(model) -> dict[str, float]:
    """Max |captured - HF| logits for prefill, cached one-token steps and tree verification."""
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    reference = model(ids).logits  # [1, 40, V]
    gm = capture(model, cache_size=CACHE)
    prefill = (gm(ids, torch.arange(40)[None], 40)[0] - reference).abs().max().item()
    gm(ids[:, :30], torch.arange(30)[None], 30)
    decode = max((gm(ids[:, t : t + 1], torch.tensor([[t]]), t + 1)[0][0, 0] - reference[0, t]).abs().max().item()
                 for t in range(30, 40))  # fmt: skip
    tree_gm, _ = specpass.Pipeline(TreeAttention(8)).run(capture(model, cache_size=CACHE))
    step, _, _ = lower(tree_gm, "eager", torch.device("cpu"), 8, CACHE)
    step(ids[:, :20], SlotLayout.chain(0, 20))
    tree = DraftTree((5, 17, 33, 41, 2, 8, 60), PARENTS, (1.0,) * 7, (None,) * 7)
    logits, _ = step(torch.from_numpy(tree.tokens)[None], SlotLayout.tree(20, tree.ancestor_mask()))  # [1, 7, V]
    verify = 0.0
    for node in range(len(PARENTS)):
        branch = [node]
        while PARENTS[branch[0]] >= 0:
            branch.insert(0, PARENTS[branch[0]])
        full = torch.cat([ids[:, :20], torch.tensor([[tree.tokens[i] for i in branch]])], dim=1)
        verify = max(verify, (logits[0, node] - model(full).logits[0, -1]).abs().max().item())
    return {"prefill": prefill, "decode": decode, "tree_verify": verify}


def greedy_conformance(model, lowering: str = "auto") -> dict:
    """Speculative greedy (combined drafter) against HF greedy on 3 repetitive prompts (the model's LM
    head is peaked first: call it once a model). lowering: a lowering's name, or "onnxrt" (exported)."""
    options = {"pipeline": specpass.Pipeline(TreeAttention(16)), "drafter": Combined(PromptLookup(), TokenRecycling()),
               "cache_size": CACHE, "lowering": lowering}  # fmt: skip
    target = model
    if lowering == "onnxrt":
        import tempfile

        from specpass.backends.onnx.export import export

        directory = tempfile.mkdtemp(prefix="families-onnx-")
        export(model, options["pipeline"], directory, force=True, progress=False)
        target, options = specpass.load_onnx(directory, cache_size=CACHE, budget=16), None
    identical, taus = 0, []
    for seed in range(3):
        ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(seed))
        ids = ids.repeat(1, 2)
        out = specpass.generate(target, ids, max_new_tokens=40, eos_token_id=[], options=options)
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                   eos_token_id=None)  # fmt: skip
        identical += int(torch.equal(out.sequences, reference))
        taus.append(out.stats.tau)
    return {"greedy_identical": f"{identical}/3", "tau": round(statistics.mean(taus), 2)}


def run(out_dir: str, archs=TINY_ARCHS, lowerings=(), prefix: str = "families-") -> dict:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    results = {}
    for arch in archs:
        model = tiny_model(arch, seed=1)
        row = {"architecture": type(model).__name__, "capture_ms": round(capture_seconds(model) * 1e3, 1)}
        row["max_abs_diff"] = {k: float(f"{v:.2e}") for k, v in step_differences(model).items()}
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # a peaked next-token law, so drafts get accepted
        row |= greedy_conformance(model)
        for lowering in lowerings:
            row[f"greedy_{lowering}"] = greedy_conformance(model, lowering)
        results[arch] = row
        print(f"{arch:14s} {row}", flush=True)
    model, _ = specpass.load_default_model()
    default = {"architecture": type(model).__name__, "layers": model.config.num_hidden_layers,
               "capture_ms": round(capture_seconds(model) * 1e3, 1)}  # fmt: skip
    print(f"default model  {default}", flush=True)
    device = torch.device("cpu")
    report = {**run_identity(device), "tiny_config": "2 layers, hidden 32, 4 heads / 2 KV heads, vocab 96",
              "capture_cache_size": CACHE, "families": results, "default_model_capture": default}  # fmt: skip
    path = write_report(report, out_dir, prefix)
    print(f"wrote {path}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--archs", nargs="+", default=list(TINY_ARCHS), choices=TINY_ARCHS)
    parser.add_argument("--lowerings", nargs="*", default=[], choices=["inductor", "onednn", "eager", "onnxrt"])
    parser.add_argument("--prefix", default="families-")
    args = parser.parse_args(argv)
    report = run(args.out, args.archs, args.lowerings, args.prefix)
    worst = max(v for row in report["families"].values() for v in row["max_abs_diff"].values())
    every_identical = all(row["greedy_identical"] == "3/3" and all(row[f"greedy_{lw}"]["greedy_identical"] == "3/3"
                                                                   for lw in args.lowerings)
                          for row in report["families"].values())  # fmt: skip
    return 0 if worst <= 1e-5 and every_identical else 1


if __name__ == "__main__":
    sys.exit(main())
