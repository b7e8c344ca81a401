"""The decode loop: draft a tree -> verify it in one forward -> accept the longest greedy path -> commit KV."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specpass.backends.guard import one_generation_at_a_time
from specpass.backends.multi_candidate import accept_drawn, node_laws
from specpass.backends.program import DecodeProgram
from specpass.backends.sampling import TargetChoice
from specpass.drafters import Drafting, TargetForward, DraftTree, accept_greedy, expected_tokens
from specpass.errors import CacheCapacityError, InvalidParameterError
from specpass.ir.layout import SlotLayout


@dataclass(frozen=True)
class GenerationStats:
    new_tokens: int
    target_forwards: int  # prefill included
    seconds: float
    finish_reason: str  # "eos", "stop" (a stop criterion, e.g. a stop string), "length" or "cache_full"
    steps: tuple[int, ...] = ()  # tokens emitted by each decode step (the prefill's token excluded)
    mean_tree_size: float = 1.0
    prefill_seconds: float = 0.0  # of `seconds`: the prompt's forward(s), up to the first token

    @property
    def accepted_histogram(self) -> dict[int, int]:
        """How many decode steps emitted 1, 2, ... tokens."""
        return dict(sorted(collections.Counter(self.steps).items()))

    @property
    def tau(self) -> float:
        """Tokens per target forward."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first, per second after the prefill."""
        decode = self.seconds - self.prefill_seconds
        return (self.new_tokens - 1) / decode if decode > 0 else float("inf")

    def __str__(self) -> str:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(self.accepted_histogram.items()))
        return (
            f"{self.new_tokens} tokens in {self.target_forwards} target forwards (tau {self.tau:.2f}), "
            f"{self.tokens_per_second:.1f} tokens/s, mean tree {self.mean_tree_size:.1f} nodes, "
            f"finished by {self.finish_reason}; accepted per step {{{hist}}}"
        )


@dataclass(frozen=True)
class Generation:
    sequences: torch.Tensor  # [1, P + new_tokens]
    stats: GenerationStats


def check_max_new_tokens(max_new_tokens: object) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise InvalidParameterError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")


