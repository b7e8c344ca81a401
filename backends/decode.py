"""The decode loop: draft a tree -> verify it in one forward -> accept the longest greedy path -> commit KV."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

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
        raise InvalidParameterError(f"speculative decoding runs batch size 1, got batch {input_ids.shape[0]}")
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
    device = program.device
    eos = set(eos_token_ids)
    started = time.perf_counter()
    tokens: list[int] = input_ids[0].tolist()
    n_prompt = len(tokens)

    top_k = min(program.drafter.target_topk, program.vocab_size)  # the target's top candidates the drafters read
    cursor = CacheCursor()  # layouts and tokens go to the program on the host (ir.layout)
    topks, hiddens = [], []
    for logits, hidden in feed(program, input_ids[0].cpu(), cursor):  # [n, V], [n, H] a piece
        topks.append(logits.topk(top_k, dim=-1).indices.cpu())
        hiddens.append(hidden)
    forwards = 1  # the prefill, in however many pieces (tau counts decode steps and the prefill's token)
    topk, hidden = torch.cat(topks), torch.cat(hiddens)  # [P, k], [P, H]
    choices = topk[:, 0].clone()  # [P]: only the last row is a choice the loop makes
    if not choice.plain_greedy:
        choices[-1] = choice(logits[-1:], tokens)[0]
    prefill = TargetForward(topk, hidden, choices)
    tokens.append(int(choices[-1]))
    prefill_seconds = time.perf_counter() - started
    sizes = []
    steps: list[int] = []
    sampling = choice.sampling
    drafting = Drafting(program.drafter.sessions(tokens[:n_prompt], prefill, program.drafter_memory, program.draft,
                                                 sampling.seed))  # fmt: skip
    by_rule = program.drafter.draws and sampling.do_sample and sampling.acceptance == "auto"
    rng = np.random.default_rng([sampling.seed, 0x6D63]) if by_rule else None  # the rule's uniforms and residual draws
    finish = _finished(tokens, n_prompt, max_new_tokens, eos, stop is not None and stop(tokens))

    overhead = 0.0  # running estimate of a step's seconds outside the target forward
    while finish is None:
        step_started = time.perf_counter()
        room = program.room(cursor.cached)
        if room < 1:
            finish = "cache_full"
            break
        remaining = max_new_tokens - (len(tokens) - n_prompt)
        tree = drafting.draft(tokens, max_nodes=min(program.max_nodes, room), max_depth=remaining - 1)
        if not program.verifies_trees:
            tree = _as_chain(tree)
        size = curve.best_size(expected_tokens(tree), overhead) if curve is not None else program.budget
        size = program.agreed_size(size)
        tree = tree.prefix(size)
        layout = cursor.layout(tree.ancestor_mask())
        exit_states = drafting.precomputed(tree) if program.resumes_from_exit else None  # [T, H] or None
        if exit_states is not None:  # the early-exit draft ran these nodes' lower layers in their slots
            logits, hidden = program.forward_from_exit(exit_states, layout)  # [T, V], [T, H]
        else:
            logits, hidden = program.forward(torch.tensor(tree.tokens), layout)  # [T, V], [T, H]
        topk = logits.topk(top_k, dim=-1).indices.cpu()  # [T, k]
        if by_rule and len(tree) > 1:  # drawn drafts: the multi-candidate rule
            processed = choice.processed(logits, tokens, tree.parents, tree.tokens)  # [T, V]
            path, last = accept_drawn(tree, node_laws(processed), rng)
            choices = topk[:, 0].clone()  # [T]: off the path, the drafters read the greedy token
            choices[path[:-1]] = torch.tensor([tree.tokens[i] for i in path[1:]], dtype=torch.long)
            choices[path[-1]] = last
        else:
            choices = topk[:, 0] if choice.plain_greedy else choice(logits, tokens, tree.parents, tree.tokens)  # [T]
            path = accept_greedy(tree, choices.tolist())
        verified = TargetForward(topk, hidden, choices)
        cursor.commit(program, layout, path)
        new = [tree.tokens[i] for i in path[1:]] + [int(choices[path[-1]])]
        drafting.observe(tree, verified, path, tokens)
        forwards += 1
        sizes.append(len(tree))
        emitted, stopped = _emit(tokens, new, n_prompt, max_new_tokens, eos, stop)
        steps.append(emitted)
        finish = _finished(tokens, n_prompt, max_new_tokens, eos, stopped)
        if curve is not None:
            outside = time.perf_counter() - step_started - curve.latency(len(tree))
            overhead = 0.9 * overhead + 0.1 * max(outside, 0.0)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    stats = GenerationStats(
        new_tokens=len(tokens) - n_prompt,
        target_forwards=forwards,
        seconds=seconds,
        finish_reason=finish,
        steps=tuple(steps),
        mean_tree_size=sum(sizes) / len(sizes) if sizes else 1.0,
        prefill_seconds=prefill_seconds,
    )
    return Generation(torch.tensor([tokens], dtype=torch.long, device=input_ids.device), stats)


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
