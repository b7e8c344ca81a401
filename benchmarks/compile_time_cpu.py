"""How long a `gguf-compiled` program takes to be ready: in a fresh process with an empty inductor
cache (the first compile) and in a second process on that cache (issue 54: <= 120 s and <= 10 s).

    python benchmarks/compile_time_cpu.py [--lowering gguf-compiled] [--out benchmarks/results]

Each measurement is a child process of its own on one temporary TORCHINDUCTOR_CACHE_DIR, run twice:
seconds to import and load the default model, then to build the program and measure its cost curve
(every shape the program runs is compiled there: one token, several tokens), and inductor's cache hits
and misses. Writes compile-time-<lowering>-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, sys, time
started = time.perf_counter()
import torch, specpass
from torch._dynamo.utils import counters
model, _ = specpass.load_default_model()
loaded = time.perf_counter()
program = specpass.compile_program(model, {"lowering": sys.argv[1]})
program.cost_curve
ready = time.perf_counter()
print(json.dumps({"import_and_load_s": round(loaded - started, 1), "build_and_compile_s": round(ready - loaded, 1),
                  "fxgraph_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
                  "fxgraph_cache_misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def run(lowering: str, out_dir: str) -> dict:
    import torch

    from specpass.research.bench import run_identity, write_report

    runs = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for name in ("first process, empty cache", "second process, warm cache"):
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", CHILD, lowering], env=env, capture_output=True, text=True, check=True)
            row = {"run": name, "process_s": round(time.perf_counter() - started, 1),
                   **json.loads(done.stdout.strip().splitlines()[-1])}  # fmt: skip
            print(row, flush=True)
            runs.append(row)
    report = {**run_identity(torch.device("cpu")), "lowering": lowering, "runs": runs}
    path = write_report(report, out_dir, prefix=f"compile-time-{lowering}-")
    print(f"wrote {path}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lowering", default="gguf-compiled")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    run(args.lowering, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
