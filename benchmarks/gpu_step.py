"""GPU decode-step profile (issue 30): what one verify step costs, per model shape, dtype, lowering and
tree size, against the weights' bandwidth floor.

Model shapes: SmolLM2-135M-Instruct's (the default model) and Llama-3.1-8B's, both with random
weights (a step's time does not depend on the weights' values; nothing is downloaded). Lowerings:
`cudagraphs` (the FX step replayed in CUDA graphs), `inductor` (the inductor-compiled step
replayed in CUDA graphs), both with q|k|v and gate|up fused (backends.lowering.fuse_projections), and
`inductor-unfused` (the inductor step without that fusion, for comparison in the same run). A
lowering named `name@backend` (e.g. `cudagraphs@efficient_attention`) is captured with only that
scaled-dot-product-attention backend allowed (torch.nn.attention.SDPBackend).
Per (shape, dtype, lowering):

- `call_ms[T]`: one verify step of T tokens over 256 committed slots through the lowering's call, as
  the decode loop makes it (host-side padding and input copies included), median of 50;
- `replay_ms[T]`: the bare CUDA-graph replay of the same bucket (CUDA events over 200 replays);
- `kernels`: CUDA kernels one un-graphed step launches (torch.profiler, T = 2), and the 8 costliest;
- `floor_ms`: parameter bytes / measured read bandwidth (a bf16 sum over 4 GiB).

End to end, with where a decode step's time goes: benchmarks/decode_phases.py.

Usage: python benchmarks/gpu_step.py [--shapes 135m 8b] [--dtypes bfloat16 float32] [--lowerings ...]
       [--out DIR]
Writes DIR/gpu-step-<device>.json (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

import specpass
from specpass.backends.lowering.cudagraphs import CudaGraphStep
from specpass.backends.lowering.inductor import InductorStep
from specpass.backends.lowering.registry import lower
from specpass.research.bench import write_report
from specpass.ir import SlotLayout, capture

SIZES = (1, 2, 4, 8, 16, 32, 64)
COMMITTED = 256
CACHE_SIZE = 1024
SHAPES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=True, max_position_embeddings=8192),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False, max_position_embeddings=131072,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}  # fmt: skip


def random_model(shape: str, dtype: torch.dtype, device: str = "cuda") -> torch.nn.Module:
    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)  # the same weights every run (timings do not depend on them; decode_phases' trees do)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def read_bandwidth() -> float:
    """Bytes per second a bf16 sum over 4 GiB reads (the weights' streaming rate in a decode step)."""
    x = torch.ones(2 << 30, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        x.sum()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        x.sum()
    end.record()
    torch.cuda.synchronize()
    return 10 * x.numel() * x.element_size() / (start.elapsed_time(end) / 1e3)


def call_ms(step, size: int) -> float:
    layout = SlotLayout.chain(COMMITTED, size, "cuda")
    ids = torch.zeros(1, size, dtype=torch.long, device="cuda")
    for _ in range(3):  # capture, then warm replays
        step(ids, layout)
    samples = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(ids, layout)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples)


def replay_ms(step, size: int) -> float:
    graph = step.graphs[step._bucket(SlotLayout.chain(COMMITTED, size, "cuda"))][0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(200):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 200


def kernels(run_graph, inputs: dict) -> dict:
    run_graph(inputs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_graph(inputs)
        torch.cuda.synchronize()
    device_events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    costliest = sorted(device_events, key=lambda e: e.device_time_total, reverse=True)[:8]
    return {
        "count": sum(e.count for e in device_events),
        "device_ms": round(sum(e.device_time_total for e in device_events) / 1e3, 4),
        "costliest": [(e.key[:90], e.count, round(e.device_time_total / 1e3, 4)) for e in costliest],
    }


@torch.no_grad()
def profile(shape: str, dtype: torch.dtype, lowerings, bandwidth: float, result: dict, save) -> None:
    """Fills `result` one lowering at a time, calling `save()` after each (a run cut short keeps what
    it measured)."""
    model = random_model(shape, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gm, _ = specpass.Pipeline(specpass.rewrites.TreeAttention(max(SIZES))).run(capture(model, cache_size=CACHE_SIZE))
    result.update(weight_bytes=weight_bytes, floor_ms=round(1e3 * weight_bytes / bandwidth, 4), lowerings={})
    for lowering in lowerings:
        started = time.perf_counter()
        name, _, backend = lowering.partition("@")
        try:
            with sdpa_kernel(getattr(SDPBackend, backend.upper())) if backend else contextlib.nullcontext():
                if name == "inductor-unfused":
                    step = CudaGraphStep(InductorStep(gm), max_nodes=max(SIZES), cache_size=CACHE_SIZE)
                else:
                    step, _, _ = lower(gm, name, torch.device("cuda"), max(SIZES), CACHE_SIZE)
                step(torch.zeros(1, 1, dtype=torch.long, device="cuda"), SlotLayout.chain(COMMITTED, 1, "cuda"))
                first_call_s = time.perf_counter() - started
                calls = {n: round(call_ms(step, n), 4) for n in SIZES}  # every bucket captured in the block
        except RuntimeError as exc:  # e.g. an attention backend with no kernel for this mask
            result["lowerings"][lowering] = {"failed": f"{type(exc).__name__}: {str(exc)[:200]}"}
            print(shape, dtype, lowering, result["lowerings"][lowering], flush=True)
            save()
            continue
        replays = {n: round(replay_ms(step, n), 4) for n in SIZES}
        # T = 2: the inductor step's buckets start there (its T = 1 specialisation is never compiled)
        inputs = SlotLayout.chain(COMMITTED, 2, "cuda").step_inputs(torch.zeros(1, 2, dtype=torch.long, device="cuda"))
        result["lowerings"][lowering] = {
            "first_call_s": round(first_call_s, 2),
            "call_ms": calls,
            "replay_ms": replays,
            "call_relative": {n: round(calls[n] / calls[1], 3) for n in SIZES},
            "kernels": kernels(step.eager.run_graph, inputs),
        }
        print(shape, dtype, lowering, result["lowerings"][lowering], flush=True)
        save()
    del model, gm
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=["135m", "8b"], choices=sorted(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--lowerings", nargs="+", default=["cudagraphs", "inductor", "inductor-unfused"])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    bandwidth = read_bandwidth()
    report = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "committed_slots": COMMITTED,
        "notes": "random weights with the named model's shapes; call_ms includes host-side padding and "
                 "input copies, replay_ms is the bare CUDA graph",
        "profiles": {},
    }  # fmt: skip

    def save() -> None:
        print(f"wrote {write_report(report, args.out, prefix='gpu-step-')}", flush=True)

    for shape in args.shapes:
        for dtype_name in args.dtypes if shape == "135m" else ["bfloat16"]:
            result = report["profiles"].setdefault(f"{shape}-{dtype_name}", {})
            profile(shape, getattr(torch, dtype_name), args.lowerings, bandwidth, result, save)


if __name__ == "__main__":
    main()
