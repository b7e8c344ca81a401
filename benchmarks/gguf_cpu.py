"""specpass on the GGUF lowering against llama.cpp on the same GGUF file, same machine, same run.

    python benchmarks/gguf_cpu.py [--prompts 15] [--max-new-tokens 128] [--out benchmarks/results]

Rows (128 new tokens, the benchmark's evaluation prompts: HumanEval[120:], raw, and chat summaries [0:],
chat template; every row the same prompts, the same thread count):
  hf_greedy                 transformers float32 greedy (the reference of every agreement count)
  specpass_float32          specpass's default (combined tree, cost budget, `auto` float32 lowering)
  specpass_float32_one_token        the same lowering without speculation (budget 1)
  specpass_bfloat16 / _one_token    the same two on the model loaded in bfloat16
  specpass_gguf             the same drafter and budget on lowering="gguf" (backends/lowering/gguf.py)
  specpass_gguf_one_token   lowering="gguf" without speculation (budget 1)
  specpass_gguf_compiled    the same drafter and budget on lowering="gguf-compiled" (the gguf step compiled
                            whole by inductor; compiled while the program's cost curve is measured, before timing)
  specpass_gguf_compiled_one_token   lowering="gguf-compiled" without speculation (budget 1)
  *_sampled                 the two gguf lowerings and their one-token rows sampling (temperature 0.8,
                            top-p 0.95, seed 7): speculative against one-node sampling
  llama_cpp                 llama-cpp-python, plain greedy decoding (temp 0, no repeat penalty), in a
                            process of its own (benchmarks/llama_cpp_worker.py); started with its defaults,
                            and without its extra buffer types (AMX) where a probe decode crashed (reported)
  llama_cpp_prompt_lookup   llama-cpp-python with its prompt-lookup drafter (10 tokens), the same process
  llama_cpp_prompt_lookup_2 the same with 2 draft tokens (its docs' advice on CPUs)
Reported per row and set: tokens/s (prefill included), the prefill's share (llama.cpp: time to its
first token; HF: not measured), tau where known, outputs identical to HF float32 greedy, and at each
first divergence how far below the float32 top logit the lower of the two tokens is, `near_tie` when
within NEAR_TIE_LOGITS (the gguf lowering's rounding: backends/lowering/gguf.py). Each speculative
specpass row is also compared with its lowering's one-token row (`identical_to_one_token`: speculation
against the same lowering's own one-token decoding, greedy or sampled: lossless by construction says
every prompt). Also the one-token step of each lowering (float32: eager, `auto`'s oneDNN, inductor
compiled whole; the two gguf lowerings; milliseconds after 256 committed tokens, median) beside
llama.cpp's decode time per token (its own eval timing, prefill excluded), the CPU's model and flags,
and llama.cpp's build (its system info). Writes gguf-cpu-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import specpass
from specpass.research import prompts as P
from specpass.backends.lowering.gguf import NEAR_TIE_LOGITS
from specpass.research.bench import CODE_OFFSET, evaluation_sets, run_identity, write_report
from specpass.models import GGUF_FILE, default_model_dir


# each speculative row -> its lowering's one-token row
ONE_TOKEN_OF = {name: f"{name}_one_token" for name in ("specpass_float32", "specpass_bfloat16", "specpass_gguf",
                                                         "specpass_gguf_compiled")}  # fmt: skip
ONE_TOKEN_OF |= {f"{name}_sampled": f"{name}_one_token_sampled" for name in ("specpass_gguf", "specpass_gguf_compiled")}
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "seed": 7}
PROBE_IDS = list(range(100, 108))  # eight token ids: llama.cpp's first decode, before any timed row
LLAMA_CPP_ROWS = {"llama_cpp": 0, "llama_cpp_prompt_lookup": 10, "llama_cpp_prompt_lookup_2": 2}  # row -> draft tokens


class LlamaCppProcess:
    """llama.cpp in its own process (benchmarks/llama_cpp_worker.py), asked one prompt at a time, so its
    rows take turns with the torch rows on every prompt while never sharing the cores with them."""

    def __init__(self, threads: int):
        """Starts the worker with llama.cpp's defaults; if a probe decode kills it (its AMX buffers
        segfaulted on an Intel Xeon, 2026-12-05), starts it again without extra buffer types and says so."""
        self.decode_ms: dict[int, list[float]] = {k: [] for k in LLAMA_CPP_ROWS.values()}  # per prompt: its own timing
        self.crashed_with_extra_buffers = False
        self._start(threads, extra_buffers=True)
        try:
            self.ask(PROBE_IDS, 4, set(), 0)
        except (json.JSONDecodeError, BrokenPipeError):
            self.process.wait(timeout=60)
            self.crashed_with_extra_buffers = f"exit code {self.process.returncode}"
            self._start(threads, extra_buffers=False)
            self.ask(PROBE_IDS, 4, set(), 0)

    def _start(self, threads: int, extra_buffers: bool) -> None:
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_worker.py")
        path = os.path.join(default_model_dir(), GGUF_FILE)
        flags = [] if extra_buffers else ["--no-extra-buffers"]
        self.process = subprocess.Popen([sys.executable, worker, path, str(threads), *flags], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.info = json.loads(self.process.stdout.readline())  # {"ready", "system_info", "version", "extra_buffers"}

    def ask(self, ids: list[int], max_new_tokens: int, eos: set[int], draft_tokens: int) -> dict:
        request = {"ids": ids, "max_new_tokens": max_new_tokens, "eos": sorted(eos), "draft_tokens": draft_tokens}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def runner(self, eos: set[int], draft_tokens: int):
        def run(ids: torch.Tensor, max_new_tokens: int):
            out = self.ask(ids[0].tolist(), max_new_tokens, eos, draft_tokens)
            self.decode_ms[draft_tokens].append(out["decode_ms_per_token"])
            sequence = torch.cat([ids, torch.tensor([out["new"]], dtype=ids.dtype)], dim=1)
            return sequence, len(out["new"]), None, out["seconds"], out["first_token_seconds"]

        return run

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def one_token_step_ms(program, context: int = 256, repeats: int = 30) -> float:
    """Median milliseconds of the program's one-token verify step after `context` committed tokens
    (DecodeProgram.measured_forward: a forward as the loop runs it, nothing committed)."""
    from specpass.ir import SlotLayout

    token = torch.tensor([1])
    times = []
    for _ in range(repeats + 3):
        started = time.perf_counter()
        program.measured_forward(token, SlotLayout.chain(context, 1))
        times.append(time.perf_counter() - started)
    return round(1e3 * sorted(times[3:])[repeats // 2], 2)


def cpu_flags() -> list[str]:
    """The CPU's vector and matrix extensions (what llama.cpp's and oneDNN's kernels can use)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return []
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
    return [f for f in wanted if f in flags]


