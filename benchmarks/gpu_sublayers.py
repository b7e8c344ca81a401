"""Per-rank compute of a tensor-parallel decoder layer's two sub-layers on one GPU (issue 26, item 4).

Under tensor parallelism of degree tp each rank runs, per layer, an attention sub-layer (RMSNorm, the
q|k|v GEMM over its nh/tp query and nkv/tp KV heads, rotary, a K/V cache write, attention over the
committed slots, the o GEMM over its heads' columns) and an MLP sub-layer (RMSNorm, the gate|up GEMM
over its I/tp rows, SiLU-gate, the down GEMM over its I/tp columns), each followed by an all-reduce.
This script times those two shards, c_attn and c_mlp, replayed in CUDA graphs on one GPU, for
Llama-3.1-8B's and Llama-3.1-70B's shapes at tp = 1, 2, 4, 8 and batch 1 and 4 (bf16, random weights,
one decode token per row over COMMITTED slots). They are the compute terms of the ladder projection
t_std = L (c_attn + a + c_mlp + a), t_ladder = L (max(c_attn, a) + max(c_mlp, a)) + a; the all-reduce
latency a is not measured here (one GPU).

Each graph runs `copies` distinct instances of the sub-layer back to back (distinct weights, together
at least 4x the GPU's L2), so no instance reads its weights from L2; the time per instance is the
replay's (CUDA events over 50 replays, median of 5) / copies.

Usage: python benchmarks/gpu_sublayers.py [--out DIR]   writes DIR/gpu-sublayers-<device>.json
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

from specpass.research.bench import run_identity, write_report

SHAPES = {  # hidden, intermediate, layers, query heads, KV heads, head dim
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128),
    "llama-3.1-70b": (8192, 28672, 80, 64, 8, 128),
}
TPS = (1, 2, 4, 8)
BATCHES = (1, 4)
COMMITTED = 1024
DTYPE = torch.bfloat16


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class AttentionShard:
    """One rank's attention sub-layer: x [B, 1, H] -> o [B, 1, H] (before the all-reduce)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, batch: int):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm = torch.ones(hidden, dtype=DTYPE, device="cuda")
        self.qkv = torch.randn((heads + 2 * kv_heads) * head_dim, hidden, dtype=DTYPE, device="cuda") * 0.02
        self.o = torch.randn(hidden, heads * head_dim, dtype=DTYPE, device="cuda") * 0.02
        self.k = torch.randn(batch, kv_heads, COMMITTED + 1, head_dim, dtype=DTYPE, device="cuda")
        self.v = torch.randn_like(self.k)

    def weight_bytes(self) -> int:
        return (self.qkv.numel() + self.o.numel()) * 2

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, d = x.shape[0], self.head_dim
        qkv = F.linear(_rms(x, self.norm), self.qkv)  # [B, 1, (nh + 2 nkv) d]
        q, k, v = qkv.split((self.heads * d, self.kv_heads * d, self.kv_heads * d), -1)
        q = _rotate(q.view(b, 1, self.heads, d).transpose(1, 2), cos, sin)  # [B, nh, 1, d]
        k = _rotate(k.view(b, 1, self.kv_heads, d).transpose(1, 2), cos, sin)  # [B, nkv, 1, d]
        self.k[:, :, COMMITTED:] = k
        self.v[:, :, COMMITTED:] = v.view(b, 1, self.kv_heads, d).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, self.k, self.v, enable_gqa=True)  # [B, nh, 1, d]
        return F.linear(attn.transpose(1, 2).reshape(b, 1, self.heads * d), self.o)


class MlpShard:
    """One rank's MLP sub-layer: x [B, 1, H] -> [B, 1, H] (before the all-reduce)."""

    def __init__(self, hidden: int, intermediate: int):
        self.norm = torch.ones(hidden, dtype=DTYPE, device="cuda")
        self.gate_up = torch.randn(2 * intermediate, hidden, dtype=DTYPE, device="cuda") * 0.02
        self.down = torch.randn(hidden, intermediate, dtype=DTYPE, device="cuda") * 0.02

    def weight_bytes(self) -> int:
        return (self.gate_up.numel() + self.down.numel()) * 2

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(_rms(x, self.norm), self.gate_up).chunk(2, -1)
        return F.linear(F.silu(gate) * up, self.down)


def replay_us(instances: list, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> float:
    """Microseconds per instance of one CUDA-graph replay running every instance back to back."""
    def run():
        y = x
        for layer in instances:
            y = layer(y, cos, sin)
        return y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / 50 / len(instances))
    return statistics.median(samples)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for shape, (hidden, inter, layers, heads, kv_heads, head_dim) in SHAPES.items():
        for tp in TPS:
            for batch in BATCHES:
                x = torch.randn(batch, 1, hidden, dtype=DTYPE, device="cuda")
                angle = torch.rand(1, 1, 1, head_dim, device="cuda") * math.pi
                cos, sin = angle.cos().to(DTYPE), angle.sin().to(DTYPE)
                row = {"shape": shape, "tp": tp, "batch": batch, "layers": layers}
                for name, make in (("attention", lambda: AttentionShard(hidden, heads // tp, kv_heads // tp,
                                                                        head_dim, batch)),
                                   ("mlp", lambda: MlpShard(hidden, inter // tp))):  # fmt: skip
                    one = make()
                    copies = max(4, math.ceil(4 * l2 / one.weight_bytes()))
                    instances = [one] + [make() for _ in range(copies - 1)]
                    row[f"{name}_us"] = round(replay_us(instances, x, cos, sin), 2)
                    row[f"{name}_weight_mb"] = round(one.weight_bytes() / 1e6, 2)
                    row[f"{name}_copies"] = copies
                    del instances, one
                    torch.cuda.empty_cache()
                rows.append(row)
                print(row, flush=True)
    report = {**run_identity(torch.device("cuda")), "dtype": "bfloat16", "committed_slots": COMMITTED,
              "l2_bytes": l2, "results": rows}  # fmt: skip
    print("wrote", write_report(report, args.out, prefix="gpu-sublayers-"))


if __name__ == "__main__":
    main()
