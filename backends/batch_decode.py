"""Batched speculative decoding: several sequences in one verify forward per step.

Layout: per-row offsets. Each sequence owns one row of the program's cache ([L, B, KV, S, D]) and lays
out its tokens there exactly as it would alone (`ir.layout.SlotLayout`: committed prefix in slots
[0, committed_b), its tree after it). A step's rows are padded to a common T (`ir.layout.RowsLayout`):
a padding node sees only itself and is written past the row's committed prefix, where nothing reads
it. Why not left padding: a row's accepted path varies in length, so a shared write position would
leave a hole in every row but the longest each step and attention would read them all; with a row's
own offset nothing is wasted and the row's cache is exactly the cache it would have alone.

Per step: every row drafts its own tree (its own drafter sessions: prompt lookup over its own text;
Token Recycling's successor table is the program's memory, shared by the rows as it is shared by
successive generations); one T for all rows maximises the batch's expected tokens per second on the
cost curve measured for forwards of all rows (so trees shrink as B grows); one forward verifies all
rows; each row accepts its own path (`decode.SequenceState`, the code batch 1 runs) and commits it in
its own cache row only. A row that finishes (EOS, length, stop, cache) leaves the batch: the rows
after it move up one cache row, so the next forwards run only the live rows.

Invariant. A row's tokens equal that sequence decoded alone with the same choice (greedy, or sampling
keyed by its seed and position): its logits depend only on its own cache row and tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specpass.backends.decode import GenerationStats, SequenceState, check_max_new_tokens
from specpass.backends.guard import one_generation_at_a_time
from specpass.backends.program import DecodeProgram
from specpass.backends.sampling import TargetChoice
from specpass.drafters import expected_tokens
from specpass.errors import CacheCapacityError, InvalidParameterError
from specpass.ir.layout import RowsLayout, SlotLayout

PREFILL_TOKENS = 512  # tokens per prefill forward, over all rows (bounds the prompt's logits in memory)


@dataclass(frozen=True)
class BatchGeneration:
    """Each row's new tokens and stats, and the batch's wall time.

    sequences [B, P + N] (Hugging Face's layout for a padded batch): row b is its prompt, left-padded
    to the longest prompt P, then its new tokens, then pad_token_id up to the longest row's N.
    """

    sequences: torch.Tensor  # [B, P + N] int64
    new_tokens: tuple[tuple[int, ...], ...]  # per row, EOS included when it ended the row
    stats: tuple[GenerationStats, ...]  # per row: its tokens, tau, finish reason; seconds until it finished
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """New tokens of every row per second of the whole batch."""
        return sum(len(t) for t in self.new_tokens) / self.seconds if self.seconds > 0 else float("inf")


def prompts_from(input_ids: object, attention_mask: object = None) -> list[list[int]]:
    """Each row's prompt tokens from input_ids [B, P] int64 and attention_mask [B, P] (1: token, 0:
    padding, on either side; None: no padding)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise InvalidParameterError("input_ids must be an int64 tensor of shape [batch, prompt_length]")
    if input_ids.shape[0] == 0:
        raise InvalidParameterError("the batch is empty: give at least one prompt")
    rows = input_ids.cpu().tolist()
    if attention_mask is None:
        return rows
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise InvalidParameterError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}")
    mask = attention_mask.cpu()
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise InvalidParameterError("attention_mask must hold only 0 (padding) and 1 (token)")
    prompts = []
    for b, (row, keep) in enumerate(zip(rows, mask.bool().tolist())):
        where = [i for i, k in enumerate(keep) if k]
        if where and where != list(range(where[0], where[-1] + 1)):
            raise InvalidParameterError(f"row {b}'s attention_mask has padding between tokens; pad on the left or right")
        prompts.append(row[where[0] : where[-1] + 1] if where else [])
    return prompts


def check_rows(prompts: Sequence[Sequence[int]], max_new_tokens: int, cache_size: int | None = None,
               vocab_size: int | None = None) -> None:  # fmt: skip
    """What can be wrong with a batch request: checked before anything is built (the sizes, when given,
    once the program is)."""
    if not prompts:
        raise InvalidParameterError("the batch is empty: give at least one prompt")
    check_max_new_tokens(max_new_tokens)
    for b, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise InvalidParameterError(f"row {b}'s prompt is empty: give at least one token")
        bad = [t for t in prompt if vocab_size is not None and not 0 <= t < vocab_size]
        if bad:
            raise InvalidParameterError(f"row {b}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})")
        if cache_size is not None and len(prompt) > cache_size:
            raise CacheCapacityError(f"row {b}'s prompt has {len(prompt)} tokens but the KV cache holds {cache_size}; "
                                     "compile with a larger options['cache_size']")  # fmt: skip


