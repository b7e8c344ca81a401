"""The decode loop, for one sequence or a batch: draft each row's tree -> verify every row in one forward
-> accept each row's longest path -> commit it in the row's own cache row.

Each sequence owns one row of the program's cache and lays out its tokens there exactly as alone
(`ir.layout.SlotLayout`); a step's rows are padded to one T, a padding node
seeing only itself, written where nothing reads it (per-row offsets, not left padding: docs/design.md,
"Layout: per-row offsets"). Each step the rows draft their trees; one T for all rows maximises the
batch's expected tokens per second on the cost curve for forwards of all rows; one forward verifies; each
row accepts and commits its own path. A finished row (EOS, length, stop, cache) leaves the batch and the
rows after it move up. One sequence is a batch of one. Invariant: a row's tokens equal that sequence
decoded alone with the same choice (greedy, or sampling keyed by its seed and position).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from .acceptance import accept_rows
from .gate import DraftingGate
from .generation import BatchGeneration, check_request, padded_sequences
from .guard import one_generation_at_a_time
from .program import DecodeProgram
from .sampling import TargetChoice, choose_rows
from .sequence import CacheCursor, SequenceState
from ...drafters import RootsOnly, RowsDrafting, TargetForward
from ...drafters.tree import DraftTree, first_branches
from ...common.errors import InvalidParameterError
from ...ir.layout import SlotLayout

PREFILL_LOGITS_BYTES = 256 * 2**20  # a prefill forward's float32 logits [B, T, V] stay within this
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
    check_request(prompts, max_new_tokens, program)
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
    drafting = _prefill(program, seqs, top_k)
    prefill_seconds = time.perf_counter() - started
    if stream is not None:
        stream.flush()
    live = _retire(program, seqs, drafting)  # live[i] owns cache row i
    overhead = 0.0  # running estimate of a step's seconds outside the target forward
    # nodes a row drafts: a fixed budget's, or (cost budget) max_nodes over all rows or twice the size
    # verified last step, whichever is more, so the drafting work of a batch follows what its forward
    # verifies (best-first: a smaller tree is the larger one's prefix; one row drafts max_nodes)
    drafted = program.max_nodes if curve is not None else min(program.max_nodes, program.budget)
    gate = DraftingGate() if curve is not None and drafting.skips else None  # the cost budget may also not draft
    last_step = started
    while live:
        step_started = last_step = time.perf_counter()
        room = min(_room(program, s.cursor.cached) for s in live)  # the most tokens any row's step may take
        if room < 1:  # a row at the end of its cache ends; the others go on
            for s in live:
                if _room(program, s.cursor.cached) < 1:
                    s.end("cache_full")
            live = _retire(program, live, drafting)
            continue
        histories = [s.tokens for s in live]
        drafts = gate is None or program.hooks.agreed_choice(gate.drafts())  # every process: rank 0's choice
        if drafts:
            trees = drafting.draft(histories, min(room, drafted), [s.remaining - 1 for s in live])
            drafting_seconds = time.perf_counter() - step_started
            if not program.verifies_trees:
                trees = first_branches(trees)
            size = _shared_size(curve, trees, overhead) if curve is not None else program.budget
            trees = trees.prefix(min(program.hooks.agreed_size(size), room))  # every process: rank 0's size
        else:
            trees = DraftTree.roots([h[-1] for h in histories])
        layout = SlotLayout(tuple(s.cursor.cached for s in live), torch.from_numpy(trees.ancestors),
                            tuple(trees.sizes.tolist()), tuple(s.cursor.seen - s.cursor.cached for s in live))  # fmt: skip
        tokens = torch.from_numpy(trees.tokens)  # [B, T]
        logits, hidden, resumed = program.verify(tokens, layout, drafting.precomputed(trees))  # [B, T, V], [B, T, H]
        paths, verified = _accept(live, trees, logits, hidden, top_k, resumed)
        committed = program.commit(layout, paths)
        drafting.observe(trees, verified, paths, histories)  # histories end at each tree's root until advance
        tree_tokens, choices, sizes = trees.tokens.tolist(), verified.choices.tolist(), trees.sizes.tolist()
        for s, path, cached, row_tokens, row_choices, size in zip(live, paths, committed, tree_tokens, choices, sizes):
            s.cursor.advance(cached, len(path))
            s.advance([row_tokens[i] for i in path[1:]] + [row_choices[path[-1]]], size)
        if stream is not None:
            stream.flush()
        live = _retire(program, live, drafting)
        seconds = time.perf_counter() - step_started
        if gate is not None:  # a plain step would not have drafted, and would have verified one node a row
            plain = seconds - drafting_seconds - curve.latency(layout.size) + curve.latency(1) if drafts else None
            gate.record(drafts, sum(map(len, paths)), seconds, plain, len(paths))
        if curve is not None and drafts:
            outside = seconds - curve.latency(layout.size)
            overhead = 0.9 * overhead + 0.1 * max(outside, 0.0)
            drafted = min(program.max_nodes, max(program.max_nodes // len(paths), 2 * layout.size, MIN_DRAFTED))
    if program.device.type == "cuda":  # the last commit ran asynchronously: count it in the time
        torch.cuda.synchronize(program.device)
        ended = time.perf_counter()
        for s in seqs:
            if s.finished_at >= last_step:
                s.finished_at = ended
    return prefill_seconds


def _accept(live: list[SequenceState], trees: DraftTree, logits: torch.Tensor, hidden: torch.Tensor, top_k: int,
            resumed: bool) -> tuple[list[list[int]], TargetForward]:  # fmt: skip
    """Each row's accepted path of `trees` verified as logits [B, T, V], hidden [B, T, H], and what the
    drafters learn. Every row chooses (sampling.choose_rows) and greedy and sample-and-match rows are
    accepted together (acceptance.accept_rows); a row whose drafts were drawn from draft laws walks
    its tree by the multi-candidate rule (it reads the target's law only at the nodes it visits)."""
    topk = logits.topk(top_k, dim=-1).indices.cpu()  # [B, T, k]: the step's host sync
    histories = [s.tokens for s in live]
    choices = choose_rows([s.choice for s in live], histories, trees.tokens, trees.parents, trees.sizes, logits,
                          topk[..., 0])  # fmt: skip  # [B, T]
    paths = accept_rows(trees.tokens, trees.parents, trees.sizes, choices.numpy())
    for b, s in enumerate(live):
        if s.by_rule and trees.sizes[b] > 1:  # drawn drafts: the multi-candidate rule
            n = int(trees.sizes[b])
            paths[b], choices[b, :n] = s.accept_drawn(trees.row(b), logits[b, :n], topk[b, :n, 0])
    return paths, TargetForward(topk, hidden, choices, resumed)


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
    slot, not committed); a hook may run a forward itself (RuntimeHook.prefill_forward: rewrites.lazy_llm).
    Yields each forward's logits [B, T, V], hidden [B, T, H] and each row's number of real tokens in it
    (0: padding only). A first forward drops per-sequence cache state."""
    if all(c.seen == 0 for c in cursors):
        program.hooks.new_sequence()
    fed = [0] * len(prompts)
    while any(f < len(p) for f, p in zip(fed, prompts)):
        # every row's step is padded to the longest: no row may take more than the tightest room
        cap = max(1, min(piece, *(_room(program, c.cached) for c in cursors)))
        counts = [min(cap, len(p) - f) for p, f in zip(prompts, fed)]
        layout = SlotLayout.of([c.layout(torch.ones(max(n, 1), max(n, 1), dtype=torch.bool).tril())
                                for c, n in zip(cursors, counts)])  # fmt: skip
        tokens = layout.pad_tokens([torch.tensor(list(p[f : f + max(n, 0)]) or [0], dtype=torch.long)
                                    for p, f, n in zip(prompts, fed, counts)])  # fmt: skip  [B, T]
        prefilled = program.hooks.prefill_forward(tokens, layout)  # a hook's own prompt forward, or None
        logits, hidden = prefilled or program.forward(tokens, layout)  # [B, T, V], [B, T, H]
        committed = program.commit(layout, [range(max(n, 0)) for n in counts])  # a chain: nothing moves
        for b, (c, n) in enumerate(zip(cursors, counts)):
            if n > 0:
                c.advance(committed[b], n)
                fed[b] += n
        yield logits, hidden, [max(n, 0) for n in counts]


def _prefill(program: DecodeProgram, seqs: list[SequenceState], top_k: int) -> RowsDrafting:
    """Every row's prompt through `feed` (forwards whose logits fit in PREFILL_LOGITS_BYTES); then
    each row chooses its first token, and the rows' drafting starts."""
    topks: list[list[torch.Tensor]] = [[] for _ in seqs]
    hiddens: list[list[torch.Tensor]] = [[] for _ in seqs]
    last: list[torch.Tensor | None] = [None] * len(seqs)
    piece = max(1, PREFILL_LOGITS_BYTES // (4 * program.vocab_size * len(seqs)))  # tokens a row per forward
    prompts = [s.tokens[: s.n_prompt] for s in seqs]
    for logits, hidden, counts in feed(program, prompts, [s.cursor for s in seqs], piece):
        topk = logits.topk(top_k, dim=-1).indices.cpu()  # [B, T, k]
        for b, n in enumerate(counts):
            if n > 0:
                topks[b].append(topk[b, :n])
                hiddens[b].append(hidden[b, :n])
                last[b] = logits[b, n - 1 : n]  # [1, V]
    drafter = program.drafter
    prefills = [s.start(torch.cat(topks[b]), torch.cat(hiddens[b]), last[b], drafter.draws) for b, s in enumerate(seqs)]
    if program.max_nodes == 1 or program.budget == 1:  # one-node trees: nothing to draft
        return RootsOnly()
    seeds = [s.choice.sampling.seed for s in seqs]
    return drafter.rows(prompts, prefills, program.drafter_memory, program.draft, seeds, program.hooks.drafting_row)


def _room(program: DecodeProgram, cached: int) -> int:
    """The most tokens a row's next forward may take with `cached` slots committed: its cache's room, or
    less where a hook bounds a step (an evicting cache: what one eviction frees)."""
    room = program.cache_size - cached
    return room if program.hooks.max_step is None else min(room, program.hooks.max_step)


def _shared_size(curve, trees: DraftTree, overhead: float) -> int:
    """Tokens per row n maximising the rows' summed expected tokens over latency(n) + overhead
    (CostCurve.best_size): a row whose tree is smaller than n is padded (its expected tokens stop growing)."""
    return curve.best_size(trees.expected_tokens().sum(axis=0).tolist(), overhead)


def _retire(program: DecodeProgram, live: list[SequenceState], drafting: RowsDrafting) -> list[SequenceState]:
    """The live rows that have not finished; their caches and drafting move up over the finished rows'."""
    keep = [i for i, s in enumerate(live) if s.finish is None]
    if len(keep) < len(live) and keep:
        program.keep_rows(keep, max(live[i].cursor.cached for i in keep))
        drafting.keep(keep)
    return [live[i] for i in keep]