def _specpass_runner(program, **sampling):
    if program.budget == "cost":
        program.cost_curve  # measured before timing

    def run(ids: torch.Tensor, max_new_tokens: int):
        out = specpass.generate(program, ids, max_new_tokens, **sampling)
        s = out.stats
        return out.sequences, s.new_tokens, s.target_forwards, s.seconds, s.prefill_seconds

    return run


def _hf_runner(model):
    def run(ids: torch.Tensor, max_new_tokens: int):
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        seconds = time.perf_counter() - t0
        new = out.shape[1] - ids.shape[1]
        return out, new, new, seconds, None

    return run


def _divergence_gap(model, sequence: torch.Tensor, reference: torch.Tensor) -> dict | None:
    """None where `sequence` equals `reference`; else where it first differs and how far below the
    float32 model's top logit there the lower of the two tokens taken is (a near-tie when small)."""
    length = min(sequence.shape[1], reference.shape[1])
    different = (sequence[0, :length] != reference[0, :length]).nonzero()
    if not len(different):
        return None if sequence.shape[1] == reference.shape[1] else {"at": length, "gap": None}
    at = int(different[0])
    with torch.no_grad():
        logits = model(reference[:, :at]).logits[0, -1]  # [V]
    gap = float(logits.max() - logits[[int(sequence[0, at]), int(reference[0, at])]].min())
    return {"at": at, "gap": round(gap, 5), "near_tie": gap <= NEAR_TIE_LOGITS}


