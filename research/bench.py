"""`specpass bench`: tokens/s and tau of specpass against HF baselines, all measured in one run.

Baselines: HF `generate` greedy (eager, dynamic cache), HF with a static cache + torch.compile (where
it runs), HF prompt lookup (`prompt_lookup_num_tokens=10`, a chain), HF early exit
(`assistant_early_exit`, the model's first layers as draft). specpass rows: one-node trees (plain
greedy through specpass's lowering), the prompt-lookup tree, the token-recycling tree and both
combined, on PyTorch; plain greedy and the combined tree on ONNX Runtime (the `specpass export` of
the default model). Every specpass output is checked against HF greedy.
Writes `<out>/<device>.json` and `<out>/<device>.png`.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import platform
import re
import time

import torch

from .. import rewrites
from ..api import compile_program, generate, load_onnx
from ..common.errors import InvalidParameterError, SpecpassError
from ..models import DEFAULT_MODEL_NAME, load_default_model
from ..passes import Pipeline

BASELINES = ("hf_greedy", "hf_static_compile", "hf_prompt_lookup", "hf_early_exit")
# specpass rows: (drafter, the shipped draft in the pipeline: heads "medusa" / "hydra" (DraftHeads) or "feature"
# (FeatureDraft), TreeAttention max_nodes, budget). specpass_greedy
# verifies one-node trees: plain greedy decoding through the same lowering, which separates what the
# lowering buys from what speculation buys. budget "cost": tree size per step from the measured cost curve;
# 64: the full tree every step (a GPU's budget, where 64 tokens cost about one): the tree's own tau.
SPECPASS_ROWS = {
    "specpass_greedy": ("prompt-lookup", None, 1, "cost"),
    "specpass_prompt_lookup": ("prompt-lookup", None, 64, "cost"),
    "specpass_token_recycling": ("token-recycling", None, 64, "cost"),
    "specpass_combined": ("combined", None, 64, "cost"),
    "specpass_combined_64": ("combined", None, 64, 64),
    "specpass_medusa": ("heads", "medusa", 64, "cost"),
    "specpass_medusa_64": ("heads", "medusa", 64, 64),
    "specpass_hydra": ("heads", "hydra", 64, "cost"),
    "specpass_hydra_64": ("heads", "hydra", 64, 64),
    "specpass_hydra_combined": ("heads-combined", "hydra", 64, "cost"),
    "specpass_hydra_combined_64": ("heads-combined", "hydra", 64, 64),
    "specpass_feature": ("feature", "feature", 64, "cost"),
    "specpass_feature_64": ("feature", "feature", 64, 64),
    "specpass_feature_combined": ("feature-combined", "feature", 64, "cost"),
    "specpass_feature_combined_64": ("feature-combined", "feature", 64, 64),
}
NOTES = (
    "tau = new tokens / target forwards, prefill included, for every method. specpass rows use the default "
    "lowering (on a CPU eager or onednn per tree size, whichever its measured cost curve says is faster; "
    "inductor in CUDA graphs on a GPU; specpass_onnxrt_* run the ONNX export on ONNX Runtime: "
    "CPU EP, or CUDA EP with IOBinding and CUDA graphs) and choose each step's tree size from the measured cost "
    "curve (up to 64 nodes) unless the row's name ends in _64 (the full 64-node tree every step). Token "
    "Recycling's table carries over from prompt to prompt within a set (the paper's hot start); each set "
    "starts cold. Draft-head and feature-draft rows use the drafts shipped in the package (trained on prompts "
    "disjoint from these). hf_early_exit's tau is not reported: its draft forwards hit the same forward hook."
)
ORT_ROWS = {"specpass_onnxrt_greedy": ("prompt-lookup", 1), "specpass_onnxrt_combined": ("combined", 64)}
STATIC_CACHE_LEN = 1024  # one static cache shape for every prompt, so the compiled HF forward compiles once
EARLY_EXIT_LAYER = 8
CODE_OFFSET = 120  # evaluation prompts: HumanEval 120.. (the tests use 0..), chat: stdlib docstrings


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), e.g. "AMD EPYC" or "Intel(R) Xeon(R) Platinum 8481C"."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def device_label(device: torch.device) -> str:
    """The GPU's name, or cpu-<cores>core-<machine>-<vendor and family>, e.g. cpu-2core-x86_64-amd-epyc:
    CPU machines differ from session to session, and results name the one they ran on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    family = "-".join(re.sub(r"\(r\)|\(tm\)|cpu|processor", " ", cpu_name().lower()).split()[:2])
    return f"cpu-{os.cpu_count()}core-{platform.machine()}" + (f"-{family}" if family else "")