@one_generation_at_a_time
def generate_rows(
    program: DecodeProgram,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    choices: Sequence[TargetChoice] | None = None,
    stop: Callable[[Sequence[int]], bool] | None = None,
    pad_token_id: int | None = None,
) -> BatchGeneration:
    """Speculative decoding of `prompts` (token lists, one per row; at most program.rows) in one batch.

    choices: each row's target choice (default greedy); stop: called per row like decode.generate's;
    pad_token_id fills `sequences` (default: the model's, else its first EOS id, else 0).
    """
    program.check_rows(len(prompts))
    check_rows(prompts, max_new_tokens, program.cache_size, program.vocab_size)
    choices = choices if choices is not None else [TargetChoice()] * len(prompts)
    curve = program.cost_curve if program.budget == "cost" else None
    started = time.perf_counter()
    eos = set(eos_token_ids)
    seqs = [SequenceState(p, max_new_tokens, eos, c, stop) for p, c in zip(prompts, choices, strict=True)]
    top_k = min(program.drafter.target_topk, program.vocab_size)

    _prefill(program, seqs, top_k)
    prefill_seconds = time.perf_counter() - started
    live = _retire(program, seqs)  # live[i] owns cache row i

    overhead = 0.0  # running estimate of a step's seconds outside the target forward
    while live:
        step_started = time.perf_counter()
        room = min(program.room(s.cursor.cached) for s in live)
        if room < 1:  # a row at the end of its cache ends; the others go on
            for s in live:
                if program.room(s.cursor.cached) < 1:
                    s.end("cache_full")
            live = _retire(program, live)
            continue
        trees = []
        for b, s in enumerate(live):
            with program.drafting_row(b):  # a self-draft writes its chain's lower layers in this row
                trees.append(s.draft(program, room))
        size = _shared_size(curve, trees, overhead) if curve is not None else program.budget
        trees = [t.prefix(min(size, room)) for t in trees]
        layout = RowsLayout(tuple(s.cursor.layout(t.ancestor_mask()) for s, t in zip(live, trees)))
        states = _exit_states(live, trees, layout.size) if program.resumes_from_exit else None
        if states is not None:  # every row's tree is its self-draft chain: resume above the exit
            logits, hidden = program.forward_rows_from_exit(states, layout)  # [B, T, V], [B, T, H]
        else:
            tokens = layout.pad_tokens([torch.tensor(t.tokens) for t in trees])  # [B, T]
            logits, hidden = program.forward_rows(tokens, layout)  # [B, T, V], [B, T, H]
        topk = logits.topk(top_k, dim=-1).indices.cpu()  # [B, T, k]
        accepted = [s.accept(t, logits[b, : len(t)], hidden[b, : len(t)], topk[b, : len(t)], states is not None)
                    for b, (s, t) in enumerate(zip(live, trees))]  # fmt: skip
        committed = program.commit_rows(layout, [path for path, _ in accepted])
        for s, t, (path, verified), cached in zip(live, trees, accepted, committed):
            s.cursor.cached = cached
            s.cursor.seen += len(path)
            s.advance(t, verified, path)
        live = _retire(program, live)
        if curve is not None:
            outside = time.perf_counter() - step_started - curve.latency(layout.size)
            overhead = 0.9 * overhead + 0.1 * max(outside, 0.0)

    if pad_token_id is None:
        pad_token_id = program.pad_token_id
    if pad_token_id is None:
        pad_token_id = next(iter(eos_token_ids), 0)
    return BatchGeneration(
        _sequences(seqs, pad_token_id),
        tuple(tuple(s.tokens[s.n_prompt :]) for s in seqs),
        tuple(s.stats(started, prefill_seconds) for s in seqs),
        time.perf_counter() - started,
    )


def _sequences(seqs: list[SequenceState], pad: int) -> torch.Tensor:
    """[B, P + N]: prompts left-padded to the longest, new tokens, padding after (BatchGeneration)."""
    width = max(s.n_prompt for s in seqs)
    prompts = torch.full((len(seqs), width), pad, dtype=torch.long)
    for b, s in enumerate(seqs):
        prompts[b, width - s.n_prompt :] = torch.tensor(s.tokens[: s.n_prompt])
    return with_new_tokens(prompts, [s.tokens[s.n_prompt :] for s in seqs], pad)


