"""The decode loop, for one sequence or a batch: draft each row's tree -> verify every row in one forward
-> accept each row's longest path -> commit it in the row's own cache row.

Layout: per-row offsets. Each sequence owns one row of the program's cache ([L, B, KV, S, D]) and lays
out its tokens there exactly as it would alone (`ir.layout.SlotLayout`: committed prefix in slots
[0, committed_b), its tree after it). A step's rows are padded to a common T (`ir.layout.RowsLayout`):
a padding node sees only itself and is written past the row's committed prefix, where nothing reads
it. Why not left padding: a row's accepted path varies in length, so a shared write position would
leave a hole in every row but the longest each step and attention would read them all; with a row's
own offset nothing is wasted and the row's cache is exactly the cache it would have alone. One
sequence is a batch of one: there is no other loop.

Per step: every row drafts its own tree (its own drafter sessions: prompt lookup over its own text;
Token Recycling's successor table is the program's memory, shared by the rows as it is shared by
successive generations); one T for all rows maximises the batch's expected tokens per second on the
cost curve measured for forwards of all rows (so trees shrink as B grows); one forward verifies all
rows; each row accepts its own path (`sequence.SequenceState`) and commits it in its own cache row
only. A row that finishes (EOS, length, stop, cache) leaves the batch: the rows after it move up one
cache row, so the next forwards run only the live rows.

Invariant. A row's tokens equal that sequence decoded alone with the same choice (greedy, or sampling
keyed by its seed and position): its logits depend only on its own cache row and tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from specpass.backends.runtime.generation import BatchGeneration, check_rows, padded_sequences
from specpass.backends.runtime.guard import one_generation_at_a_time
from specpass.backends.runtime.program import DecodeProgram
from specpass.backends.runtime.sampling import TargetChoice
from specpass.backends.runtime.sequence import CacheCursor, SequenceState
from specpass.drafters import DraftTree, expected_tokens
from specpass.errors import InvalidParameterError
from specpass.ir.layout import RowsLayout

PREFILL_TOKENS = 512  # tokens per prefill forward, over all rows (bounds the prompt's logits in memory)
MIN_DRAFTED = 4  # the fewest nodes a row drafts under the cost budget (the tree grows from there by doubling)


@one_generation_at_a_time
def generate(
    program: DecodeProgram,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    choices: Sequence[TargetChoice] | None = None,
    stop: Callable[[Sequence[int]], bool] | None = None,
    pad_token_id: int | None = None,
    streamer=None,
) -> BatchGeneration:
    """Speculative decoding of `prompts` (token lists, one per row; at most program.rows) in one batch,
    with the program's drafter (and its memory).

    choices: each row's target choice after each token (default plain greedy; see backends.runtime.sampling):
    a row's output equals non-speculative decoding with the same choice; when it samples and the
    drafter draws its drafts from draft laws (Drafter.draws), they are accepted by the multi-candidate
    rule (backends.runtime.multi_candidate), whose output follows the same distribution. stop: called with a
    row's sequence after every emitted token, in order; True ends that row after that token (finish
    reason "stop"). pad_token_id fills `sequences` (default: the model's, else its first EOS id, else
    0). streamer (one row): Hugging Face's streamer interface, `put` the prompt [1, P], then each
    step's accepted tokens [n] as they are accepted, `end()` once the row ends. Plain greedy takes its
    choice from the top-k the drafters get anyway (no second pass over the logits).
    """
    program.check_rows(len(prompts))
    check_rows(prompts, max_new_tokens, program.cache_size, program.vocab_size, program.evicts)
    if streamer is not None and len(prompts) != 1:
        raise InvalidParameterError(f"a streamer follows one sequence (Hugging Face's streamers take batch 1); "
                                    f"got {len(prompts)} prompts")  # fmt: skip
    choices = choices if choices is not None else [TargetChoice()] * len(prompts)
    curve = program.cost_curve if program.budget == "cost" else None  # measured once, before the clock starts
    started = time.perf_counter()
    eos = set(eos_token_ids)
    seqs = [SequenceState(p, max_new_tokens, eos, c, stop) for p, c in zip(prompts, choices, strict=True)]
    stream = _Stream(streamer, seqs[0]) if streamer is not None else None
    try:
        prefill_seconds = _decode(program, seqs, stream, curve, started)
    finally:
        if stream is not None:
            streamer.end()
    if pad_token_id is None:
        pad_token_id = program.pad_token_id
    if pad_token_id is None:
        pad_token_id = next(iter(eos_token_ids), 0)
    return BatchGeneration(
        padded_sequences([s.tokens[: s.n_prompt] for s in seqs], [s.tokens[s.n_prompt :] for s in seqs], pad_token_id),
        tuple(tuple(s.tokens[s.n_prompt :]) for s in seqs),
        tuple(s.stats(started, prefill_seconds) for s in seqs),
        max(s.finished_at for s in seqs) - started,
    )


def _decode(program: DecodeProgram, seqs: list[SequenceState], stream: _Stream | None, curve, started: float) -> float:
    """Prefill every row, then decode until every row finished; returns the prefill's seconds."""
    top_k = min(program.drafter.target_topk, program.vocab_size)  # the target's top candidates the drafters read
    _prefill(program, seqs, top_k)
    prefill_seconds = time.perf_counter() - started
    if stream is not None:
        stream.flush()
    live = _retire(program, seqs)  # live[i] owns cache row i
    overhead = 0.0  # running estimate of a step's seconds outside the target forward
    # nodes a row drafts: a fixed budget's, or (cost budget) max_nodes over all rows or twice the size
    # verified last step, whichever is more, so the drafting work of a batch follows what its forward
    # verifies (best-first: a smaller tree is the larger one's prefix; one row drafts max_nodes)
    drafted = program.max_nodes if curve is not None else min(program.max_nodes, program.budget)
    last_step = started
    while live:
        step_started = last_step = time.perf_counter()
        room = min(program.room(s.cursor.cached) for s in live)  # the most tokens any row's step may take
        if room < 1:  # a row at the end of its cache ends; the others go on
            for s in live:
                if program.room(s.cursor.cached) < 1:
                    s.end("cache_full")
            live = _retire(program, live)
            continue
        trees = []
        for b, s in enumerate(live):
            with program.drafting_row(b):  # a self-draft writes its chain's lower layers in this row
                trees.append(s.draft(program, min(room, drafted)))
        size = _shared_size(curve, trees, overhead) if curve is not None else program.budget
        size = min(program.agreed_size(size), room)  # every process of a sharded program verifies rank 0's size
        trees = [t.prefix(size) for t in trees]
        layout = RowsLayout(tuple(s.cursor.layout(t.ancestor_mask()) for s, t in zip(live, trees)))
        states = _exit_states(live, trees, layout.size) if program.resumes_from_exit else None
        if states is not None:  # every row's tree is its self-draft chain: resume above the exit
            logits, hidden = program.forward_from_exit(states, layout)  # [B, T, V], [B, T, H]
        else:
            tokens = layout.pad_tokens([torch.tensor(t.tokens) for t in trees])  # [B, T]
            logits, hidden = program.forward(tokens, layout)  # [B, T, V], [B, T, H]
        topk = logits.topk(top_k, dim=-1).indices.cpu()  # [B, T, k]: the step's one host sync
        accepted = [s.accept(t, logits[b, : len(t)], hidden[b, : len(t)], topk[b, : len(t)], states is not None)
                    for b, (s, t) in enumerate(zip(live, trees))]  # fmt: skip
        committed = program.commit(layout, [path for path, _ in accepted])
        for s, t, (path, verified), cached in zip(live, trees, accepted, committed):
            s.cursor.advance(cached, len(path))
            s.advance(t, verified, path)
        if stream is not None:
            stream.flush()
        live = _retire(program, live)
        if curve is not None:
            outside = time.perf_counter() - step_started - curve.latency(layout.size)
            overhead = 0.9 * overhead + 0.1 * max(outside, 0.0)
            drafted = min(program.max_nodes, max(program.max_nodes // len(layout.rows), 2 * layout.size, MIN_DRAFTED))
    if program.device.type == "cuda":  # the last commit ran asynchronously: count it in the time
        torch.cuda.synchronize(program.device)
        ended = time.perf_counter()
        for s in seqs:
            if s.finished_at >= last_step:
                s.finished_at = ended
    return prefill_seconds


class _Stream:
    """Pushes a row's tokens to a streamer as they are emitted (the prompt first, as HF's generate does)."""

    def __init__(self, streamer, seq: SequenceState):
        self.streamer, self.seq = streamer, seq
        streamer.put(torch.tensor([seq.tokens], dtype=torch.long))  # [1, P]
        self.sent = len(seq.tokens)

    def flush(self) -> None:
        new = self.seq.tokens[self.sent :]
        if new:
            self.streamer.put(torch.tensor(new, dtype=torch.long))  # [n]
            self.sent += len(new)


def feed(program: DecodeProgram, prompts: Sequence[Sequence[int]], cursors: Sequence[CacheCursor], piece: int
         ) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[int]]]:  # fmt: skip
    """Run row b's tokens prompts[b] as a chain in cache row b and commit them, in forwards of at most
    `piece` tokens a row and the room an evicting cache leaves (the same cache as one token at a time:
    rewrites.kv_eviction); a row whose tokens are done runs one padding token meanwhile (at its next
    slot, not committed). Yields each forward's logits [B, T, V], hidden [B, T, H] and each row's
    number of real tokens in it (0: padding only). A first forward drops per-sequence cache state."""
    if all(c.seen == 0 for c in cursors):
        program.new_sequence()
    fed = [0] * len(prompts)
    while any(f < len(p) for f, p in zip(fed, prompts)):
        # every row's step is padded to the longest: no row may take more than the tightest room
        cap = max(1, min(piece, *(program.room(c.cached) for c in cursors)))
        counts = [min(cap, len(p) - f) for p, f in zip(prompts, fed)]
        layout = RowsLayout(tuple(c.layout(torch.ones(max(n, 1), max(n, 1), dtype=torch.bool).tril())
                                  for c, n in zip(cursors, counts)))  # fmt: skip
        tokens = layout.pad_tokens([torch.tensor(list(p[f : f + max(n, 0)]) or [0], dtype=torch.long)
                                    for p, f, n in zip(prompts, fed, counts)])  # fmt: skip  [B, T]
        logits, hidden = program.forward(tokens, layout)  # [B, T, V], [B, T, H]
        committed = program.commit(layout, [range(max(n, 0)) for n in counts])  # a chain: nothing moves
        for b, (c, n) in enumerate(zip(cursors, counts)):
            if n > 0:
                c.advance(committed[b], n)
                fed[b] += n
        yield logits, hidden, [max(n, 0) for n in counts]


