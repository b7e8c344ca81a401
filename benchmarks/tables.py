"""The measured tables of README.md and docs/benchmarks.md, rendered from the results JSON they cite.

A table sits between `<!-- table KIND benchmarks/results/NAME.json -->` and `<!-- /table -->`;
`render` rewrites every such block from its JSON (one run per table, its machine and date in the
caption), so a table cannot say what its run did not measure. tests/test_readme.py fails when a file
and its JSON disagree. KINDS: `decode` (a `specpass bench` report, CPU or GPU) and `ort_gpu`
(benchmarks/ort_gpu.py).

    python benchmarks/tables.py          # rewrites the tables of README.md and docs/benchmarks.md
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("README.md", "docs/benchmarks.md")  # the files whose measured tables come from JSON

BLOCK = re.compile(r"(<!-- table (?P<kind>\w+) (?P<path>\S+\.json) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)

# bench.py's row names -> the tables' labels, in the tables' order
DECODE_LABELS = {
    "hf_greedy": "HF greedy",
    "hf_static_compile": "HF static cache + `torch.compile`",
    "hf_prompt_lookup": "HF prompt lookup (10-token chain)",
    "hf_early_exit": "HF early exit (8 layers)",
    "specpass_greedy": "specpass greedy (one-node trees: the lowering alone)",
    "specpass_prompt_lookup": "specpass, prompt-lookup tree",
    "specpass_token_recycling": "specpass, token-recycling tree",
    "specpass_combined": "specpass, combined tree",
    "specpass_combined_64": "specpass, combined tree, 64 nodes every step",
    "specpass_medusa": "specpass, Medusa heads",
    "specpass_medusa_64": "specpass, Medusa heads, 64 nodes",
    "specpass_hydra": "specpass, Hydra heads",
    "specpass_hydra_64": "specpass, Hydra heads, 64 nodes",
    "specpass_hydra_combined": "specpass, Hydra + combined tree",
    "specpass_hydra_combined_64": "specpass, Hydra + combined, 64 nodes",
    "specpass_feature": "specpass, feature draft (EAGLE-3 style)",
    "specpass_feature_64": "specpass, feature draft, 64 nodes",
    "specpass_feature_combined": "specpass, feature draft + combined tree",
    "specpass_feature_combined_64": "specpass, feature draft + combined, 64 nodes",
    "specpass_onnxrt_greedy": "specpass on ONNX Runtime, greedy",
    "specpass_onnxrt_combined": "specpass on ONNX Runtime, combined tree",
}


def _machine(report: dict) -> str:
    cpu = report.get("cpu")
    threads = f", {report['threads']} threads" if report.get("threads") else ""
    return f"{report['device']} ({cpu}{threads})" if cpu else report["device"]


def _tau(row: dict) -> str:
    return "-" if row.get("tau") is None else f"{row['tau']:.2f}"


def decode_table(report: dict) -> list[str]:
    """Tokens/s, τ and the ratio to HF greedy per method and prompt set, with the run's identity."""
    sets = list(report["results"])
    names = [n for n in DECODE_LABELS if all(n in report["results"][s] for s in sets)]
    unknown = [n for s in sets for n in report["results"][s] if n not in DECODE_LABELS]
    if unknown:
        raise ValueError(f"no label for rows {sorted(set(unknown))}: add them to DECODE_LABELS")
    lines = [
        f"{report['date']}, {_machine(report)}, torch {report['torch']}, transformers {report['transformers']}, "
        f"{report['dtype']}, {report['prompts_per_set']} prompts per set, {report['max_new_tokens']} new tokens.",
        "",
        "| method | " + " | ".join(f"{s} tok/s | {s} τ | {s} vs HF greedy" for s in sets) + " | outputs ≠ HF greedy |",
        "| --- |" + " --- | --- | --- |" * len(sets) + " --- |",
    ]
    for name in names:
        cells = []
        for s in sets:
            row = report["results"][s][name]
            cells += [f"{row['tokens_per_second']:.1f}", _tau(row), f"{row['speedup_vs_hf_greedy']:.2f}x"]
        differing = [report["results"][s][name].get("outputs_differing_from_greedy") for s in sets]
        cells.append("-" if None in differing else f"{sum(differing)} of {report['prompts_per_set'] * len(sets)}")
        lines.append(f"| {DECODE_LABELS[name]} | " + " | ".join(cells) + " |")
    skipped = report.get("skipped", {})
    if skipped:
        lines += ["", "Not run: " + "; ".join(f"{name} ({why})" for name, why in skipped.items()) + "."]
    return lines


def ort_gpu_table(report: dict) -> list[str]:
    """Per dtype: HF greedy, ORT one-node and ORT combined tokens/s (code / chat), τ, outputs differing."""
    lines = [
        f"{report['date']}, {report['device']}, onnxruntime {report['onnxruntime']}, torch {report['torch']}, "
        f"{report['prompts_per_set']} prompts per set, {report['max_new_tokens']} new tokens; tokens/s code / chat.",
        "",
        "| dtype | HF greedy | ORT one-node | ORT combined (τ) | outputs ≠ HF greedy |",
        "| --- | --- | --- | --- | --- |",
    ]
    for dtype, run in report["results"].items():
        sets = list(run["sets"].values())

        def rate(name: str) -> str:
            return " / ".join(f"{s[name]['tokens_per_second']:.1f}" for s in sets)

        taus = " / ".join(f"{s['onnxrt_combined']['tau']:.2f}" for s in sets)
        differing = sum(s[n].get("outputs_differing_from_hf_greedy", 0) for s in sets for n in s)
        outputs = sum(len(s) - 1 for s in sets) * report["prompts_per_set"]
        lines.append(f"| {dtype} | {rate('hf_greedy')} | {rate('onnxrt_greedy')} | {rate('onnxrt_combined')} ({taus}) "
                     f"| {differing} of {outputs} |")  # fmt: skip
    return lines


KINDS: dict[str, Callable[[dict], list[str]]] = {"decode": decode_table, "ort_gpu": ort_gpu_table}


def render(text: str, root: str) -> str:
    """`text` with every table block rewritten from its JSON (paths relative to `root`)."""

    def block(match: re.Match) -> str:
        if match["kind"] not in KINDS:
            raise ValueError(f"unknown table kind {match['kind']!r} (one of {sorted(KINDS)})")
        with open(os.path.join(root, match["path"])) as f:
            report = json.load(f)
        return match.group(1) + "\n".join(KINDS[match["kind"]](report)) + "\n" + match.group(5)

    return BLOCK.sub(block, text)


def blocks(text: str) -> list[tuple[str, str]]:
    """(kind, JSON path) of each table block in `text`."""
    return [(m["kind"], m["path"]) for m in BLOCK.finditer(text)]


def main() -> int:
    for name in FILES:
        path = os.path.join(ROOT, name)
        with open(path) as f:
            text = f.read()
        rendered = render(text, ROOT)
        if rendered != text:
            with open(path, "w") as f:
                f.write(rendered)
        print(f"{name}: {len(blocks(text))} tables{' rewritten' if rendered != text else ', unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
