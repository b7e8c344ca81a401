"""ONNX Runtime's CUDA EP on the default model, beside HF greedy in the same run.

For each dtype (float32, float16: the dtypes `specpass export` writes) the default model is exported
once (TreeAttention(64)) and decoded on ORT's CUDA EP with IOBinding and ORT CUDA graphs per bucket:
one-node trees (`onnxrt_greedy`: plain greedy through the export) and the combined tree
(`onnxrt_combined`, the default drafter, cost budget). HF `generate` greedy on the GPU in the same
dtype is the reference and the baseline. Float32 outputs must equal HF greedy token for token (the
script exits non-zero otherwise); a float16 divergence is recorded with the reference's top-2 logit gap
at the first differing position and the fp16 ulp there (a near-tie: gap <= 2 ulps).

Usage: python benchmarks/ort_gpu.py [--prompts 3] [--max-new-tokens 128] [--dtypes float32 float16] [--out DIR]
Writes DIR/ort-gpu-<device>.json after every dtype (a run cut short keeps what it finished).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

import torch

import specpass
from specpass.research import prompts
from specpass.research.bench import CODE_OFFSET, run_identity, write_report
from specpass.drafters.registry import drafter_by_name

DTYPES = {"float32": torch.float32, "float16": torch.float16}
MANTISSA_BITS = {torch.float32: 23, torch.float16: 10}
ROWS = {"onnxrt_greedy": ("prompt-lookup", 1), "onnxrt_combined": ("combined", 64)}


def first_divergence(out: list[int], reference: list[int], model, prompt: torch.Tensor) -> dict | None:
    """None when equal; else the first differing position and the reference's top-2 gap there."""
    n = min(len(out), len(reference))
    i = next((j for j in range(n) if out[j] != reference[j]), None)
    if i is None:
        return None if len(out) == len(reference) else {"position": n, "top2_gap": None, "ulp": None}
    ids = torch.cat([prompt[0], torch.tensor(reference[:i], device=prompt.device)])[None]
    with torch.no_grad():
        top2 = model(ids).logits[0, -1].float().topk(2).values
    ulp = 2.0 ** (float(torch.floor(torch.log2(top2[0].abs()))) - MANTISSA_BITS[model.dtype])
    return {"position": i, "top2_gap": float(top2[0] - top2[1]), "ulp": ulp}


def timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def run_dtype(dtype: torch.dtype, cases: dict, max_new_tokens: int, export_dir: str, device: torch.device) -> dict:
    from specpass.backends.onnx.export import export

    cpu_model, tokenizer = specpass.load_default_model(dtype=dtype)  # exported (and checked) from the CPU
    start = time.perf_counter()
    with torch.no_grad():
        export(cpu_model, specpass.Pipeline(specpass.rewrites.TreeAttention(64)), export_dir, tokenizer=tokenizer)
    export_seconds = time.perf_counter() - start
    model = cpu_model.to(device)
    programs = {
        name: specpass.load_onnx(export_dir, drafter=drafter_by_name(drafter), device=device, max_nodes=nodes,
                                 cuda_graphs=device.type == "cuda")  # fmt: skip
        for name, (drafter, nodes) in ROWS.items()
    }
    warm = prompts.encode_chat(tokenizer, [{"role": "user", "content": "Say hello."}]).to(device)
    model.generate(warm, max_new_tokens=16, do_sample=False)
    for program in programs.values():
        specpass.generate(program, warm, max_new_tokens=16)  # captures the first buckets' graphs
    result = {"export_seconds": round(export_seconds, 1), "sets": {}}
    for set_name, ids_list in cases.items():
        for program in programs.values():
            program.forget()
        totals = {name: {"tokens": 0, "forwards": 0, "seconds": 0.0} for name in ("hf_greedy", *ROWS)}
        divergences = {name: [] for name in ROWS}
        for ids in ids_list:
            ids = ids.to(device)
            ref, seconds = timed(lambda: model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False), device)
            reference = ref[0, ids.shape[1] :].tolist()
            totals["hf_greedy"]["tokens"] += len(reference)
            totals["hf_greedy"]["forwards"] += len(reference)
            totals["hf_greedy"]["seconds"] += seconds
            for name, program in programs.items():
                out, seconds = timed(lambda: specpass.generate(program, ids, max_new_tokens=max_new_tokens), device)
                stats = out.stats
                totals[name]["tokens"] += stats.new_tokens
                totals[name]["forwards"] += stats.target_forwards
                totals[name]["seconds"] += seconds
                where = first_divergence(out.sequences[0, ids.shape[1] :].tolist(), reference, model, ids)
                if where is not None:
                    divergences[name].append(where)
        hf_rate = totals["hf_greedy"]["tokens"] / totals["hf_greedy"]["seconds"]
        rows = {}
        for name, t in totals.items():
            rate = t["tokens"] / t["seconds"]
            rows[name] = {"tokens": t["tokens"], "seconds": round(t["seconds"], 3), "tokens_per_second": round(rate, 1),
                          "tau": round(t["tokens"] / t["forwards"], 3), "speedup_vs_hf_greedy": round(rate / hf_rate, 3)}  # fmt: skip
            if name in divergences:
                rows[name]["outputs_differing_from_hf_greedy"] = len(divergences[name])
                rows[name]["divergences"] = divergences[name]
        result["sets"][set_name] = rows
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda", help="cuda (CUDA EP); cpu only to try the script (CPU EP)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("ort_gpu.py needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    import onnxruntime

    _, tokenizer = specpass.load_default_model()
    cases = {
        "code": [prompts.encode_code(tokenizer, p) for p in prompts.code_prompts(args.prompts, CODE_OFFSET)],
        "chat": [prompts.encode_chat(tokenizer, m) for m in prompts.chat_messages(args.prompts)],
    }
    report = run_identity(device) | {
        "onnxruntime": onnxruntime.__version__, "providers": onnxruntime.get_available_providers(),
        "prompts_per_set": args.prompts, "max_new_tokens": args.max_new_tokens,
        "prompt_sets": {"code": f"HumanEval[{CODE_OFFSET}:{CODE_OFFSET + args.prompts}] raw",
                        "chat": f"stdlib docstring summaries [0:{args.prompts}], chat template"},
        "rows": {name: f"ORT CUDA EP, IOBinding, ORT CUDA graphs; drafter {d}, max_nodes {n}" for name, (d, n) in ROWS.items()},
        "dtype": "per entry of results", "results": {},
    }  # fmt: skip
    exact = True
    for name in args.dtypes:
        with tempfile.TemporaryDirectory(prefix="specpass-ort-gpu-") as tmp:
            try:
                report["results"][name] = run_dtype(DTYPES[name], cases, args.max_new_tokens, os.path.join(tmp, "onnx"),
                                                    device)  # fmt: skip
            except Exception as exc:  # recorded with the reason: the other dtype's rows still count
                traceback.print_exc()
                report["results"][name] = {"failed": f"{type(exc).__name__}: {str(exc)[:500]}"}
                exact = exact and name != "float32"
        path = write_report(report, args.out, prefix="ort-gpu-")
        print(name, report["results"][name], flush=True)
        if name == "float32" and "sets" in report["results"][name]:
            exact = all(r.get("outputs_differing_from_hf_greedy", 0) == 0 for s in report["results"][name]["sets"].values()
                        for r in s.values())  # fmt: skip
    print("wrote", path)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
