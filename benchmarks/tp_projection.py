"""Projected decode speed of tensor-parallel Llama-3.1-8B and -70B with and without the ladder (issue 26, item 4).

The model, per decode step of a model with L layers at TP degree tp (each layer: an attention and an MLP
sub-layer, each followed by one all-reduce of latency a; c_rest: the LM head and embedding):

    t_std    = L (c_attn + a + c_mlp + a) + c_rest
    t_ladder = L (max(c_attn, a) + max(c_mlp, a)) + a + c_rest + 2 L r

Each ladder all-reduce runs while the next sub-layer computes and costs what it outlasts that compute
by, plus r: a part of every collective that does not overlap (its launch and the cross-stream
synchronisation around it, and the SMs its kernel holds). r = 0 is ideal overlap, the model the issue
names; it overestimates every measured ladder run (below), so the script also reports r = 6.6 us, the
base latency NCCL's own tuning model gives a ring all-reduce with the LL protocol (`baseLat` in
src/graph/tuning.cc; measured floors agree: ~6 us for 2 H100 with CUDA graphs, NVIDIA/nccl #1259).
That term was added after the ideal model failed the validation: its form is a hypothesis, its value
is not fitted to any ladder run.

Inputs, none of them taken from a ladder run:
- Compute: the ladder authors' "upper bound" runs of Llama-3.1-70B (every all-reduce removed; gpt-fast
  with torch.compile and CUDA graphs on 8 H100 SXM with NVLink; tokens/s at TP 2/4/8, batch 1 and 4;
  `tools/plot-70b.py` of github.com/mayank31398/ladder-residual-inference). Per (tp, batch) the step
  time is fitted as t = L * f + bytes_per_gpu / bandwidth over TP 2/4/8 (least squares; f: a fixed
  time per layer, split evenly between the two sub-layers), and each sub-layer's compute is f/2 plus the
  bytes of its weights shard over that bandwidth. 8B uses the same f and bandwidth with its own shapes.
- All-reduce latency a: from the same authors' standard runs, (t_std - t_upper_bound) / (2 L): the
  exposed time per all-reduce on their stack, 13.0 / 14.7 / 24.2 us at TP 2/4/8 (batch 1). An
  independent check at TP 8: NCCL all-reduce of 16 KiB bf16 on 8 H100, 22.1-22.4 us (pytorch/helion
  PR #245 and yifuwang/symm-mem-recipes PR #3; eager `dist.all_reduce`, CUDA events); latency is flat
  in size at these messages (21.4-24.0 us from 8 to 32 KiB), so 8B's 8 KiB messages take the same a.

Validation: the measured ladder runs (70B at TP 2/4/8, batch 1 and 4; 8B TP 8 batch 4 from the authors'
blog) against the projection. The acceptance line is the 70B TP 8 batch 1 speed-up, 1.308x, within
+-0.05. Writes benchmarks/results/tp-projection.json and prints the tables.

    python benchmarks/tp_projection.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

TPS = (2, 4, 8)


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    vocab: int = 128256

    def attention_bytes(self) -> int:  # bf16 q|k|v and o weights of one layer
        return 2 * self.hidden * (2 * self.heads + 2 * self.kv_heads) * self.head_dim

    def mlp_bytes(self) -> int:  # bf16 gate|up and down
        return 2 * 3 * self.hidden * self.intermediate

    def head_bytes(self) -> int:  # bf16 LM head, sharded over the vocabulary
        return 2 * self.vocab * self.hidden

    def bytes_per_gpu(self, tp: int) -> float:
        return (self.layers * (self.attention_bytes() + self.mlp_bytes()) + self.head_bytes()) / tp


SHAPES = {"llama-3.1-8b": Shape(32, 4096, 14336, 32, 8), "llama-3.1-70b": Shape(80, 8192, 28672, 64, 8)}

# tokens/s summed over the batch, 8 x H100 NVLink (tools/plot-70b.py, mayank31398/ladder-residual-inference)
MEASURED_70B = {
    1: {"standard": (35.42, 59.41, 77.39), "ladder": (36.69, 67.51, 101.22), "upper_bound": (38.24, 69.04, 110.59)},
    4: {"standard": (120.58, 185.01, 258.56), "ladder": (126.09, 204.3, 331.45), "upper_bound": (130.77, 213.73, 355.8)},
}
MEASURED_8B_TP8_BATCH4 = {"standard": 902.44, "ladder": 1305.52}  # the authors' blog (Together AI), 8 x H100
NCCL_16KIB_8XH100_US = 22.4  # pytorch/helion PR #245 / yifuwang/symm-mem-recipes PR #3, eager dist.all_reduce
NCCL_BASE_LATENCY_US = 6.6  # NCCL src/graph/tuning.cc baseLat, Ring LL (Tree LL: 6.8)
OVERLAP_COSTS = (0.0, NCCL_BASE_LATENCY_US)


def step_us(tokens_per_second: float, batch: int) -> float:
    return 1e6 * batch / tokens_per_second


def fit_compute(batch: int) -> tuple[float, float]:
    """(f: fixed microseconds per layer, bandwidth in bytes per microsecond) from the 70B upper-bound
    runs at TP 2/4/8: least squares of t = L f + bytes_per_gpu / bandwidth."""
    shape = SHAPES["llama-3.1-70b"]
    xs = [shape.bytes_per_gpu(tp) for tp in TPS]
    ys = [step_us(v, batch) for v in MEASURED_70B[batch]["upper_bound"]]
    mean_x, mean_y = sum(xs) / 3, sum(ys) / 3
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return (mean_y - slope * mean_x) / shape.layers, 1 / slope


def all_reduce_us(batch: int) -> dict[int, float]:
    """Exposed microseconds per all-reduce in the authors' standard 70B runs, per TP degree."""
    runs, layers = MEASURED_70B[batch], SHAPES["llama-3.1-70b"].layers
    return {tp: (step_us(s, batch) - step_us(u, batch)) / (2 * layers)
            for tp, s, u in zip(TPS, runs["standard"], runs["upper_bound"])}  # fmt: skip


