"""The `specpass` command: `generate` (speculative vs plain greedy on one prompt) and `bench`."""

from __future__ import annotations

import argparse
import os
import sys
import time

from specpass.drafters.registry import DRAFTER_NAMES


def _pipeline(text: str | None):
    from specpass.backends.options import default_pipeline
    from specpass.passes import Pipeline

    if text is None:
        return default_pipeline()
    if os.path.exists(text):
        with open(text) as f:
            text = f.read()
    return Pipeline.from_json(text)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    import specpass
    from specpass.drafters.registry import drafter_by_name
    from specpass.prompts import encode_chat, encode_code

    torch.manual_seed(0)
    model, tokenizer = specpass.load_default_model()
    options = {"pipeline": _pipeline(args.pipeline), "drafter": drafter_by_name(args.drafter)}
    compiled = torch.compile(model, backend="specpass", options=options)
    if args.raw:
        ids = encode_code(tokenizer, args.prompt)
    else:
        ids = encode_chat(tokenizer, [{"role": "user", "content": args.prompt}])
    if ids.shape[1] == 0:
        raise specpass.InvalidParameterError("the prompt is empty")
    specpass.compile_program(compiled)  # capture, rewrite, lower and measure the cost curve up front

    started = time.perf_counter()
    reference = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    greedy_seconds = time.perf_counter() - started
    out = specpass.generate(compiled, ids, max_new_tokens=args.max_new_tokens)

    print(tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True))
    print()
    greedy_tokens = reference.shape[1] - ids.shape[1]
    greedy_rate = greedy_tokens / greedy_seconds
    print(f"{'':18}{'tokens':>8}{'tokens/s':>10}{'tau':>7}")
    print(f"{'plain greedy (HF)':18}{greedy_tokens:>8}{greedy_rate:>10.1f}{1.0:>7.2f}")
    s = out.stats
    print(f"{'specpass':18}{s.new_tokens:>8}{s.tokens_per_second:>10.1f}{s.tau:>7.2f}")
    same = torch.equal(out.sequences, reference)
    print(f"speedup {s.tokens_per_second / greedy_rate:.2f}x, identical to greedy: {same}")
    print(f"stats: {s}")
    return 0 if same else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from specpass.bench import run_benchmark

    run_benchmark(
        prompts_per_set=args.prompts, max_new_tokens=args.max_new_tokens, out_dir=args.out, compile_baseline=args.compile
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specpass", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="speculative generation on the default model, beside plain greedy")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--pipeline", help="pipeline JSON, or a file holding it (default: TreeAttention)")
    gen.add_argument("--drafter", choices=DRAFTER_NAMES, default="combined")
    gen.add_argument("--raw", action="store_true", help="continue the prompt as raw text (no chat template)")
    gen.set_defaults(run=cmd_generate)
    bench = sub.add_parser("bench", help="tokens/s and tau against HF baselines, measured in one run")
    bench.add_argument("--prompts", type=int, default=10, help="prompts per set (code, chat)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--out", default="benchmarks/results")
    bench.add_argument(
        "--compile", choices=("auto", "yes", "no"), default="auto", help="HF static cache + torch.compile baseline"
    )
    bench.set_defaults(run=cmd_bench)
    args = parser.parse_args(argv)
    from specpass.errors import SpecpassError

    try:
        return args.run(args)
    except SpecpassError as exc:
        print(f"specpass: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
