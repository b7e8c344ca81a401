"""Batched decoding on the default model: specpass at B = 1, 2, 4, 8 against HF batched greedy and HF
static cache + torch.compile batched, in the same run, code and chat prompts mixed in each batch.

    python benchmarks/batch.py [--prompts 4] [--batches 1 2 4 8] [--max-new-tokens 128] [--no-compile-baseline]
        [--device cuda --dtype bfloat16 --lowering cudagraphs --max-batches 2 --no-alone-reference] [--phases]

The evaluation prompts (HumanEval[120:120+N] raw, chat summaries [0:N]) are interleaved code, chat,
code, ... and cut into consecutive batches of B, so every B generates the same rows. HF's batches are
left-padded (its convention for decoder-only generation); specpass's take the same padded ids with
the attention mask. Per B: new tokens / wall seconds over all batches, tau (specpass), and how many
specpass rows differ from the row generated alone by HF greedy (float32: expected 0) and from HF's
padded batch (padding changes HF's own rounding, so a rare flip there is HF's, reported as is).
Writes benchmarks/results/batch-<device>.json and .png.

On a GPU (`--device cuda`): HF's static-cache baseline is HF's own auto-compile (bench._compiled_forward);
`--max-batches N` times at most N batches per B (the first N x B rows), so small B do not spend the
lease on many sequential batches; `--no-alone-reference` skips generating every row alone (bf16 rows
are compared with HF's padded batch only, where rounding differs anyway). `--phases` adds, at the largest
B, where a step of one batch goes: the host's phases against its wait for the device.
"""

from __future__ import annotations

import argparse
import time

import torch

import specpass
from specpass.research import bench
from specpass.research import prompts as P


def _padded(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids [B, P] and attention_mask [B, P] of prompts [1, P_b]."""
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - r.shape[1] :], mask[b, width - r.shape[1] :] = r[0], 1
    return ids, mask


def _new_tokens(sequences: torch.Tensor, width: int, eos: set[int], pad: int) -> list[list[int]]:
    """Each row's new tokens from a [B, width + N] output (up to and including its first EOS)."""
    out = []
    for row in sequences[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), None)
        out.append(row if cut is None else row[: cut + 1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set (rows = 2 x this)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-compile-baseline", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lowering", default="auto", help="specpass lowering (CompileOptions.lowering)")
    parser.add_argument("--max-batches", type=int, default=None, help="timed batches per B (default: all rows)")
    parser.add_argument("--no-alone-reference", action="store_true")
    parser.add_argument("--phases", action="store_true",
                        help="profile one batch at the largest B: per-step host phases vs the device's wait")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, tokenizer = specpass.load_default_model(dtype=dtype, device=device)
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])  # fmt: skip
    pad = model.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else min(eos)
    code = [P.encode_code(tokenizer, p) for p in P.code_prompts(args.prompts, bench.CODE_OFFSET)]
    chat = [P.encode_chat(tokenizer, m) for m in P.chat_messages(args.prompts)]
    rows = [r for pair in zip(code, chat) for r in pair]  # code, chat, code, chat, ...
    new = args.max_new_tokens
    compiled_forward = None if args.no_compile_baseline else bench._compiled_forward(model, device)

    def hf(ids, mask, static: bool):
        kwargs, original = {}, model.forward
        if static:
            from transformers import StaticCache

            kwargs[bench._cache_kwarg(model)] = StaticCache(config=model.config, max_cache_len=bench.STATIC_CACHE_LEN)
            model.forward = compiled_forward or original  # None on a GPU: HF compiles a static-cache forward itself
        try:
            return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=pad,
                                  **kwargs)  # fmt: skip
        finally:
            model.forward = original

    # each row generated alone by HF greedy: the reference (B = 1's HF run when B = 1 is measured)
    alone: list[list[int]] = []
    results = {}
    for b in args.batches:
        batches = [rows[i : i + b] for i in range(0, len(rows) - b + 1, b)][: args.max_batches]
        padded = [tuple(t.to(device) for t in _padded(batch, pad)) for batch in batches]
        runners = {"hf_batched_greedy": lambda ids, mask: hf(ids, mask, static=False)}
        if not args.no_compile_baseline:
            runners["hf_static_compile_batched"] = lambda ids, mask: hf(ids, mask, static=True)
        program = specpass.compile_program(model, {"lowering": args.lowering}, rows=b)
        program.cost_curve  # measured before timing
        runners["specpass_batched"] = lambda ids, mask: specpass.generate(program, ids, new, attention_mask=mask)
        ids, mask = padded[0]
        for run in runners.values():  # warm-up on three prompt widths: the compiled HF forward settles on
            for cut in (0, 3, 7):  # a dynamic prefill graph for this B; the program's cost curve is measured
                run(ids[:, cut:], mask[:, cut:])
        program.forget()
        totals = {name: {"tokens": 0, "forwards": 0, "seconds": 0.0, "rows": []} for name in runners}
        for ids, mask in padded:  # the runners take turns on each batch: a slow spell hits them alike
            for name, run in runners.items():
                bench._sync(device)
                t0 = time.perf_counter()
                out = run(ids, mask)
                bench._sync(device)
                totals[name]["seconds"] += time.perf_counter() - t0
                if name == "specpass_batched":
                    got = [list(t) for t in out.new_tokens] if b > 1 else [out.sequences[0, ids.shape[1] :].tolist()]
                    totals[name]["forwards"] += sum(s.target_forwards for s in (out.stats if b > 1 else (out.stats,)))
                else:
                    got = _new_tokens(out, ids.shape[1], eos, pad)
                totals[name]["tokens"] += sum(len(g) for g in got)
                totals[name]["rows"] += got
        if not alone and not args.no_alone_reference:
            alone = [model.generate(r.to(device), max_new_tokens=new, do_sample=False)[0, r.shape[1] :].tolist()
                     for r in rows] if b != 1 or len(batches) < len(rows) else totals["hf_batched_greedy"]["rows"]  # fmt: skip
        line = {}
        for name, t in totals.items():
            line[name] = {"rows": len(t["rows"]), "tokens": t["tokens"], "seconds": round(t["seconds"], 3),
                          "tokens_per_second": round(t["tokens"] / t["seconds"], 2)}  # fmt: skip
            if alone:
                line[name]["rows_differing_from_hf_greedy_alone"] = sum(g != a for g, a in zip(t["rows"], alone))
        hf_rows = totals["hf_batched_greedy"]["rows"]
        line["specpass_batched"] |= {
            "tau": round(totals["specpass_batched"]["tokens"] / totals["specpass_batched"]["forwards"], 3),
            "rows_differing_from_hf_padded_batch": sum(g != h for g, h in zip(totals["specpass_batched"]["rows"], hf_rows)),
        }  # fmt: skip
        greedy = line["hf_batched_greedy"]["tokens_per_second"]
        for entry in line.values():
            entry["speedup_vs_hf_batched_greedy"] = round(entry["tokens_per_second"] / greedy, 3)
        if args.phases and b == max(args.batches):
            line["specpass_batched"]["step_phases_ms"] = _phases(program, *padded[0], new)
        results[str(b)] = line
        print(f"B={b}: " + ", ".join(f"{k} {v['tokens_per_second']} tok/s ({v['speedup_vs_hf_batched_greedy']}x)"
                                     for k, v in line.items()), flush=True)  # fmt: skip
        _write(args, device, results)  # after every B: a run cut short keeps what it measured



