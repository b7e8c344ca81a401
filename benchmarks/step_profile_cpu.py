"""Where a one-token CPU step's time goes (issue 54): each lowering's step profiled by op, beside the
machine's memory bandwidth and the floor it sets.

    python benchmarks/step_profile_cpu.py [--lowerings eager onednn gguf] [--out benchmarks/results]

For each lowering of the default model's step (TreeAttention(64), budget 1): the median wall time of a
one-token forward after 256 committed slots, then 20 such forwards under torch.profiler with each op's
self CPU time summed into groups — GEMMs (the linears, whatever their kernel), attention, everything
else (norms, rotary, residual adds, cache writes, copies) — and the wall time no op accounts for (the
Python and dispatch between ops). The floor: the bytes of weights a step reads (float32 parameters, or
the GGUF file for the gguf lowering) over the machine's read bandwidth, measured as
the best of five sums over a 1 GiB float32 tensor. Writes step-profile-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import specpass
from specpass.backends.lowering.registry import LOWERINGS
from specpass.ir import SlotLayout
from specpass.models import GGUF_FILE, default_model_dir
from specpass.research.bench import run_identity, write_report

GROUPS = {  # op-name fragments -> group (first match wins)
    "gemm": ("addmm", "aten::mm", "linear", "int4pack", "int8pack", "mkldnn", "onednn", "matmul", "bmm_out"),
    "attention": ("scaled_dot_product", "softmax", "aten::bmm", "flash"),
}


def group_of(name: str) -> str:
    lowered = name.lower()
    return next((group for group, parts in GROUPS.items() if any(p in lowered for p in parts)), "other")


def read_bandwidth_gbs(gib: float = 1.0) -> float:
    """Bytes per second a sum reads from a tensor far larger than the caches (best of five)."""
    data = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


def weight_bytes(model, lowering: str) -> int:
    """Bytes of weights a one-token step reads: the model's float32 parameters (tied ones once), or for
    the gguf lowerings the GGUF file (its quantized blocks; an upper bound: it holds the embedding too)."""
    if LOWERINGS[lowering].reads_gguf:
        return os.path.getsize(os.path.join(default_model_dir(), GGUF_FILE))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def profile_lowering(model, lowering: str, context: int = 256, repeats: int = 20) -> dict:
    """One lowering's row (module docstring)."""
    program = specpass.compile_program(model, {"lowering": lowering, "budget": 1})
    token, layout = torch.tensor([1]), SlotLayout.chain(context, 1)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 3):
            started = time.perf_counter()
            program.measured_forward(token, layout)
            times.append(time.perf_counter() - started)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(repeats):
                program.measured_forward(token, layout)
            profiled_ms = 1e3 * (time.perf_counter() - started) / repeats
    groups = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    ops = []
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / repeats
        groups[group_of(event.key)] += ms
        ops.append((ms, event.key, event.count // repeats))
    ops.sort(reverse=True)
    return {
        "ms": round(1e3 * statistics.median(times[3:]), 2),
        "profiled_ms": round(profiled_ms, 2),
        "groups_ms": {k: round(v, 2) for k, v in groups.items()},
        "between_ops_ms": round(profiled_ms - sum(groups.values()), 2),
        "top_ops": [{"op": name, "ms": round(ms, 2), "calls": calls} for ms, name, calls in ops[:15]],
        "weight_mb": round(weight_bytes(model, lowering) / 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lowerings", nargs="+", default=["eager", "onednn", "gguf", "gguf-compiled"])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    model, _ = specpass.load_default_model()
    bandwidth = read_bandwidth_gbs()
    report = run_identity(torch.device("cpu")) | {"read_bandwidth_gbs": round(bandwidth, 2)}
    for lowering in args.lowerings:
        row = profile_lowering(model, lowering)
        row["bandwidth_floor_ms"] = round(row["weight_mb"] / 1e3 / bandwidth * 1e3, 2)
        report[lowering] = row
        print(lowering, {k: v for k, v in row.items() if k != "top_ops"}, flush=True)
    print("wrote", write_report(report, args.out, "step-profile-"))


if __name__ == "__main__":
    main()
