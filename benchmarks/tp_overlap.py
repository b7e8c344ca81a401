"""How much all-reduce time the ladder hides under tensor parallelism (issue 26), on the CPU with gloo.

Run with `torchrun --nproc-per-node 2 benchmarks/tp_overlap.py` (each process one thread). The model is
a random-weight Llama with 12 layers, hidden 512, 8 heads, 4 KV heads, MLP 1536, vocabulary 32000:
SmolLM2-like widths that split over 2 processes (SmolLM2-135M's 3 KV heads do not). For the standard
and the fully laddered model (LadderResidual over every layer), sharded by TensorParallel, at T = 1, 16
and 64 tokens over 256 committed slots, the eager FX step runs 30 times and each rank records:

- `step_ms`: the step's median wall time;
- `issue_ms` / `blocked_ms`: per step, the time inside the all-reduce calls and inside their waits
  (the graph's wait_tensor nodes are swapped for a timed copy of the same op);
- `standalone_ms`: one all-reduce + wait of the same message ([1, T, 512] float32) with nothing to
  overlap, median of 200, times the 24 all-reduces of a step;
- `hidden_fraction`: 1 - (issue + blocked) / standalone: the share of the communication time that
  compute covered.

Rank 0 writes benchmarks/results/tp-overlap-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import specpass
from specpass.research.bench import run_identity, write_report
from specpass.ir import SlotLayout, capture
from specpass.rewrites import LadderResidual, TensorParallel, TreeAttention
from specpass.rewrites.tensor_parallel import collective_nodes

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)  # fmt: skip
SIZES = (1, 16, 64)
COMMITTED = 256
_ops = torch.ops._c10d_functional
_clock = {"issue": 0.0, "blocked": 0.0}


def _timed_all_reduce(tensor, op, group):
    start = time.perf_counter()
    out = _ops.all_reduce.default(tensor, op, group)
    _clock["issue"] += time.perf_counter() - start
    return out


def _timed_wait(tensor):
    start = time.perf_counter()
    out = _ops.wait_tensor.default(tensor)
    _clock["blocked"] += time.perf_counter() - start
    return out


def _instrumented(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The same graph with its all-reduces and their waits timed (the logits gather is left alone)."""
    for reduce in collective_nodes(gm.graph, _ops.all_reduce.default):
        for wait in list(reduce.users):
            wait.target = _timed_wait
        reduce.target = _timed_all_reduce
    gm.recompile()
    return gm


def _standalone_ms(size: int, group: str) -> float:
    message = torch.randn(1, size, SHAPE["hidden_size"])
    samples = []
    for _ in range(200):
        dist.barrier()
        start = time.perf_counter()
        _ops.wait_tensor.default(_ops.all_reduce.default(message, "sum", group))
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


@torch.no_grad()
def measure(model, ladder: LadderResidual, size: int) -> dict:
    pipeline = specpass.Pipeline(TreeAttention(64), ladder, TensorParallel())
    gm, _ = pipeline.run(capture(model, cache_size=COMMITTED + 64))
    gm = _instrumented(gm)
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = SlotLayout.chain(COMMITTED, size).step_inputs(torch.zeros(1, size, dtype=torch.long))
    inputs = {k: v for k, v in inputs.items() if k in names}
    steps, issue, blocked = [], [], []
    for i in range(35):
        dist.barrier()
        _clock.update(issue=0.0, blocked=0.0)
        start = time.perf_counter()
        gm(**inputs)
        if i >= 5:  # warm-up
            steps.append(time.perf_counter() - start)
            issue.append(_clock["issue"])
            blocked.append(_clock["blocked"])
    reduces = len(collective_nodes(gm.graph, _timed_all_reduce))
    standalone = reduces * _standalone_ms(size, dist.group.WORLD.group_name)
    communication = 1e3 * (statistics.median(issue) + statistics.median(blocked))
    return {
        "step_ms": round(1e3 * statistics.median(steps), 3),
        "issue_ms": round(1e3 * statistics.median(issue), 3),
        "blocked_ms": round(1e3 * statistics.median(blocked), 3),
        "standalone_ms": round(standalone, 3),
        "hidden_fraction": round(1 - communication / standalone, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    results = {}
    for name, ladder in (("standard", LadderResidual()), ("laddered", LadderResidual.top(SHAPE["num_hidden_layers"]))):
        for size in SIZES:
            results[f"{name}_T{size}"] = row = measure(model, ladder, size)
            if dist.get_rank() == 0:
                print(f"{name:9} T={size:<3} {row}", flush=True)
    if dist.get_rank() == 0:
        report = {**run_identity(torch.device("cpu")), "processes": dist.get_world_size(), "threads_per_process": 1,
                  "model": f"random-weight Llama {SHAPE}", "committed_slots": COMMITTED, "results": results}  # fmt: skip
        print(f"wrote {write_report(report, args.out, prefix='tp-overlap-')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