def run_identity(device: torch.device) -> dict:
    """What a results file says about the run: device, date, library versions, model, dtype."""
    return {
        "device": device_label(device),
        **({"cpu": cpu_name(), "threads": torch.get_num_threads()} if device.type == "cpu" else {}),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "model": DEFAULT_MODEL_NAME,
        "dtype": "float32",
    }


def evaluation_sets(prompts_per_set: int, max_new_tokens: int) -> dict:
    """What a results file says about the benchmark's evaluation prompts."""
    return {
        "prompts_per_set": prompts_per_set,
        "max_new_tokens": max_new_tokens,
        "prompt_sets": {"code": f"HumanEval[{CODE_OFFSET}:{CODE_OFFSET + prompts_per_set}] raw",
                        "chat": f"stdlib docstring summaries [0:{prompts_per_set}], chat template"},  # fmt: skip
    }


def _slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def timed_generations(program, prompts: list[torch.Tensor], references: list[torch.Tensor], max_new_tokens: int,
                      forget_each: bool = False) -> dict:  # fmt: skip
    """`program`'s greedy generation of each prompt in turn (`forget_each`: on a program that forgets the
    previous ones): new tokens, wall seconds, tokens/s, tau, and how many outputs differ from `references`."""
    tokens = forwards = differing = 0
    seconds = 0.0
    for ids, reference in zip(prompts, references):
        if forget_each:
            program.forget()
        started = time.perf_counter()
        out = generate(program, ids, max_new_tokens=max_new_tokens)
        seconds += time.perf_counter() - started
        tokens += out.stats.new_tokens
        forwards += out.stats.target_forwards
        differing += int(not torch.equal(out.sequences, reference))
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_second": round(tokens / seconds, 1),
            "tau": round(tokens / forwards, 3), "outputs_differing_from_hf_greedy": differing}  # fmt: skip


