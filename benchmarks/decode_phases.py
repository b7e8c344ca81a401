"""Speculative decoding end to end (combined tree), and where a decode step's time goes.

The verify forward (its host-side call and, on a GPU, the wait for the device) against the host's
own work between two forwards (drafting, acceptance, the KV commit, the drafters' update). On a GPU
the host's work is time the device sits idle: at a 1.5 ms step, every millisecond of it costs 40 %
of the speed.

Phases per decode step (milliseconds, the mean over every step of every prompt after a warm-up):
- `draft`: drafting every row's tree (the batch's RowsDrafting.draft);
- `forward_call`: the program's forward until it returns (a CUDA-graph replay: host-side padding,
  input copies and the launch; a CPU: the whole forward);
- `forward_wait`: then until the device is done (CUDA only; the loop waits there anyway, for the
  top-k it reads next);
- `commit`: the accepted path's KV moved into place;
- `observe`: the drafters' update from the verify step;
- `other`: the rest of the loop (top-k to the host, acceptance, the tree's cut and mask, bookkeeping).
Plus `python_top`: the 20 Python functions with the most own time over one generation (cProfile,
which inflates Python-heavy code; read it for ranking, not for milliseconds).

--weights default: the default model and HumanEval tuning prompts (140..), each output compared with
HF greedy (`identical_to_hf_greedy`; in bf16 a difference may be a near-tie: tests/test_gpu.py
decides that); --weights random: random weights of SmolLM2-135M's shapes and random prompts, no EOS
(a step's host work depends on the tree's size, which `--budget 64` fixes, not on the weights;
nothing to transfer to a GPU machine).

--hf: also HF `generate` greedy and HF with a static cache + torch.compile on the same model and
prompts, in the same run (`hf`: tokens/s and milliseconds per token).

Usage: python benchmarks/decode_phases.py [--weights default|random] [--dtype bfloat16] [--lowerings ...]
       [--budget 64|cost] [--prompts 3] [--max-new-tokens 128] [--hf] [--out DIR]
Writes DIR/decode-phases[-random]-<device>.json (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import time

import torch

import specpass
from specpass.research import prompts
from specpass.research.bench import run_identity, write_report
from specpass.drafters import ChainDrafting, PerRowDrafting

DRAFTINGS = (ChainDrafting, PerRowDrafting)  # the loop's two ways of drafting a batch (Drafter.rows)

PHASES = ("draft", "forward_call", "forward_wait", "commit", "observe", "other")


class PhaseClock:
    """Wraps the decode loop's calls (the drafting's draft / observe, the program's forward / commit) with
    timers; `forward_wait` synchronizes the device right after the forward returns. `skip_prefill()`
    before a generation leaves its prompt's forward and commit out."""

    def __init__(self, program):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.program = program
        self.cuda = program.device.type == "cuda"
        self.skip: collections.Counter = collections.Counter()
        self._originals = {}

    def skip_prefill(self) -> None:
        self.skip.update(forward=1, commit=1)

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def _timed(self, name, fn, skippable: str | None = None):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            if skippable and self.skip[skippable]:
                self.skip[skippable] -= 1
            else:
                self._add(name, time.perf_counter() - started)
            return out

        return wrapper

    def __enter__(self):
        forward = self.program.forward

        def forward_then_wait(*args, **kwargs):
            started = time.perf_counter()
            out = forward(*args, **kwargs)
            returned = time.perf_counter()
            if self.cuda:
                torch.cuda.synchronize(self.program.device)
            if self.skip["forward"]:
                self.skip["forward"] -= 1
            else:
                self._add("forward_call", returned - started)
                self._add("forward_wait", time.perf_counter() - returned)
            return out

        self._originals = {(cls, name): getattr(cls, name) for cls in DRAFTINGS for name in ("draft", "observe")}
        for (cls, name), method in self._originals.items():
            setattr(cls, name, self._timed(name, method))
        self.program.forward = forward_then_wait
        self.program.commit = self._timed("commit", self.program.commit, skippable="commit")
        return self

    def __exit__(self, *exc):
        for (cls, name), method in self._originals.items():
            setattr(cls, name, method)
        del self.program.forward, self.program.commit  # the instance attributes: the methods show again


def load(weights: str, dtype: torch.dtype, device: str, count: int):
    if weights == "default":
        model, tokenizer = specpass.load_default_model(dtype=dtype, device=device)
        cases = [prompts.encode_code(tokenizer, p) for p in prompts.code_prompts(count, offset=140)]
        return model, [ids.to(device) for ids in cases]
    from gpu_step import random_model  # benchmarks/ is the script's directory

    model = random_model("135m", dtype, device)
    model.generation_config.eos_token_id = None  # HF generates every token too (specpass: eos_token_id=[])
    gen = torch.Generator().manual_seed(0)
    motif = torch.randint(0, 49152, (24,), generator=gen)  # repeated, so prompt lookup finds copies
    cases = [torch.cat([torch.randint(0, 49152, (60,), generator=gen), motif, motif[:12]])[None] for _ in range(count)]
    return model, [ids.to(device) for ids in cases]