def _write(args, device: torch.device, results: dict) -> None:
    report = {
        **bench.run_identity(device),
        "dtype": args.dtype,
        "lowering": args.lowering,
        **bench.evaluation_sets(args.prompts, args.max_new_tokens),
        "rows": "code and chat interleaved, cut into consecutive batches of B (the same rows for every B)",
        "drafter": "default (Combined(PromptLookup(), TokenRecycling())), budget 'cost'",
        "results": results,
    }
    path = bench.write_report(report, args.out_dir, prefix="batch-")
    _plot(report, path.removesuffix(".json") + ".png")
    print(f"wrote {path}", flush=True)


def _phases(program, ids: torch.Tensor, mask: torch.Tensor, new: int) -> dict:
    """Milliseconds per decode step of one batch, by phase (decode_phases.PhaseClock: `forward_wait` is
    the host waiting for the device, the rest is the host's own work), the prefill left out."""
    from decode_phases import PHASES, PhaseClock  # benchmarks/ is the script's directory

    from specpass.backends.runtime import decode as loop

    prefill, steps = loop._prefill, [0]

    def untimed_prefill(*args):
        prefill(*args)
        clock.seconds.clear()
        steps[0] = 0

    with PhaseClock(program) as clock:
        forward = program.forward
        program.forward = lambda *a, **k: (steps.__setitem__(0, steps[0] + 1), forward(*a, **k))[1]
        loop._prefill = untimed_prefill
        try:
            out = specpass.generate(program, ids, new, attention_mask=mask)
        finally:
            loop._prefill = prefill
    stats = out.stats if isinstance(out.stats, tuple) else (out.stats,)
    decode = max(s.seconds for s in stats) - stats[0].prefill_seconds
    step_ms = {name: 1e3 * clock.seconds[name] / steps[0] for name in PHASES if name != "other"}
    step_ms["other"] = 1e3 * decode / steps[0] - sum(step_ms.values())
    step_ms["step"] = 1e3 * decode / steps[0]
    step_ms["host_share"] = 1 - step_ms["forward_wait"] / step_ms["step"]
    print("phases at B =", len(stats), {k: round(v, 3) for k, v in step_ms.items()}, flush=True)
    return {"steps": steps[0], **{k: round(v, 3) for k, v in step_ms.items()}}


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [int(b) for b in report["results"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in next(iter(report["results"].values())):
        rates = [report["results"][str(b)][name]["tokens_per_second"] for b in batches]
        ax.plot(batches, rates, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size B")
    ax.set_ylabel("new tokens / s (all rows)")
    ax.set_title(f"Batched decoding, SmolLM2-135M {report['dtype']}\n{report['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