def run(prompts_per_set: int, max_new_tokens: int, out_dir: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    llama = LlamaCppProcess(threads)  # before the model loads: its own process, its own threads
    model, tokenizer = specpass.load_default_model()
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])  # fmt: skip
    bfloat16, _ = specpass.load_default_model(dtype=torch.bfloat16)
    programs = {
        "specpass_float32": specpass.compile_program(model),
        "specpass_float32_one_token": specpass.compile_program(model, {"budget": 1}),
        "specpass_bfloat16": specpass.compile_program(bfloat16),
        "specpass_bfloat16_one_token": specpass.compile_program(bfloat16, {"budget": 1}),
        "specpass_gguf": specpass.compile_program(model, {"lowering": "gguf"}),
        "specpass_gguf_one_token": specpass.compile_program(model, {"lowering": "gguf", "budget": 1}),
        "specpass_gguf_compiled": specpass.compile_program(model, {"lowering": "gguf-compiled"}),
        "specpass_gguf_compiled_one_token": specpass.compile_program(model, {"lowering": "gguf-compiled", "budget": 1}),
    }
    sampled = {f"{name}_sampled": programs[name] for name in ("specpass_gguf", "specpass_gguf_one_token",
                                                             "specpass_gguf_compiled", "specpass_gguf_compiled_one_token")}  # fmt: skip
    runners = {
        "hf_greedy": _hf_runner(model),
        **{name: _specpass_runner(program) for name, program in programs.items()},
        **{name: _specpass_runner(program, **SAMPLING) for name, program in sampled.items()},
        **{name: llama.runner(eos, draft_tokens) for name, draft_tokens in LLAMA_CPP_ROWS.items()},
    }
    sets = {
        "code": [P.encode_code(tokenizer, p) for p in P.code_prompts(prompts_per_set, CODE_OFFSET)],
        "chat": [P.encode_chat(tokenizer, m) for m in P.chat_messages(prompts_per_set, 0)],
    }
    warm = P.encode_chat(tokenizer, [{"role": "user", "content": "Name three colours."}])
    for run_one in runners.values():
        run_one(warm, 16)
    results = {}
    for set_name, prompt_ids in sets.items():
        totals = {name: {"tokens": 0, "forwards": 0, "seconds": 0.0, "prefill_seconds": 0.0, "identical": 0,
                         "divergences": []} for name in runners}  # fmt: skip
        against_one_token = {name: {"identical": 0, "divergences": []} for name in ONE_TOKEN_OF}
        for index, ids in enumerate(prompt_ids):
            reference = None
            outputs = {}
            for name, run_one in runners.items():
                sequence, tokens, forwards, seconds, prefill = run_one(ids, max_new_tokens)
                outputs[name] = sequence
                row = totals[name]
                row["tokens"] += tokens
                row["forwards"] = None if forwards is None or row["forwards"] is None else row["forwards"] + forwards
                row["seconds"] += seconds
                row["prefill_seconds"] = None if prefill is None else row["prefill_seconds"] + prefill
                if name == "hf_greedy":
                    reference = sequence
                    row["identical"] += 1
                    continue
                if name.endswith("_sampled"):  # compared with one-node sampling only (below)
                    continue
                divergence = _divergence_gap(model, sequence, reference)
                if divergence is None:
                    row["identical"] += 1
                else:
                    row["divergences"].append({"prompt": index, **divergence, "at": divergence["at"] - ids.shape[1]})
            for name, one_token in ONE_TOKEN_OF.items():
                divergence = _divergence_gap(model, outputs[name], outputs[one_token])
                if divergence is None:
                    against_one_token[name]["identical"] += 1
                else:
                    against_one_token[name]["divergences"].append({"prompt": index, **divergence,
                                                                   "at": divergence["at"] - ids.shape[1]})  # fmt: skip
        llama_rate = totals["llama_cpp"]["tokens"] / totals["llama_cpp"]["seconds"]
        results[set_name] = {
            name: {
                "tokens": row["tokens"], "seconds": round(row["seconds"], 3),
                "tokens_per_second": round(row["tokens"] / row["seconds"], 2),
                "vs_llama_cpp": round(row["tokens"] / row["seconds"] / llama_rate, 3),
                "prefill_share": None if row["prefill_seconds"] is None else round(row["prefill_seconds"] / row["seconds"], 3),
                "tau": round(row["tokens"] / row["forwards"], 3) if row["forwards"] else None,
                "identical_to_hf_float32_greedy": None if name.endswith("_sampled") else f"{row['identical']}/{len(prompt_ids)}",
                "divergences": row["divergences"],
            }
            for name, row in totals.items()
        }  # fmt: skip
        for name, against in against_one_token.items():
            results[set_name][name]["identical_to_one_token"] = f"{against['identical']}/{len(prompt_ids)}"
            results[set_name][name]["divergences_from_one_token"] = against["divergences"]
        for name, row in results[set_name].items():
            prefill = "  ?" if row["prefill_share"] is None else f"{row['prefill_share']:.0%}"
            ties = sum(d.get("near_tie", False) for d in row["divergences"])
            print(f"{set_name:5s} {name:26s} {row['tokens_per_second']:7.2f} tok/s  x{row['vs_llama_cpp']:.2f} llama.cpp"
                  f"  prefill {prefill}  identical {row['identical_to_hf_float32_greedy']}"
                  f" ({ties} of {len(row['divergences'])} divergences near-ties)", flush=True)
        for name in ONE_TOKEN_OF:
            row = results[set_name][name]
            print(f"{set_name:5s} {name} identical to its one-token decoding {row['identical_to_one_token']}, "
                  f"divergences {row['divergences_from_one_token']}", flush=True)
    steps = {"eager": one_token_step_ms(specpass.compile_program(model, {"lowering": "eager", "budget": 1})),
             "auto (float32)": one_token_step_ms(programs["specpass_float32"]),
             "inductor (float32, compiled whole)": one_token_step_ms(
                 specpass.compile_program(model, {"lowering": "inductor", "budget": 1})),
             "bfloat16 (auto)": one_token_step_ms(programs["specpass_bfloat16_one_token"]),
             "gguf": one_token_step_ms(programs["specpass_gguf_one_token"]),
             "gguf-compiled": one_token_step_ms(programs["specpass_gguf_compiled_one_token"])}  # fmt: skip
    llama_decode = sorted(llama.decode_ms[0])
    steps["llama_cpp decode (its own eval timing, prefill excluded; median over prompts)"] = round(
        llama_decode[len(llama_decode) // 2], 2)
    llama.close()
    print("one-token step, ms:", steps, flush=True)
    report = {
        **run_identity(torch.device("cpu")),
        "cpu_flags": cpu_flags(),
        "llama_cpp": {"version": llama.info["version"], "system_info": llama.info["system_info"],
                      "process": "its own (benchmarks/llama_cpp_worker.py), prompts taking turns with the torch rows",
                      "extra_buffers": llama.info["extra_buffers"],
                      "crashed_with_extra_buffers": llama.crashed_with_extra_buffers},
        **evaluation_sets(prompts_per_set, max_new_tokens),
        "one_token_step_ms": steps,
        "results": results,
    }
    path = write_report(report, out_dir, prefix="gguf-")
    print(f"wrote {path}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=15, help="per set (15 + 15: the issue's 30 prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    run(args.prompts, args.max_new_tokens, args.out, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