def check_prompt(input_ids: object) -> None:
    """The prompt's form: a non-empty int64 tensor [1, P] (batch 1)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise InvalidParameterError("input_ids must be an int64 tensor of shape [batch, prompt_length]")
    if input_ids.shape[0] != 1:
        raise InvalidParameterError(f"this loop runs one sequence, got a batch of {input_ids.shape[0]} "
                                    "(batches: backends.batch_decode, through specpass.generate)")
    if input_ids.shape[1] == 0:
        raise InvalidParameterError("the prompt is empty: give at least one token")


def check_request(input_ids: torch.Tensor, max_new_tokens: int, cache_size: int, vocab_size: int,
                  evicts: bool = False) -> None:  # fmt: skip
    """Everything about a request that can be wrong, checked before the first forward (an evicting
    cache takes a prompt of any length, in pieces)."""
    check_prompt(input_ids)
    check_max_new_tokens(max_new_tokens)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidParameterError(f"token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    if input_ids.shape[1] > cache_size and not evicts:
        raise CacheCapacityError(
            f"the prompt has {input_ids.shape[1]} tokens but the KV cache holds {cache_size}; "
            "compile with a larger options['cache_size']"
        )


@dataclass
class CacheCursor:
    """Where the next step goes: `cached` slots hold committed tokens, `seen` tokens were committed
    (evicted ones included, so `seen` is the next token's rotary position)."""

    cached: int = 0
    seen: int = 0

    def layout(self, ancestors: torch.Tensor) -> SlotLayout:
        return SlotLayout(self.cached, ancestors, evicted=self.seen - self.cached)

    def commit(self, program: DecodeProgram, layout: SlotLayout, path: Sequence[int]) -> None:
        self.cached = program.commit(layout, path)
        self.seen += len(path)


def feed(program: DecodeProgram, tokens: torch.Tensor, cursor: CacheCursor, piece: int | None = None
         ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Run tokens [P] (on the host) as a chain and commit them: in one forward, or in pieces that fit
    an evicting cache (the same cache as one token at a time: rewrites.kv_eviction), or of at most
    `piece` tokens. Yields each piece's logits [n, V] and hidden [n, H]."""
    if cursor.seen == 0:
        program.new_sequence()
    start = 0
    while start < tokens.shape[0]:
        n = min(tokens.shape[0] - start, piece or tokens.shape[0])
        if program.evicts:
            n = min(n, program.room(cursor.cached))
        layout = cursor.layout(torch.ones(n, n, dtype=torch.bool).tril())
        logits, hidden = program.forward(tokens[start : start + n], layout)  # [n, V], [n, H]
        cursor.commit(program, layout, range(n))
        yield logits, hidden
        start += n


def _as_chain(tree: DraftTree) -> DraftTree:
    """The branch through every node's first child: what a program without TreeAttention can verify."""
    keep, node = [0], 0
    while (nxt := next((i for i in range(node + 1, len(tree)) if tree.parents[i] == node), None)) is not None:
        keep.append(nxt)
        node = nxt
    return DraftTree(
        tuple(tree.tokens[i] for i in keep),
        tuple(range(-1, len(keep) - 1)),
        tuple(tree.scores[i] for i in keep),
        tuple(tree.origins[i] for i in keep),
        tuple(tree.drawn[i] for i in keep) if tree.drawn else (),  # each node's first child: its first draw
    )


class SequenceState:
    """One sequence in the decode loop: its tokens, cache cursor, drafter sessions, target choice and
    counts. `generate` drives one; the batched loop (backends.batch_decode) drives one per row, with
    the same drafting, acceptance and emission (this class), only the forward and commit batched."""

    def __init__(self, prompt: Sequence[int], max_new_tokens: int, eos: set[int], choice: TargetChoice,
                 stop: Callable[[Sequence[int]], bool] | None = None):  # fmt: skip
        self.tokens: list[int] = list(prompt)
        self.n_prompt = len(self.tokens)
        self.max_new_tokens = max_new_tokens
        self.eos = eos
        self.choice = choice
        self.stop = stop
        self.cursor = CacheCursor()  # layouts and tokens go to the program on the host (ir.layout)
        self.forwards = 1  # the prefill, in however many pieces (tau counts decode steps and the prefill's token)
        self.sizes: list[int] = []
        self.steps: list[int] = []
        self.finish: str | None = None
        self.finished_at = 0.0  # perf_counter() when the sequence finished

    def start(self, program: DecodeProgram, topk: torch.Tensor, hidden: torch.Tensor, last_logits: torch.Tensor) -> None:
        """After the prompt's forward(s): topk [P, k] (host), hidden [P, H], last_logits [1, V] after the
        prompt's last token. Chooses the first token and opens the drafter sessions."""
        choices = topk[:, 0].clone()  # [P]: only the last row is a choice the loop makes
        if not self.choice.plain_greedy:
            choices[-1] = self.choice(last_logits, self.tokens)[0]
        prefill = TargetForward(topk, hidden, choices)
        self.tokens.append(int(choices[-1]))
        sampling = self.choice.sampling
        self.drafting = Drafting(program.drafter.sessions(self.tokens[: self.n_prompt], prefill, program.drafter_memory,
                                                          program.draft, sampling.seed))  # fmt: skip
        self.by_rule = program.drafter.draws and sampling.do_sample and sampling.acceptance == "auto"
        # the multi-candidate rule's uniforms and residual draws
        self.rng = np.random.default_rng([sampling.seed, 0x6D63]) if self.by_rule else None
        stopped = self.stop is not None and self.stop(self.tokens)
        self._set_finish(_finished(self.tokens, self.n_prompt, self.max_new_tokens, self.eos, stopped))

    def draft(self, program: DecodeProgram, room: int) -> DraftTree:
        """This step's tree, at most `room` nodes (what the program verifies: a chain if no trees)."""
        remaining = self.max_new_tokens - (len(self.tokens) - self.n_prompt)
        tree = self.drafting.draft(self.tokens, max_nodes=min(program.max_nodes, room), max_depth=remaining - 1)
        return tree if program.verifies_trees else _as_chain(tree)

    def accept(self, tree: DraftTree, logits: torch.Tensor, hidden: torch.Tensor, topk: torch.Tensor,
               resumed: bool = False) -> tuple[list[int], TargetForward]:  # fmt: skip
        """The accepted path (node indices, root first) of `tree` verified as logits [T, V], hidden [T, H],
        topk [T, k] (host), and what the drafters learn from the step (resumed: the verify resumed
        above an early exit from the drafted states)."""
        if self.by_rule and len(tree) > 1:  # drawn drafts: the multi-candidate rule
            processed = self.choice.processed(logits, self.tokens, tree.parents, tree.tokens)  # [T, V]
            path, last = accept_drawn(tree, node_laws(processed), self.rng)
            choices = topk[:, 0].clone()  # [T]: off the path, the drafters read the greedy token
            choices[path[:-1]] = torch.tensor([tree.tokens[i] for i in path[1:]], dtype=torch.long)
            choices[path[-1]] = last
        else:
            plain = self.choice.plain_greedy
            choices = topk[:, 0] if plain else self.choice(logits, self.tokens, tree.parents, tree.tokens)  # [T]
            path = accept_greedy(tree, choices.tolist())
        return path, TargetForward(topk, hidden, choices, resumed)

    def advance(self, tree: DraftTree, verified: TargetForward, path: list[int]) -> None:
        """After the path's commit: emit its tokens and the target's next one, let the drafters learn."""
        new = [tree.tokens[i] for i in path[1:]] + [int(verified.choices[path[-1]])]
        self.drafting.observe(tree, verified, path, self.tokens)
        self.forwards += 1
        self.sizes.append(len(tree))
        emitted, stopped = _emit(self.tokens, new, self.n_prompt, self.max_new_tokens, self.eos, self.stop)
        self.steps.append(emitted)
        self._set_finish(_finished(self.tokens, self.n_prompt, self.max_new_tokens, self.eos, stopped))

    def _set_finish(self, finish: str | None) -> None:
        self.finish = finish
        if finish is not None:
            self.finished_at = time.perf_counter()

    def end(self, finish: str) -> None:
        """Finish for a reason outside the sequence (the cache is full)."""
        self._set_finish(finish)

    def stats(self, started: float, prefill_seconds: float) -> GenerationStats:
        return GenerationStats(
            new_tokens=len(self.tokens) - self.n_prompt,
            target_forwards=self.forwards,
            seconds=self.finished_at - started,
            finish_reason=self.finish,
            steps=tuple(self.steps),
            mean_tree_size=sum(self.sizes) / len(self.sizes) if self.sizes else 1.0,
            prefill_seconds=prefill_seconds,
        )


@one_generation_at_a_time
def generate(
    program: DecodeProgram,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    choice: TargetChoice | None = None,
    stop: Callable[[Sequence[int]], bool] | None = None,
) -> Generation:
    """Speculative decoding of `input_ids` [1, P] with the program's drafter (and its memory).

    choice: the target's choice after each token (default plain greedy; see backends.sampling): the
    output equals non-speculative decoding with the same choice; when it samples and the drafter draws
    its drafts from draft laws (Drafter.draws), they are accepted by the multi-candidate rule
    (backends.multi_candidate), whose output follows the same distribution. stop: called with the
    sequence after every emitted token, in order; True ends the generation after that token (finish
    reason "stop"). Plain greedy takes its choice from the top-k the drafters get anyway (no second
    pass over the logits).
    """
    check_request(input_ids, max_new_tokens, program.cache_size, program.vocab_size, program.evicts)
    choice = choice if choice is not None else TargetChoice()
    curve = program.cost_curve if program.budget == "cost" else None
    started = time.perf_counter()
    seq = SequenceState(input_ids[0].tolist(), max_new_tokens, set(eos_token_ids), choice, stop)

    top_k = min(program.drafter.target_topk, program.vocab_size)  # the target's top candidates the drafters read
    topks, hiddens = [], []
    for logits, hidden in feed(program, input_ids[0].cpu(), seq.cursor):  # [n, V], [n, H] a piece
        topks.append(logits.topk(top_k, dim=-1).indices.cpu())
        hiddens.append(hidden)
    seq.start(program, torch.cat(topks), torch.cat(hiddens), logits[-1:])  # [P, k], [P, H], [1, V]
    prefill_seconds = time.perf_counter() - started

    overhead = 0.0  # running estimate of a step's seconds outside the target forward
    while seq.finish is None:
        step_started = time.perf_counter()
        room = program.room(seq.cursor.cached)
        if room < 1:
            seq.end("cache_full")
            break
        tree = seq.draft(program, room)
        size = curve.best_size(expected_tokens(tree), overhead) if curve is not None else program.budget
        tree = tree.prefix(program.agreed_size(size))
        layout = seq.cursor.layout(tree.ancestor_mask())
        exit_states = seq.drafting.precomputed(tree) if program.resumes_from_exit else None  # [T, H] or None
        if exit_states is not None:  # the early-exit draft ran these nodes' lower layers in their slots
            logits, hidden = program.forward_from_exit(exit_states, layout)  # [T, V], [T, H]
        else:
            logits, hidden = program.forward(torch.tensor(tree.tokens), layout)  # [T, V], [T, H]
        path, verified = seq.accept(tree, logits, hidden, logits.topk(top_k, dim=-1).indices.cpu(),
                                    resumed=exit_states is not None)  # fmt: skip
        seq.cursor.commit(program, layout, path)
        seq.advance(tree, verified, path)
        if curve is not None:
            outside = time.perf_counter() - step_started - curve.latency(len(tree))
            overhead = 0.9 * overhead + 0.1 * max(outside, 0.0)

    if program.device.type == "cuda":
        torch.cuda.synchronize(program.device)
    seq.finished_at = time.perf_counter()
    stats = seq.stats(started, prefill_seconds)
    return Generation(torch.tensor([seq.tokens], dtype=torch.long, device=input_ids.device), stats)


def _emit(tokens: list[int], new: list[int], n_prompt: int, max_new_tokens: int, eos: set[int], stop) -> tuple[int, bool]:
    """Append accepted tokens, stopping after an EOS or a stop criterion and at the length limit;
    returns how many, and whether the stop criterion fired (it sees every appended token once)."""
    count = 0
    for token in new:
        if len(tokens) - n_prompt >= max_new_tokens:
            break
        tokens.append(token)
        count += 1
        stopped = stop is not None and stop(tokens)
        if token in eos or stopped:
            return count, stopped
    return count, False


def _finished(tokens: list[int], n_prompt: int, max_new_tokens: int, eos: set[int], stopped: bool) -> str | None:
    if tokens[-1] in eos:
        return "eos"
    if stopped:
        return "stop"
    if len(tokens) - n_prompt >= max_new_tokens:
        return "length"
    return None
