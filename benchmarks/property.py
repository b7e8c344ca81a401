"""The property test (tests/test_property.py) run long: many random tiny models per family instead of the
suite's two, each with random prompts, trees, budgets, drafters and batch rows, each checked against
HF greedy. Records how many examples ran and passed per family, the time, and the first failure's
message if any (Hypothesis shrinks it to a small case).

    python benchmarks/property.py --examples 40     # writes benchmarks/results/property-<device>.json
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import torch

from specpass.bench import run_identity, write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# "  - during generate phase (12.34 seconds):\n    - Typical runtimes: ...\n    - 40 passing examples, 0 failing..."
_TEST = re.compile(r"test_property\.py::\S+\[(?P<arch>[^\]]+)\]:")
_COUNTS = re.compile(r"(?P<passing>\d+) passing examples?, (?P<failing>\d+) failing examples?, (?P<invalid>\d+) invalid")


def per_family(statistics: str) -> dict[str, dict[str, int]]:
    """Passing / failing / invalid examples per family, summed over Hypothesis's phases."""
    out: dict[str, dict[str, int]] = {}
    arch = None
    for line in statistics.splitlines():
        if match := _TEST.search(line):
            arch = match["arch"]
            out[arch] = {"passing": 0, "failing": 0, "invalid": 0}
        elif arch and (match := _COUNTS.search(line)):
            for key in ("passing", "failing", "invalid"):
                out[arch][key] += int(match[key])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=40, help="examples per family")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-show-statistics",
               "tests/test_property.py"]  # fmt: skip
    start = time.perf_counter()
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                         env=os.environ | {"SPECPASS_PROPERTY_EXAMPLES": str(args.examples)})  # fmt: skip
    seconds = time.perf_counter() - start
    families = per_family(run.stdout)
    failures = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    report = {**run_identity(torch.device("cpu")), "examples_per_family": args.examples, "seconds": round(seconds, 1),
              "passed": run.returncode == 0, "families": families,
              "examples": sum(f["passing"] + f["failing"] for f in families.values()), "failures": failures,
              "command": " ".join(command[1:]), "pytest_summary": run.stdout.strip().splitlines()[-1:]}  # fmt: skip
    print(write_report(report, args.out, "property-"))
    print(f"{report['examples']} examples over {len(families)} families in {seconds:.0f} s: "
          f"{'all equal HF greedy' if report['passed'] else 'FAILED: ' + '; '.join(failures)}")  # fmt: skip
    return 0 if report["passed"] and len(families) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
