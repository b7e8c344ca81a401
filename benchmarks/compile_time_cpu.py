"""How long a `lowering="gguf-compiled"` program takes to be ready: in a fresh process that compiles
its package (none on disk) and in a second process that loads it (issue 54: <= 120 s and <= 10 s).

    python benchmarks/compile_time_cpu.py [--out benchmarks/results]

Each measurement is a child process of its own, on an empty inductor cache (TORCHINDUCTOR_CACHE_DIR, a
temporary folder); the first deletes the program's package before building it. Reported: seconds to
import and load the default model, then to build the program and measure its cost curve (the package is
compiled or loaded at its first call, there), whether the process compiled the package, the package's
size, and the whole process's seconds. Writes compile-time-cpu-<device>.json.
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
import json, os, sys, time
started = time.perf_counter()
import torch, specpass
model, _ = specpass.load_default_model()
loaded = time.perf_counter()
program = specpass.compile_program(model, {"lowering": "gguf-compiled"})
step = program.step.run.steps["gguf-compiled"]
if sys.argv[1] == "fresh" and os.path.exists(step.package_path):
    os.remove(step.package_path)
program.cost_curve
ready = time.perf_counter()
print(json.dumps({"import_and_load_s": round(loaded - started, 1), "build_and_compile_s": round(ready - loaded, 1),
                  "compiled_the_package": step.built_here, "package_mb": round(os.path.getsize(step.package_path) / 2**20)}))
"""


def run(out_dir: str) -> dict:
    import torch

    from specpass.research.bench import run_identity, write_report

    runs = []
    for name, mode in (("first process, no package", "fresh"), ("second process, the package on disk", "again")):
        with tempfile.TemporaryDirectory() as inductor_cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, check=True)
        row = {"run": name, "process_s": round(time.perf_counter() - started, 1),
               **json.loads(done.stdout.strip().splitlines()[-1])}  # fmt: skip
        print(row, flush=True)
        runs.append(row)
    report = {**run_identity(torch.device("cpu")), "lowering": "gguf-compiled", "runs": runs}
    path = write_report(report, out_dir, prefix="compile-time-")
    print(f"wrote {path}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    run(parser.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
