"""The decode loop's own cost: a tiny random Llama (2 layers, 32 wide, whose forward costs little, so the
loop's host work shows) at B = 1 / 8 / 32, specpass against HF batched greedy in the same run.

    python benchmarks/host_cost.py [--models peaked rarely_accepting] [--batches 1 8 32] [--max-new-tokens 64]
                                   [--repeats 3] [--tag NAME]

Two models, both `specpass.research.tiny_models.tiny_model("llama")`: "peaked", its LM head scaled by 8
(a peaked next-token law, where drafts get accepted: the model the batch notes measured), and
"rarely_accepting", its queries and keys scaled by 128 (`rarely_accepting_tiny_llama`: drafts rarely
match, so speculation can only cost). Rows: 32 prompts of 24-40 random tokens (seeded), each with a repeated
stretch for prompt lookup to find; every B decodes the first B rows, left-padded for HF, with the
attention mask for specpass. Rows run `--max-new-tokens` tokens (no EOS).

Per model and B, best of `--repeats` runs: tokens/s of HF batched greedy (DynamicCache), specpass with
one-node trees (budget 1: no drafting, the loop alone) and with its default drafter and cost budget;
steps per second; tau; and rows differing from HF's padded batch (expected 0: float32).
Writes benchmarks/results/host_cost-<device>.json.
"""

from __future__ import annotations

import argparse
import time

import torch

import specpass
from specpass.research import bench
from specpass.rewrites import TreeAttention
from specpass.research.tiny_models import tiny_model

ROWS = 32


def peaked_tiny_llama() -> torch.nn.Module:
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def rarely_accepting_tiny_llama() -> torch.nn.Module:
    """Queries and keys x128: attention picks single positions by their rotary phase, so a token's
    successor depends on where it stands, not on the token (tau 1.25 with trees of 8, against 2.3 for
    the weights as they are, whose greedy output falls into loops that prompt lookup and Token
    Recycling predict)."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(128.0)
            layer.self_attn.k_proj.weight.mul_(128.0)
    return model


MODELS = {"peaked": peaked_tiny_llama, "rarely_accepting": rarely_accepting_tiny_llama}


def rows(count: int = ROWS) -> list[list[int]]:
    """`count` prompts of 24-40 tokens in [3, 96), each ending with a repeat of one of its stretches."""
    gen = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(count):
        n = 16 + int(torch.randint(0, 17, (), generator=gen))
        head = torch.randint(3, 96, (n,), generator=gen).tolist()
        start = int(torch.randint(0, n - 8, (), generator=gen))
        prompts.append(head + head[start : start + 8])
    return prompts


def _padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :], mask[b, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default=None, help="a suffix for the results file (e.g. a commit)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    torch.manual_seed(0)
    new = args.max_new_tokens
    prompts = rows(max(args.batches))
    configs = {
        "one_node": {"pipeline": specpass.Pipeline(TreeAttention(1)), "budget": 1, "lowering": "eager"},
        "default_drafter": {"lowering": "eager"},
        "default_drafter_inductor": {"lowering": "inductor"},  # the same loop, the forward compiled
    }
    results = {}
    for model_name in args.models:
        model = MODELS[model_name]()
        results[model_name] = {}
        for b in args.batches:
            ids, mask = _padded(prompts[:b])
            programs = {name: specpass.compile_program(model, options, rows=b) for name, options in configs.items()}
            for program in programs.values():
                program.cost_curve  # measured before timing

            def hf():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                     pad_token_id=0, eos_token_id=None)  # fmt: skip
                return [row[ids.shape[1] :] for row in out.tolist()], None

            def run(program):
                def call():
                    program.forget()  # every repeat starts from the same drafter memory
                    out = specpass.generate(program, ids, new, attention_mask=mask, eos_token_id=[])
                    batch = [out] if b == 1 else None
                    new_tokens = [out.sequences[0, ids.shape[1] :].tolist()] if batch else [list(t) for t in out.new_tokens]
                    stats = [out.stats] if batch else list(out.stats)
                    return new_tokens, stats

                return call

            runners = {"hf_batched_greedy": hf} | {name: run(p) for name, p in programs.items()}
            for call in runners.values():
                call()  # warm-up
            best = {name: float("inf") for name in runners}
            outputs = {}
            for _ in range(args.repeats):  # the runners take turns: a slow spell hits them alike
                for name, call in runners.items():
                    started = time.perf_counter()
                    outputs[name] = call()
                    best[name] = min(best[name], time.perf_counter() - started)
            reference = outputs["hf_batched_greedy"][0]
            line = {}
            for name, (tokens, stats) in outputs.items():
                count = sum(map(len, tokens))
                entry = {"seconds": round(best[name], 4), "tokens_per_second": round(count / best[name], 1)}
                if stats is not None:
                    forwards = sum(s.target_forwards for s in stats)
                    entry |= {"tau": round(count / forwards, 3),
                              "steps_per_second": round(max(len(s.steps) for s in stats) / best[name], 1),
                              "rows_differing_from_hf_padded_batch": sum(t != r for t, r in zip(tokens, reference))}  # fmt: skip
                line[name] = entry
            greedy = line["hf_batched_greedy"]["tokens_per_second"]
            for entry in line.values():
                entry["x_hf_batched_greedy"] = round(entry["tokens_per_second"] / greedy, 3)
            results[model_name][str(b)] = line
            print(f"{model_name} B={b}: " + ", ".join(f"{k} {v['tokens_per_second']} tok/s ({v['x_hf_batched_greedy']}x)"
                                         for k, v in line.items()), flush=True)  # fmt: skip
    report = {
        **bench.run_identity(torch.device("cpu")),
        "model": "tiny random Llama (2 layers, hidden 32, vocab 96): peaked = LM head x8, rarely_accepting = q/k x128",
        "rows": f"{max(args.batches)} seeded random prompts with a repeated stretch; B decodes the first B",
        "max_new_tokens": new,
        "repeats": f"best of {args.repeats}",
        "results": results,
    }
    path = bench.write_report(report, args.out_dir, prefix=f"host_cost{'-' + args.tag if args.tag else ''}-")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