def with_new_tokens(inputs: torch.Tensor, new_tokens: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """[B, W + N]: inputs [B, W] as they are, then each row's new tokens, then `pad` up to the longest row's N."""
    new = max(len(t) for t in new_tokens)
    out = torch.full((inputs.shape[0], inputs.shape[1] + new), pad, dtype=torch.long, device=inputs.device)
    out[:, : inputs.shape[1]] = inputs
    for b, tokens in enumerate(new_tokens):
        out[b, inputs.shape[1] : inputs.shape[1] + len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
    return out


def _prefill(program: DecodeProgram, seqs: list[SequenceState], top_k: int) -> None:
    """Run every row's prompt as a chain in its own cache row, in forwards of at most PREFILL_TOKENS
    tokens over all rows; a row whose prompt is done runs one padding token meanwhile (at its next
    slot, not committed). Then each row chooses its first token and opens its drafter sessions."""
    piece = max(1, PREFILL_TOKENS // len(seqs))
    topks: list[list[torch.Tensor]] = [[] for _ in seqs]
    hiddens: list[list[torch.Tensor]] = [[] for _ in seqs]
    last: list[torch.Tensor | None] = [None] * len(seqs)
    program.new_sequence()
    done = 0
    while done < max(s.n_prompt for s in seqs):
        counts = [min(piece, s.n_prompt - done) for s in seqs]  # <= 0: the row's prompt is done
        rows = tuple(SlotLayout.chain(s.cursor.cached, max(n, 1)) for s, n in zip(seqs, counts))
        layout = RowsLayout(rows)
        pieces = [torch.tensor(s.tokens[done : done + n]) if n > 0 else torch.zeros(1, dtype=torch.long)
                  for s, n in zip(seqs, counts)]  # fmt: skip
        logits, hidden = program.forward_rows(layout.pad_tokens(pieces), layout)  # [B, T, V], [B, T, H]
        topk = logits.topk(top_k, dim=-1).indices.cpu()  # [B, T, k]
        committed = program.commit_rows(layout, [range(max(n, 0)) for n in counts])  # in place: nothing moves
        for b, (s, n) in enumerate(zip(seqs, counts)):
            if n > 0:
                topks[b].append(topk[b, :n])
                hiddens[b].append(hidden[b, :n])
                last[b] = logits[b, n - 1 : n]  # [1, V]
                s.cursor.cached = committed[b]
                s.cursor.seen += n
        done += piece
    for b, s in enumerate(seqs):
        s.start(program, torch.cat(topks[b]), torch.cat(hiddens[b]), last[b])


def _shared_size(curve, trees, overhead: float) -> int:
    """Tokens per row n maximising the rows' summed expected tokens over latency(n) + overhead
    (CostCurve.best_size): a row whose tree is smaller than n is padded (its expected tokens stop growing)."""
    expected = [expected_tokens(t) for t in trees]
    largest = max(len(e) for e in expected)
    summed = [sum(e[min(n, len(e)) - 1] for e in expected) for n in range(1, largest + 1)]
    return curve.best_size(summed, overhead)


def _exit_states(live: list[SequenceState], trees: list, size: int) -> torch.Tensor | None:
    """[B, T, H]: each row's precomputed exit states (its tree is its self-draft chain), padding nodes'
    zeros; None when some row has none (its tree is not the chain: then every row runs the whole
    forward, which writes the same K/V in the self-drafted slots again)."""
    rows = [s.drafting.precomputed(t) for s, t in zip(live, trees)]
    if any(r is None for r in rows):
        return None
    states = rows[0].new_zeros(len(rows), size, rows[0].shape[-1])
    for b, r in enumerate(rows):
        states[b, : r.shape[0]] = r
    return states


def _retire(program: DecodeProgram, live: list[SequenceState]) -> list[SequenceState]:
    """The live rows that have not finished; their caches move up over the finished rows' cache rows."""
    keep = [i for i, s in enumerate(live) if s.finish is None]
    if len(keep) < len(live) and keep:
        program.keep_rows(keep, max(live[i].cursor.cached for i in keep))
    return [live[i] for i in keep]