def project(shape: Shape, tp: int, fixed_us: float, bandwidth: float, a: float, r: float) -> dict:
    """The module docstring's t_std and t_ladder (microseconds) for one shape and TP degree."""
    c_attn = fixed_us / 2 + shape.attention_bytes() / tp / bandwidth
    c_mlp = fixed_us / 2 + shape.mlp_bytes() / tp / bandwidth
    c_rest = shape.head_bytes() / tp / bandwidth
    standard = shape.layers * (c_attn + a + c_mlp + a) + c_rest
    ladder = shape.layers * (max(c_attn, a) + max(c_mlp, a) + 2 * r) + a + c_rest
    return {"c_attn_us": round(c_attn, 1), "c_mlp_us": round(c_mlp, 1), "all_reduce_us": round(a, 1),
            "overlap_cost_us": r,
            "standard_step_us": round(standard, 1), "ladder_step_us": round(ladder, 1),
            "speedup": round(standard / ladder, 3)}  # fmt: skip


def measured_speedup(name: str, tp: int, batch: int) -> float | None:
    if name == "llama-3.1-70b":
        runs = MEASURED_70B[batch]
        return runs["ladder"][TPS.index(tp)] / runs["standard"][TPS.index(tp)]
    if (tp, batch) == (8, 4):
        return MEASURED_8B_TP8_BATCH4["ladder"] / MEASURED_8B_TP8_BATCH4["standard"]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rows = []
    for batch in (1, 4):
        fixed_us, bandwidth = fit_compute(batch)
        latencies = all_reduce_us(batch)
        print(f"batch {batch}: fixed {fixed_us:.1f} us per layer, {bandwidth / 1e6:.2f} TB/s; all-reduce "
              + " / ".join(f"{latencies[tp]:.1f}" for tp in TPS) + f" us at TP {'/'.join(map(str, TPS))}")
        for name, shape in SHAPES.items():
            for tp in TPS:
                for r in OVERLAP_COSTS:
                    row = project(shape, tp, fixed_us, bandwidth, latencies[tp], r)
                    measured = measured_speedup(name, tp, batch)
                    rows.append({"shape": name, "tp": tp, "batch": batch, **row,
                                 "standard_tokens_per_s": round(1e6 * batch / row["standard_step_us"], 1),
                                 "ladder_tokens_per_s": round(1e6 * batch / row["ladder_step_us"], 1),
                                 "measured_speedup": None if measured is None else round(measured, 3),
                                 "error": None if measured is None else round(row["speedup"] - measured, 3)})  # fmt: skip
    fixed_us, bandwidth = fit_compute(1)
    independent = [project(SHAPES["llama-3.1-70b"], 8, fixed_us, bandwidth, NCCL_16KIB_8XH100_US, r) for r in OVERLAP_COSTS]
    print("\n| shape | tp | batch | c_attn (us) | c_mlp (us) | a (us) | r (us) | standard tok/s | ladder tok/s "
          "| speed-up | measured | error |\n" + "| --- " * 12 + "|")  # fmt: skip
    for row in rows:
        measured = "" if row["measured_speedup"] is None else f"{row['measured_speedup']} | {row['error']:+}"
        print(f"| {row['shape']} | {row['tp']} | {row['batch']} | {row['c_attn_us']} | {row['c_mlp_us']} | "
              f"{row['all_reduce_us']} | {row['overlap_cost_us']} | {row['standard_tokens_per_s']} | "
              f"{row['ladder_tokens_per_s']} | {row['speedup']} | {measured or '- | -'} |")
    for r, row in zip(OVERLAP_COSTS, independent):
        print(f"70B TP 8 batch 1, a = {NCCL_16KIB_8XH100_US} us (independent NCCL figure), r = {r} us: {row['speedup']}x")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tp-projection.json")
    with open(path, "w") as f:
        json.dump({"model": __doc__.split("\n\n")[1:4], "rows": rows,
                   "independent_all_reduce_check": independent}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