def write_report(report: dict, out_dir: str, prefix: str = "") -> str:
    """Writes `report` to OUT_DIR/<prefix><device slug>.json and returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{prefix}{_slug(report['device'])}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    return path


class _ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        model.register_forward_hook(self)

    def __call__(self, *_):
        self.calls += 1


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_kwarg(model) -> str:
    """`generate`'s name for a cache object: `cache` from transformers 5.2x (`past_key_values` warns
    there), `past_key_values` before (5.17, the GPU machine's)."""
    parameters = inspect.signature(model.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _hf_runner(model, counter, device, name, compiled_forward):
    kwargs = {"do_sample": False}
    if name == "hf_prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    if name == "hf_early_exit":
        kwargs["assistant_early_exit"] = EARLY_EXIT_LAYER

    def run(ids, max_new_tokens):
        cache = {}
        if name == "hf_static_compile":
            from transformers import StaticCache

            cache[_cache_kwarg(model)] = StaticCache(config=model.config, max_cache_len=STATIC_CACHE_LEN)
        original = model.forward
        if compiled_forward is not None:
            model.forward = compiled_forward
        try:
            counter.calls = 0
            _sync(device)
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=max_new_tokens, **kwargs, **cache)
            _sync(device)
            seconds = time.perf_counter() - t0
        finally:
            model.forward = original
        return out, out.shape[1] - ids.shape[1], counter.calls, seconds

    return run


def _compiled_forward(model, device):
    """HF's forward under torch.compile, or None where HF compiles it itself.

    On a GPU, `generate` with a static cache compiles the forward by itself (transformers' auto-compile,
    CUDA graphs managed by HF), so the baseline is that, untouched: a forward compiled here as well
    ran inside HF's compiled call and failed on an H100 ("accessing tensor output of CUDAGraphs that
    has been overwritten"). On a CPU HF does not compile, so this does:
    inductor with weight freezing (it packs the linear weights for oneDNN, as specpass's CPU lowering
    does). Freezing is set in inductor's global config: compilation is lazy, and only the global
    setting reaches it (measured: `options={"freezing": True}` left the forward at plain-eager speed)."""
    if device.type == "cuda":
        return None
    from torch._inductor import config as inductor_config  # not `import torch...`: that would make torch local

    inductor_config.freezing = True
    return torch.compile(model.forward, fullgraph=True)


def _specpass_runner(program):
    if program.budget == "cost":
        program.cost_curve  # measured before timing

    def run(ids, max_new_tokens):
        out = generate(program, ids, max_new_tokens)
        s = out.stats
        return out.sequences, s.new_tokens, s.target_forwards, s.seconds

    return run, program


def _ort_program(device, drafter, max_nodes, export_dir):
    """The default model exported once (float32, TreeAttention(64)) into export_dir, run on ONNX Runtime."""
    from ..backends.onnx.export import export

    if not os.path.exists(os.path.join(export_dir, "manifest.json")):
        model, tokenizer = load_default_model()  # a CPU copy: the check compares ORT CPU with it
        with torch.no_grad():
            export(model, Pipeline(rewrites.TreeAttention(64)), export_dir, tokenizer=tokenizer)
    return load_onnx(export_dir, drafter=drafter, device=device, max_nodes=max_nodes,
                              cuda_graphs=device.type == "cuda")  # fmt: skip


def run_benchmark(prompts_per_set=10, max_new_tokens=128, out_dir="benchmarks/results", compile_baseline=True,
                  rows=None, tag=""):  # fmt: skip
    """rows: the rows to run (default: every one; HF greedy and HF prompt lookup always run, the ratios'
    baselines); tag: a prefix of the report's file name."""
    import tempfile

    from . import prompts as P
    from ..drafters.registry import drafter_by_name

    known = (*BASELINES, *SPECPASS_ROWS, *ORT_ROWS)
    if rows is not None and not set(rows) <= set(known):
        unknown = ", ".join(sorted(set(rows) - set(known)))
        raise InvalidParameterError(f"unknown benchmark rows: {unknown}; choose from {', '.join(known)}")
    chosen = set(known if rows is None else (*rows, "hf_greedy", "hf_prompt_lookup"))

    export_dir = os.path.join(tempfile.mkdtemp(prefix="specpass-bench-"), "onnx")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_default_model(device=device)
    counter = _ForwardCounter(model)
    sets = {
        "code": [P.encode_code(tokenizer, p).to(device) for p in P.code_prompts(prompts_per_set, CODE_OFFSET)],
        "chat": [P.encode_chat(tokenizer, m).to(device) for m in P.chat_messages(prompts_per_set)],
    }
    runners, skipped = {}, {}
    for name in BASELINES:
        if name not in chosen:
            continue
        compiled_forward = None
        if name == "hf_static_compile":
            if not compile_baseline:
                skipped[name] = "skipped (--no-compile-baseline)"
                continue
            compiled_forward = _compiled_forward(model, device)
        runners[name] = _hf_runner(model, counter, device, name, compiled_forward)
    programs = {}  # specpass rows: their programs keep Token Recycling's table from prompt to prompt
    for name, (drafter, draft, max_nodes, budget) in SPECPASS_ROWS.items():
        if name not in chosen:
            continue
        passes = [rewrites.TreeAttention(max_nodes=max_nodes)]
        if draft == "feature":
            passes.append(rewrites.FeatureDraft())
        elif draft is not None:
            passes.append(rewrites.DraftHeads(design=draft))
        pipeline = Pipeline(*passes)
        options = {"drafter": drafter_by_name(drafter), "pipeline": pipeline, "budget": budget}
        program = compile_program(torch.compile(model, backend="specpass", options=options))
        runners[name], programs[name] = _specpass_runner(program)
    for name, (drafter, max_nodes) in ORT_ROWS.items():
        if name not in chosen:
            continue
        try:
            program = _ort_program(device, drafter_by_name(drafter), max_nodes, export_dir)
        except Exception as exc:  # no onnxruntime, or no CUDA EP for a GPU run: reported, not fatal
            skipped[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        runners[name], programs[name] = _specpass_runner(program)
    # Warm-up on three prompts outside the evaluation sets: several prompt lengths make the compiled
    # HF forward settle on a dynamic prefill graph before anything is timed.
    warm = [P.encode_chat(tokenizer, [{"role": "user", "content": text}]).to(device)
            for text in ("Say hello.", "Name three colours and say which one you like best, and why.",
                         "Explain in two sentences what a hash table is and when a list is the better choice.")]
    for name, run in runners.items():
        try:
            for ids in warm:
                run(ids, max_new_tokens)
        except Exception as exc:  # a baseline that does not run here is reported, not fatal
            skipped[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    runners = {k: v for k, v in runners.items() if k not in skipped}

    results = {}
    for set_name, prompt_ids in sets.items():
        for program in programs.values():
            program.forget()  # each set starts cold (nothing from the warm-up or the other set)
        totals = {name: [0, 0, 0.0] for name in runners}
        mismatches = {name: 0 for name in runners if name.startswith("specpass")}
        for ids in prompt_ids:
            reference = None
            for name, run in runners.items():
                out, tokens, forwards, seconds = run(ids, max_new_tokens)
                if name == "hf_greedy":
                    reference = out
                elif name in mismatches and not torch.equal(out.to(reference.device), reference):
                    mismatches[name] += 1
                totals[name][0] += tokens
                totals[name][1] += forwards
                totals[name][2] += seconds
        greedy_rate = totals["hf_greedy"][0] / totals["hf_greedy"][2]
        pld_rate = totals["hf_prompt_lookup"][0] / totals["hf_prompt_lookup"][2]
        pld_tau = totals["hf_prompt_lookup"][0] / totals["hf_prompt_lookup"][1]
        rows = {}
        for name, (tokens, forwards, seconds) in totals.items():
            rate = tokens / seconds
            tau = tokens / forwards if name != "hf_early_exit" else None  # its draft forwards hit the same hook
            rows[name] = {
                "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(rate, 2),
                "tau": round(tau, 3) if tau is not None else None,
                "speedup_vs_hf_greedy": round(rate / greedy_rate, 3),
                "speedup_vs_hf_prompt_lookup": round(rate / pld_rate, 3),
                "tau_vs_hf_prompt_lookup": round(tau / pld_tau, 3) if tau is not None else None,
            }  # fmt: skip
            if name in mismatches:
                rows[name]["outputs_differing_from_greedy"] = mismatches[name]
        results[set_name] = rows

    curves, kernels = _cost_curves(model, device, skipped)
    report = {
        **run_identity(device),
        **evaluation_sets(prompts_per_set, max_new_tokens),
        "notes": NOTES,
        "skipped": skipped,
        "results": results,
        "cost_curves": curves,
        "auto_lowering_per_tree_size": kernels,
    }
    path = write_report(report, out_dir, f"{tag}-" if tag else "")
    _plot(report, path.removesuffix(".json") + ".png")
    _print(report)
    print(f"wrote {path}")
    return report


def _cost_curves(model, device: torch.device, skipped: dict) -> tuple[dict, dict]:
    """The cost curve of each lowering, and which lowering `auto` runs (one for every tree size).

    On a CPU: `auto` (oneDNN). On a GPU: eager, the FX step in CUDA graphs, and the inductor step in
    CUDA graphs (what `auto` runs there)."""

    measured, kernels = {}, {}
    for lowering in ("eager", "cudagraphs", "inductor") if device.type == "cuda" else ("auto",):
        try:
            program = compile_program(torch.compile(model, backend="specpass", options={"lowering": lowering}))
            curve = program.cost_curve
        except SpecpassError as exc:
            skipped[f"cost_curve_{lowering}"] = str(exc)
            continue
        if lowering == "auto":
            kernels = {str(n): program.step.run.lowering for n in curve.sizes}
        measured[lowering] = curve
    curves = {
        name: {"tree_size": list(c.sizes), "seconds": [round(s, 5) for s in c.seconds],
               "relative_to_one_token": {str(k): round(v, 3) for k, v in c.relative().items()}}  # fmt: skip
        for name, c in measured.items()
    }
    return curves, kernels


def _print(report: dict) -> None:
    print(f"device: {report['device']}  ({report['max_new_tokens']} new tokens, greedy, {report['dtype']})")
    for set_name, rows in report["results"].items():
        print(f"\n[{set_name}]  {'tokens/s':>9} {'tau':>6} {'vs greedy':>10} {'vs HF PLD':>10}")
        for name, r in rows.items():
            tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
            print(f"{name:26}{r['tokens_per_second']:>9.1f} {tau:>6} {r['speedup_vs_hf_greedy']:>9.2f}x "
                  f"{r['speedup_vs_hf_prompt_lookup']:>9.2f}x")  # fmt: skip
    for name, why in report["skipped"].items():
        print(f"{name}: {why}")


def _plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for lowering, curve in report["cost_curves"].items():
        envelope = lowering == "auto"  # the lower envelope of the lowerings it chooses from
        ax1.plot(curve["tree_size"], [1000 * s for s in curve["seconds"]], marker="." if envelope else "o",
                 linestyle="--" if envelope else "-", label="auto (fastest per size)" if envelope else lowering)  # fmt: skip
    ax1.set_xlabel("tokens verified per target forward (T)")
    ax1.set_ylabel("target forward latency (ms)")
    ax1.legend()
    ax1.set_title("target-forward cost curve")
    ax1.grid(True, alpha=0.3)
    names = list(next(iter(report["results"].values())))
    width = 0.8 / len(report["results"])
    for i, (set_name, rows) in enumerate(report["results"].items()):
        xs = [j + i * width for j in range(len(names))]
        ax2.bar(xs, [rows[n]["tokens_per_second"] for n in names], width, label=set_name)
    ax2.set_xticks([j + width / 2 for j in range(len(names))])
    ax2.set_xticklabels([n.replace("specpass_", "sp_") for n in names], rotation=30, ha="right")
    ax2.set_ylabel("tokens/s")
    ax2.set_title("decode throughput (same run)")
    ax2.legend()
    fig.suptitle(f"specpass on {report['device']} - {report['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
