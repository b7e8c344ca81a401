"""What verifying T tokens costs on a mixture of experts, beside a dense model of the same active size,
and the tree size the cost budget then picks.

Two random Qwen3 models of one shape (4 layers, hidden 256, 4 heads of 64, 2 KV heads, vocabulary
4096): "mixture", Qwen3-MoE with 8 experts of width 256, top-2 (512 MLP columns active per token);
"dense", Qwen3 with an MLP of width 512 (the same active size). For each, the program's measured
cost curve (its verify forward at T = 1 .. 64, `backends.runtime.cost.measure`, eager lowering,
float32), and the tree size `CostCurve.best_size` picks for two acceptance profiles of a best-first
binary tree (a node at depth d accepted with probability p^d, p = 0.6 and 0.85).

    python benchmarks/moe_cost.py         # writes benchmarks/results/moe-cost-<device>.json
"""

from __future__ import annotations

import argparse
import math

import torch
import transformers

import specpass
from specpass.research import bench
from specpass.rewrites import TreeAttention

SHAPE = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, max_position_embeddings=1024)  # fmt: skip
SIZES = (1, 2, 4, 8, 16, 32, 64)
PROFILES = (0.6, 0.85)


def models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    mixture = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SHAPE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512))
    dense = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, intermediate_size=512))
    return {"mixture": mixture.eval(), "dense": dense.eval()}


def expected_tokens(p: float, nodes: int = 64) -> list[float]:
    """[n - 1]: expected tokens a step verifying the first n nodes of a best-first binary tree, a node
    at depth d accepted with probability p^d (the root's bonus token counted)."""
    scores = [p ** (1 + int(math.log2(i))) for i in range(1, nodes)]  # node i at depth floor(log2 i) + 1
    out, total = [1.0], 1.0
    for s in scores:
        total += s
        out.append(total)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    report = {"device": bench.device_label(torch.device("cpu")), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "sizes": list(SIZES), "models": {}}  # fmt: skip
    for name, model in models().items():
        options = {"pipeline": specpass.Pipeline(TreeAttention(64)), "lowering": "eager", "budget": "cost",
                   "cache_size": 512}  # fmt: skip
        program = specpass.compile_program(model, options)
        curve = program.cost_curve.subset(SIZES)
        entry = {"ms": [round(s * 1e3, 3) for s in curve.seconds],
                 "relative": {str(n): round(r, 2) for n, r in curve.relative().items()},
                 "parameters_active_mlp": 2 * 3 * 256 * 256 if name == "mixture" else 3 * 512 * 256,
                 "best_size": {str(p): curve.best_size(expected_tokens(p)) for p in PROFILES}}  # fmt: skip
        report["models"][name] = entry
        print(name, entry)
    print(bench.write_report(report, args.out, prefix="moe-cost-"))


if __name__ == "__main__":
    main()
