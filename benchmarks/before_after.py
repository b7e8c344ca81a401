"""Two checkouts of specpass on the same machine, in turns: step times per lowering and end-to-end tokens/s.

    python benchmarks/before_after.py --before /path/to/old/.venv/bin/python [--prompts 6] [--rounds 2]

Each round runs a worker process under the old checkout's interpreter, then one under this checkout's
(`sys.executable`), ABAB..., so drift of the machine shows as a difference between rounds of the same
checkout. A worker (this file with --worker; it uses only APIs both checkouts have) measures:
  steps   the one-token, 4-, 16- and 64-token verify step of each CPU lowering after 256 committed
          tokens (median of 15 after 3 warm-up calls; DecodeProgram.measured_forward), default model
  decode  tokens/s of the default program (`auto`, combined tree, cost budget) and of `gguf-compiled`
          on the benchmark's evaluation prompts (code then chat, 128 new tokens, greedy), and how
          many outputs equal HF float32 greedy (the old checkout's float32 outputs are that reference)
Writes before-after-<device>.json: every round's numbers and the ratio of the medians (after / before).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

LOWERINGS = ("eager", "onednn", "gguf", "gguf-compiled")
SIZES = (1, 4, 16, 64)


def worker(prompts: int, max_new_tokens: int) -> dict:
    import torch

    import specpass
    from specpass.ir import SlotLayout
    from specpass.research import prompts as P
    from specpass.research.bench import CODE_OFFSET

    model, tokenizer = specpass.load_default_model()
    steps = {}
    for lowering in LOWERINGS:
        program = specpass.compile_program(model, {"lowering": lowering, "budget": 1})
        per_size = {}
        for size in SIZES:
            tokens = torch.ones(size, dtype=torch.long)
            times = []
            for _ in range(18):
                started = time.perf_counter()
                program.measured_forward(tokens, SlotLayout.chain(256, size))
                times.append(time.perf_counter() - started)
            per_size[str(size)] = round(1e3 * statistics.median(times[3:]), 2)
        steps[lowering] = per_size
    ids = [P.encode_code(tokenizer, p) for p in P.code_prompts(prompts, CODE_OFFSET)]
    ids += [P.encode_chat(tokenizer, m) for m in P.chat_messages(prompts, 0)]
    decode, outputs = {}, {}
    for name, options in (("auto", {}), ("gguf-compiled", {"lowering": "gguf-compiled"})):
        program = specpass.compile_program(model, options)
        program.cost_curve  # measured (and a package compiled or loaded) before the clock
        specpass.generate(program, ids[0], 16)
        tokens, seconds, rows = 0, 0.0, []
        for prompt in ids:
            out = specpass.generate(program, prompt, max_new_tokens)
            tokens += out.stats.new_tokens
            seconds += out.stats.seconds
            rows.append(out.sequences[0].tolist())
        decode[name] = round(tokens / seconds, 2)
        outputs[name] = rows
    return {"steps_ms": steps, "decode_tokens_per_second": decode, "outputs": outputs, "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="the old checkout's Python (its venv's bin/python)")
    parser.add_argument("--prompts", type=int, default=6, help="per set (code, chat)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.prompts, args.max_new_tokens)))
        return 0
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        for side, python in (("before", args.before), ("after", sys.executable)):
            started = time.time()
            command = [python, __file__, "--worker", "--prompts", str(args.prompts),
                       "--max-new-tokens", str(args.max_new_tokens)]  # fmt: skip
            result = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            runs[side].append(result)
            print(f"round {round_} {side}: {time.time() - started:.0f} s, decode {result['decode_tokens_per_second']}, "
                  f"one-token steps { {k: v['1'] for k, v in result['steps_ms'].items()} }", flush=True)
    reference = runs["before"][0]["outputs"]["auto"]  # the old float32 program equals HF float32 greedy (its tests)

    def median(side: str, pick) -> float:
        return round(statistics.median(pick(run) for run in runs[side]), 2)

    steps = {
        lowering: {size: {side: median(side, lambda r, l=lowering, s=size: r["steps_ms"][l][s]) for side in runs}
                   for size in map(str, SIZES)}
        for lowering in LOWERINGS
    }  # fmt: skip
    decode = {name: {side: median(side, lambda r, n=name: r["decode_tokens_per_second"][n]) for side in runs}
              for name in ("auto", "gguf-compiled")}  # fmt: skip
    for row in (*(v for per in steps.values() for v in per.values()), *decode.values()):
        row["after_over_before"] = round(row["after"] / row["before"], 3)
    same = {name: sum(a == b for a, b in zip(runs["after"][-1]["outputs"][name], reference))
            for name in ("auto", "gguf-compiled")}  # fmt: skip
    from specpass.research.bench import run_identity, write_report
    import torch

    report = {**run_identity(torch.device("cpu")), "rounds": args.rounds, "prompts_per_set": args.prompts,
              "max_new_tokens": args.max_new_tokens, "steps_ms_median": steps, "decode_tokens_per_second_median": decode,
              "after_outputs_equal_to_before_float32": {k: f"{v}/{len(reference)}" for k, v in same.items()},
              "runs": {side: [{k: v for k, v in r.items() if k != "outputs"} for r in rs] for side, rs in runs.items()}}  # fmt: skip
    path = write_report(report, args.out, prefix="before-after-")
    print(json.dumps({"steps_ms_median": steps, "decode": decode, "same_as_before_float32": same}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