@torch.no_grad()
def measure(model, cases, lowering: str, budget, max_new_tokens: int, compare: bool) -> dict:
    """compare: check each output against HF greedy (else generate past EOS: random weights)."""
    program = specpass.compile_program(model, {"lowering": lowering, "budget": budget})
    eos = {} if compare else {"eos_token_id": []}
    started = time.perf_counter()
    specpass.generate(program, cases[0], max_new_tokens=max_new_tokens, **eos)  # compile, captures, cost curve
    warm_up_s = time.perf_counter() - started
    references = [model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False) if compare else None
                  for ids in cases]  # fmt: skip
    steps = tokens = forwards = identical = 0
    seconds = decode_seconds = nodes = 0.0
    with PhaseClock(program) as clock:
        for ids, reference in zip(cases, references):
            clock.skip_prefill()
            out = specpass.generate(program, ids, max_new_tokens=max_new_tokens, **eos)
            steps += out.stats.target_forwards - 1  # the prefill is one forward here (no eviction)
            tokens += out.stats.new_tokens
            forwards += out.stats.target_forwards
            seconds += out.stats.seconds
            decode_seconds += out.stats.seconds - out.stats.prefill_seconds
            nodes += out.stats.mean_tree_size * (out.stats.target_forwards - 1)
            identical += compare and torch.equal(out.sequences, reference)
    total_ms = 1e3 * decode_seconds / steps
    step_ms = {name: 1e3 * clock.seconds[name] / steps for name in PHASES if name != "other"}
    step_ms["other"] = total_ms - sum(step_ms.values())
    profiler = cProfile.Profile()
    profiler.enable()
    specpass.generate(program, cases[-1], max_new_tokens=max_new_tokens, **eos)
    profiler.disable()
    stats = pstats.Stats(profiler)
    top = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:20]  # by own time
    result = {
        "warm_up_s": round(warm_up_s, 1),
        "steps": steps,
        "mean_tree_size": round(nodes / steps, 1),
        "tau": round(tokens / forwards, 3),
        "step_ms": round(total_ms, 3),
        "steps_per_s": round(1e3 / total_ms, 1),
        "tokens_per_s": round(tokens / seconds, 1),
        "decode_tokens_per_s": round((tokens - len(cases)) / decode_seconds, 1),
        **({"identical_to_hf_greedy": f"{identical}/{len(cases)}"} if compare else {}),
        "phase_ms": {name: round(step_ms[name], 3) for name in PHASES},
        "python_top": [(f"{path.rsplit('/', 1)[-1]}:{line}({name})", calls, round(own * 1e3, 1))
                       for (path, line, name), (_, calls, own, _, _) in top],  # fmt: skip
    }
    print(lowering, {k: v for k, v in result.items() if k != "python_top"}, flush=True)
    return result


@torch.no_grad()
def hf_baselines(model, cases, max_new_tokens: int) -> dict:
    """HF greedy and HF static cache + torch.compile (specpass.research.bench's runners), warmed up on every
    prompt once, then timed over all of them."""
    from specpass.research.bench import _compiled_forward, _ForwardCounter, _hf_runner

    counter, out = _ForwardCounter(model), {}
    for name in ("hf_greedy", "hf_static_compile"):
        compiled = _compiled_forward(model, model.device) if name == "hf_static_compile" else None
        run = _hf_runner(model, counter, model.device, name, compiled)
        for ids in cases:
            run(ids, max_new_tokens)
        tokens, seconds = 0, 0.0
        for ids in cases:
            _, new, _, took = run(ids, max_new_tokens)
            tokens, seconds = tokens + new, seconds + took
        out[name] = {"tokens_per_s": round(tokens / seconds, 1), "ms_per_token": round(1e3 * seconds / tokens, 3)}
        print(name, out[name], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", choices=("default", "random"), default="default")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lowerings", nargs="+", default=["auto"])
    parser.add_argument("--budget", default="64", help="an int (nodes every step) or 'cost'")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--hf", action="store_true", help="HF greedy and HF static cache + compile, same run")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    budget = args.budget if args.budget == "cost" else int(args.budget)
    model, cases = load(args.weights, dtype, args.device, args.prompts)
    report = run_identity(device) | {
        "dtype": str(dtype).removeprefix("torch."),
        "weights": "default model, HumanEval[140:] (tuning prompts)" if args.weights == "default"
                   else "random weights of SmolLM2-135M's shapes, random prompts with a repeated motif",
        "budget": budget, "max_new_tokens": args.max_new_tokens, "prompts": args.prompts,
        "drafter": "combined (prompt lookup + token recycling)", "lowerings": {},
    }  # fmt: skip
    for lowering in args.lowerings:
        report["lowerings"][lowering] = measure(model, cases, lowering, budget, args.max_new_tokens,
                                                 compare=args.weights == "default")
    if args.hf:
        report["hf"] = hf_baselines(model, cases, args.max_new_tokens)
    prefix = "decode-phases-" if args.weights == "default" else "decode-phases-random-"
    print(f"wrote {write_report(report, args.out, prefix=prefix)}")


if __name__ == "__main__":
    main()