def _prefill(program: DecodeProgram, seqs: list[SequenceState], top_k: int) -> None:
    """Every row's prompt through `feed` (at most PREFILL_TOKENS tokens a forward over all rows); then
    each row chooses its first token and opens its drafter sessions."""
    topks: list[list[torch.Tensor]] = [[] for _ in seqs]
    hiddens: list[list[torch.Tensor]] = [[] for _ in seqs]
    last: list[torch.Tensor | None] = [None] * len(seqs)
    piece = max(1, PREFILL_TOKENS // len(seqs))
    prompts = [s.tokens[: s.n_prompt] for s in seqs]
    for logits, hidden, counts in feed(program, prompts, [s.cursor for s in seqs], piece):
        topk = logits.topk(top_k, dim=-1).indices.cpu()  # [B, T, k]
        for b, n in enumerate(counts):
            if n > 0:
                topks[b].append(topk[b, :n])
                hiddens[b].append(hidden[b, :n])
                last[b] = logits[b, n - 1 : n]  # [1, V]
    for b, s in enumerate(seqs):
        s.start(program, torch.cat(topks[b]), torch.cat(hiddens[b]), last[b])


def _shared_size(curve, trees: list[DraftTree], overhead: float) -> int:
    """Tokens per row n maximising the rows' summed expected tokens over latency(n) + overhead
    (CostCurve.best_size): a row whose tree is smaller than n is padded (its expected tokens stop growing)."""
    expected = [expected_tokens(t) for t in trees]
    largest = max(len(e) for e in expected)
    summed = [sum(e[min(n, len(e)) - 1] for e in expected) for n in range(1, largest + 1)]
    return curve.best_size(summed, overhead)


def _exit_states(live: list[SequenceState], trees: list[DraftTree], size: int) -> torch.Tensor | None:
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

