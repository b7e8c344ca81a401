"""`specpass eval-kv`: what each KV-eviction policy costs in quality and saves in memory (issue 25), and
each sparse attention (TidalDecode, TokenSelect) in quality, its budget being the slots a sparse layer
attends to (its cache keeps every token).

For each input length and each policy x budget (a fraction of the length), on the embedded model:

* perplexity token by token through the decode path (the text fed in pieces of `chunk` tokens,
  evicting as the policy says: the same cache as one token at a time), on standard-library sources
  (specpass.research.long_context), beside the full cache;
* greedy agreement: 128 tokens continued greedily from that text, against the full cache's
  (positions equal, and the first position that differs);
* passkey retrieval (exact match), over seeds x depths;
* the cache's bytes, read from the tensors the program allocated (K/V buffers and the policy's state);
* at one length, speculative decoding with the policy against the same policy one token a step
  (outputs must be equal) over several prompts, and tokens/s beside full-cache speculative decoding;
* at one length and budget, the ONNX export on ONNX Runtime (CPU EP): the full cache and each chosen
  policy exported, the same perplexity and continuation measured on ORT, the ORT program's cache
  bytes beside its full cache's, and the tokens against the PyTorch program's.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from ..backends.runtime.decode import feed
from ..backends.runtime.decode import generate as decode
from ..backends.runtime.sequence import CacheCursor
from ..backends.options import CompileOptions
from ..backends.runtime.program import SpeculativeProgram
from ..drafters.registry import drafter_by_name
from .long_context import library_sequences, passkey_prompt
from ..passes import Pipeline
from ..rewrites import A2SF, EMS, H2O, TOVA, Keyformer, KVEviction, SinksWindow, SnapKV, TidalDecode, TokenSelect, TreeAttention, TrimKV

POLICIES = {
    "window": lambda budget, chunk: SinksWindow(budget, chunk, sinks=0),  # no sinks: StreamingLLM's collapse
    "sinks-window": lambda budget, chunk: SinksWindow(budget, chunk),
    "h2o": H2O,
    "a2sf": A2SF,
    "tova": TOVA,
    "snapkv": SnapKV,
    "keyformer": Keyformer,
    "ems": EMS,
    "tidal-decode": lambda budget, chunk: TidalDecode(budget),  # budget: slots a sparse layer attends to
    "token-select": lambda budget, chunk: TokenSelect(budget),
}
FULL = "full"


@dataclass(frozen=True)
class Protocol:
    """What one run measures (the defaults are the issue's protocol; a 2-core run takes a subset)."""

    lengths: tuple[int, ...] = (2048, 4096, 8192)
    budgets: tuple[float, ...] = (0.10, 0.25, 0.50)
    policies: tuple[str, ...] = tuple(POLICIES)
    chunk: int = 32
    new_tokens: int = 128
    passkey_lengths: tuple[int, ...] = (2048, 4096, 8192)
    passkey_budgets: tuple[float, ...] = (0.10, 0.25, 0.50)
    passkey_seeds: int = 20
    passkey_depths: int = 5
    speculation_length: int = 4096
    speculation_budget: float = 0.25
    speculation_policies: tuple[str, ...] = ("tova",)
    onnx_length: int = 8192
    onnx_budget: float = 0.25
    onnx_policies: tuple[str, ...] = ("tova",)  # (): no ONNX phase
    speculation_prompts: int = 20  # 0: no speculation phase


def trim_kv(gates_directory: str):
    """The trim-kv entry of POLICIES for gates trained by `specpass train-retention`."""
    return lambda budget, chunk: TrimKV(budget, chunk, gates_directory=gates_directory)


def _evicts(policy_name: str) -> bool:
    """Whether the policy cuts the cache (a KV eviction) rather than what attention reads."""
    return isinstance(POLICIES[policy_name](64, 8), KVEviction)


def _pipeline(policy_name: str, budget: int, chunk: int) -> Pipeline:
    passes = [TreeAttention(chunk)]
    if policy_name != FULL:
        passes.append(POLICIES[policy_name](budget, chunk))
    return Pipeline(*passes)


def _program(model, policy_name: str, budget: int, chunk: int, cache_size: int, speculative: bool = False):
    options = CompileOptions(pipeline=_pipeline(policy_name, budget, chunk), cache_size=cache_size,
                             budget="cost" if speculative else 1,
                             drafter=drafter_by_name("combined"))  # fmt: skip
    return SpeculativeProgram(model, options)  # not the per-model cache of programs: freed after use


@torch.no_grad()
def perplexity_and_continuation(program, ids: torch.Tensor, chunk: int, new_tokens: int) -> tuple[float, list[int]]:
    """Perplexity of ids [N] fed through the decode path, then `new_tokens` greedy tokens one a step."""
    cursor, nll, position = CacheCursor(), 0.0, 0
    for logits, _, _ in feed(program, [ids.tolist()], [cursor], piece=chunk):  # [1, n, V]
        logits = logits[0]  # [n, V]
        targets = ids[position + 1 : position + 1 + logits.shape[0]]
        log_probs = logits[: targets.shape[0]].float().log_softmax(-1)
        nll -= log_probs.gather(1, targets[:, None]).sum().item()
        position += logits.shape[0]
    tokens = [int(logits[-1].argmax())]
    for _ in range(new_tokens - 1):
        for logits, _, _ in feed(program, [tokens[-1:]], [cursor], piece=1):  # [1, 1, V]
            tokens.append(int(logits[0, -1].argmax()))
    return math.exp(nll / (ids.shape[0] - 1)), tokens


def agreement(tokens: list[int], reference: list[int]) -> dict:
    same = [a == b for a, b in zip(tokens, reference)]
    first = next((i for i, s in enumerate(same) if not s), len(same))
    return {"equal_positions": sum(same) / len(same), "first_difference": first}


@torch.no_grad()
def passkey_hits(program, tokenizer, length: int, seeds: int, depths: int) -> list[int]:
    """Exact matches of the key at each depth d (the key d / (depths - 1) of the way into the
    filler), out of `seeds` prompts per depth."""
    hits = [0] * depths
    for seed in range(seeds):
        for d in range(depths):
            ids, key = passkey_prompt(tokenizer, length, d / max(depths - 1, 1), seed)
            out = list(decode(program, ids.tolist(), 8, eos_token_ids=()).new_tokens[0])
            answer = "".join(ch for ch in tokenizer.decode(out).strip().split(" ")[0] if ch.isdigit())
            hits[d] += answer == key
    return hits


def run(model, tokenizer, protocol: Protocol, log=print, save=lambda report: None) -> dict:
    """Every phase of the protocol (an empty `lengths` / `passkey_lengths` / `speculation_prompts`
    skips one); `save` gets the report so far after every measurement."""
    rows, passkey, speculation, onnx = [], [], [], []
    report = {"protocol": asdict(protocol), "rows": rows, "passkey": passkey, "speculation": speculation, "onnx": onnx}
    configs = [(FULL, 1.0)] + [(name, fraction) for name in protocol.policies for fraction in protocol.budgets]
    for length in protocol.lengths:
        ids = library_sequences(tokenizer, length, 1)[0]
        reference = None
        for name, fraction in configs:
            budget = length if name == FULL else int(fraction * length)
            program = _program(model, name, budget, protocol.chunk, length + protocol.new_tokens + protocol.chunk)
            started = time.perf_counter()
            ppl, tokens = perplexity_and_continuation(program, ids, protocol.chunk, protocol.new_tokens)
            reference = tokens if name == FULL else reference
            row = {"length": length, "policy": name, "budget": fraction, "slots": budget, "perplexity": ppl,
                   "cache_bytes": program.cache_bytes(), "seconds": time.perf_counter() - started,
                   "tokens": tokens, **agreement(tokens, reference)}  # fmt: skip
            rows.append(row)
            log(f"{length:5d} {name:12s} {fraction:4.2f}  ppl {ppl:8.3f}  agree {row['equal_positions']:.2f} "
                f"(first diff {row['first_difference']:3d})  cache {row['cache_bytes'] / 2**20:7.1f} MiB")  # fmt: skip
            save(report)
            del program
    for length in protocol.passkey_lengths:
        for name, fraction in [(FULL, 1.0)] + [(n, f) for n in protocol.policies for f in protocol.passkey_budgets]:
            program = _program(model, name, int(fraction * length), protocol.chunk, length + 256)
            hits = passkey_hits(program, tokenizer, length, protocol.passkey_seeds, protocol.passkey_depths)
            accuracy = sum(hits) / (protocol.passkey_seeds * protocol.passkey_depths)
            passkey.append({"length": length, "policy": name, "budget": fraction, "accuracy": accuracy,
                            "hits_by_depth": hits})  # fmt: skip
            log(f"passkey {length:5d} {name:12s} {fraction:4.2f}  {accuracy:.2f}  by depth {hits}")
            save(report)
            del program
    if protocol.speculation_prompts:
        speculation += _speculation(model, tokenizer, protocol, log)
        save(report)
    if protocol.onnx_policies:
        _onnx(model, tokenizer, protocol, rows, onnx, log, lambda: save(report))
    return report


@torch.no_grad()
def _onnx(model, tokenizer, protocol: Protocol, rows: list[dict], out: list[dict], log, save) -> None:
    """The full cache and each ONNX policy exported and run on ORT (CPU EP) over the perplexity text of
    `onnx_length` tokens: perplexity, continuation, cache bytes; the PyTorch row of the same policy
    and budget (measured now if the perplexity phase did not) gives the tokens to compare."""
    from ..backends.onnx.export import export
    from ..backends.onnx.program import OrtProgram

    length, chunk = protocol.onnx_length, protocol.chunk
    ids = library_sequences(tokenizer, length, 1)[0]
    for name in (FULL, *protocol.onnx_policies):
        fraction = 1.0 if name == FULL else protocol.onnx_budget
        budget = length if name == FULL else int(fraction * length)
        mine = next((r for r in rows if (r["length"], r["policy"], r["budget"]) == (length, name, fraction)), None)
        if mine is None:
            program = _program(model, name, budget, chunk, length + protocol.new_tokens + chunk)
            ppl, tokens = perplexity_and_continuation(program, ids, chunk, protocol.new_tokens)
            mine = {"perplexity": ppl, "tokens": tokens, "cache_bytes": program.cache_bytes()}
            del program
        with tempfile.TemporaryDirectory() as directory:
            started = time.perf_counter()
            export(model, _pipeline(name, budget, chunk), os.path.join(directory, "export"), progress=False)
            export_seconds = time.perf_counter() - started
            cache = None if name != FULL and _evicts(name) else length + protocol.new_tokens + chunk  # an evicting export's is its budget
            program = OrtProgram(os.path.join(directory, "export"), cache_size=cache, budget=1)
            started = time.perf_counter()
            ppl, tokens = perplexity_and_continuation(program, ids, chunk, protocol.new_tokens)
            row = {"length": length, "policy": name, "budget": fraction, "slots": budget, "perplexity": ppl,
                   "cache_bytes": program.cache_bytes(), "seconds": time.perf_counter() - started,
                   "export_seconds": export_seconds, "pytorch_perplexity": mine["perplexity"],
                   "pytorch_cache_bytes": mine["cache_bytes"], **agreement(tokens, mine["tokens"])}  # fmt: skip
            del program
        out.append(row)
        log(f"onnx {length:5d} {name:12s} {fraction:4.2f}  ppl {ppl:8.3f} (PyTorch {mine['perplexity']:.3f})  "
            f"tokens equal to PyTorch's {row['equal_positions']:.2f}  cache {row['cache_bytes'] / 2**20:7.1f} MiB")  # fmt: skip
        save()


@torch.no_grad()
def _speculation(model, tokenizer, protocol: Protocol, log) -> list[dict]:
    """Speculative decoding with a policy = the policy one token a step, and its tokens/s at the
    speculation length beside full-cache speculative decoding (prompts: library sequences)."""
    length, new = protocol.speculation_length, protocol.new_tokens
    prompts = library_sequences(tokenizer, length, protocol.speculation_prompts + 1)[1:]  # not the perplexity text
    results = []
    full = _program(model, FULL, length, protocol.chunk, length + new + protocol.chunk, speculative=True)
    full_stats = [decode(full, p[None], new, eos_token_ids=()).stats for p in prompts]
    del full
    for name in protocol.speculation_policies:
        budget = int(protocol.speculation_budget * length)
        cache = budget if _evicts(name) else length + new + protocol.chunk
        spec = _program(model, name, budget, protocol.chunk, cache, speculative=True)
        plain = _program(model, name, budget, protocol.chunk, cache)
        equal, stats, plain_stats = 0, [], []
        for p in prompts:
            fast = decode(spec, p[None], new, eos_token_ids=())
            slow = decode(plain, p[None], new, eos_token_ids=())
            equal += torch.equal(fast.sequences, slow.sequences)
            stats.append(fast.stats)
            plain_stats.append(slow.stats)
        result = {"policy": name, "budget": protocol.speculation_budget, "length": length, "prompts": len(prompts),
                  "equal_to_one_token_steps": equal, "speculative": _rates(stats), "one_token_steps": _rates(plain_stats),
                  "full_cache_speculative": _rates(full_stats)}  # fmt: skip
        results.append(result)
        log(f"speculation {name} @ {length}: {equal}/{len(prompts)} equal to one token a step; decode tok/s "
            f"{result['speculative']['decode_tokens_per_second']:.1f} (tau {result['speculative']['tau']:.2f}), "
            f"one token a step {result['one_token_steps']['decode_tokens_per_second']:.1f}, full cache speculative "
            f"{result['full_cache_speculative']['decode_tokens_per_second']:.1f}")  # fmt: skip
    return results


def _rates(stats: list) -> dict:
    """Means over prompts: tokens/s with and without the prefill, prefill seconds, tau."""
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {"tokens_per_second": mean([s.tokens_per_second for s in stats]),
            "decode_tokens_per_second": mean([s.decode_tokens_per_second for s in stats]),
            "prefill_seconds": mean([s.prefill_seconds for s in stats]), "tau": mean([s.tau for s in stats])}  # fmt: skip


def tables(report: dict) -> str:
    """Markdown tables of a report: perplexity (increase over the full cache), greedy agreement,
    cache bytes against the full cache's, passkey accuracy."""
    rows, lines = report.get("rows", []), []
    if rows:
        lengths = sorted({r["length"] for r in rows})
        configs = [(r["policy"], r["budget"]) for r in rows if r["length"] == lengths[0]]
        by = {(r["length"], r["policy"], r["budget"]): r for r in rows}
        full = {n: by[(n, FULL, 1.0)] for n in lengths}
        head = " | ".join(f"{n} tokens" for n in lengths)
        lines += [f"| policy | budget | {head} |", "| --- | --- |" + " --- |" * len(lengths)]
        for name, budget in configs:
            cells = []
            for n in lengths:
                r = by[(n, name, budget)]
                increase = 100 * (r["perplexity"] / full[n]["perplexity"] - 1)
                memory = 100 * r["cache_bytes"] / full[n]["cache_bytes"]
                cells.append(f"{r['perplexity']:.3f} ({increase:+.1f} %); agree {r['equal_positions']:.2f} / "
                             f"{r['first_difference']}; {memory:.1f} % bytes")  # fmt: skip
            lines.append(f"| {name} | {budget:.2f} | " + " | ".join(cells) + " |")
    if report.get("passkey"):
        keys = sorted({(p["policy"], p["budget"]) for p in report["passkey"]}, key=lambda k: (k[0] != FULL, k))
        plens = sorted({p["length"] for p in report["passkey"]})
        acc = {(p["length"], p["policy"], p["budget"]): p["accuracy"] for p in report["passkey"]}
        lines += [""] if lines else []
        lines += ["| passkey: policy | budget | " + " | ".join(f"{n} tokens" for n in plens) + " |",
                  "| --- | --- |" + " --- |" * len(plens)]  # fmt: skip
        for name, budget in keys:
            cells = (acc.get((n, name, budget)) for n in plens)  # None: that cell was not run
            lines.append(f"| {name} | {budget:.2f} | " + " | ".join("-" if a is None else f"{a:.2f}" for a in cells) + " |")
    if report.get("onnx"):
        lines += ["", "| ONNX Runtime: policy | budget | tokens | perplexity (PyTorch) | tokens equal to PyTorch's | "
                  "cache MiB (% of ORT full) |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        ort_full = next((r for r in report["onnx"] if r["policy"] == FULL), None)
        for r in report["onnx"]:
            share = f" ({100 * r['cache_bytes'] / ort_full['cache_bytes']:.1f} %)" if ort_full else ""
            lines.append(f"| {r['policy']} | {r['budget']:.2f} | {r['length']} | {r['perplexity']:.3f} "
                         f"({r['pytorch_perplexity']:.3f}) | {r['equal_positions']:.2f} | "
                         f"{r['cache_bytes'] / 2**20:.1f}{share} |")  # fmt: skip
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Against the budget, one panel per length: the perplexity increase over the full cache, then
    passkey accuracy (the full cache's as a dashed line; policies dodged sideways, since many share
    a value)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("perplexity", n) for n in sorted({r["length"] for r in report.get("rows", [])})]
    panels += [("passkey", n) for n in sorted({p["length"] for p in report.get("passkey", [])})]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (measure, length) in zip(axes[0], panels):
        if measure == "perplexity":
            cells = [r for r in report["rows"] if r["length"] == length]
            full = next(r["perplexity"] for r in cells if r["policy"] == FULL)
            points = [(r["policy"], r["budget"], 100 * (r["perplexity"] / full - 1)) for r in cells]
            ax.set_yscale("symlog", linthresh=10)
            ax.set_title(f"{length} tokens (full cache ppl {full:.2f})")
            ax.set_ylabel("perplexity increase (%)")
        else:
            points = [(p["policy"], p["budget"], p["accuracy"]) for p in report["passkey"] if p["length"] == length]
            for full in (v for name, _, v in points if name == FULL):
                ax.axhline(full, color="black", linestyle="--", label="full cache")
            ax.set_ylim(-0.05, 1.05)
            ax.set_title(f"passkey, {length} tokens")
            ax.set_ylabel("accuracy (exact match)")
        names = sorted({name for name, _, _ in points} - {FULL})
        for i, name in enumerate(names):
            mine = sorted((budget, v) for n, budget, v in points if n == name)
            dodge = (i - (len(names) - 1) / 2) * 0.005 if measure == "passkey" else 0.0  # equal accuracies stay visible
            ax.plot([b + dodge for b, _ in mine], [v for _, v in mine], marker="os^vDPX"[i % 7], label=name)
        ax.set_xlabel("budget (fraction of the length)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"KV eviction on {report['model']}, {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
