"""The property test (tests/test_property.py) run long: many random tiny models per family instead of the
suite's two, each with random prompts, trees, budgets, drafters and batch rows, each checked against
HF greedy. Records how many examples passed per family, drafter, batch rows and tree size, the time,
and the failing tests if any (Hypothesis shrinks a failure to a small case).

    python benchmarks/property.py --examples 40     # writes benchmarks/results/property-<device>.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from specpass.research.bench import run_identity, write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def summary(examples: list[dict]) -> dict:
    """Passing examples per family, drafter, batch rows and tree size."""
    out: dict = {}
    for key in ("arch", "drafter", "rows", "max_nodes"):
        counts: dict = {}
        for example in examples:
            counts[str(example[key])] = counts.get(str(example[key]), 0) + 1
        out[key] = dict(sorted(counts.items()))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=40, help="examples per family")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_property.py"]
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "examples.jsonl")
        start = time.perf_counter()
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                             env=os.environ | {"SPECPASS_PROPERTY_EXAMPLES": str(args.examples),
                                               "SPECPASS_PROPERTY_LOG": log})  # fmt: skip
        seconds = time.perf_counter() - start
        examples = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
    failures = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    report = {**run_identity(torch.device("cpu")), "examples_per_family": args.examples, "seconds": round(seconds, 1),
              "passed": run.returncode == 0, "passing_examples": len(examples), "per": summary(examples),
              "failures": failures, "command": " ".join(command[1:]),
              "pytest_summary": run.stdout.strip().splitlines()[-1:]}  # fmt: skip
    print(write_report(report, args.out, "property-"))
    print(f"{len(examples)} passing examples over {len(report['per']['arch'])} families in {seconds:.0f} s"
          + ("" if report["passed"] else ": FAILED " + "; ".join(failures)))  # fmt: skip
    return 0 if report["passed"] and examples else 1


if __name__ == "__main__":
    sys.exit(main())
