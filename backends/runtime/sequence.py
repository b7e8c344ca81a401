"""One sequence in the decode loop: its tokens, cache cursor, drafter sessions, target choice and counts.

The loop (backends.runtime.decode) drives one `SequenceState` per row: drafting, acceptance and emission are a
row's own; only the forward and the commit are the batch's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specpass.backends.runtime.generation import GenerationStats
from specpass.backends.runtime.multi_candidate import accept_drawn, node_laws
from specpass.backends.runtime.program import DecodeProgram
from specpass.backends.runtime.sampling import TargetChoice
from specpass.drafters import Drafting, DraftTree, TargetForward, accept_greedy
from specpass.ir.layout import SlotLayout


@dataclass
class CacheCursor:
    """Where a row's next step goes: `cached` slots hold committed tokens, `seen` tokens were committed
    (evicted ones included, so `seen` is the next token's rotary position)."""

    cached: int = 0
    seen: int = 0

    def layout(self, ancestors: torch.Tensor) -> SlotLayout:
        return SlotLayout(self.cached, ancestors, evicted=self.seen - self.cached)

    def advance(self, cached: int, accepted: int) -> None:
        """After a commit of `accepted` tokens that left `cached` slots committed (fewer after an eviction)."""
        self.cached = cached
        self.seen += accepted


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
    """One row of the decode loop (module docstring)."""

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
        sessions = [] if program.one_node else program.drafter.sessions(  # one-node trees: nothing to draft
            self.tokens[: self.n_prompt], prefill, program.drafter_memory, program.draft, sampling.seed)
        self.drafting = Drafting(sessions)
        self.by_rule = program.drafter.draws and sampling.do_sample and sampling.acceptance == "auto"
        # the multi-candidate rule's uniforms and residual draws
        self.rng = np.random.default_rng([sampling.seed, 0x6D63]) if self.by_rule else None
        stopped = self.stop is not None and self.stop(self.tokens)
        self._set_finish(_finished(self.tokens, self.n_prompt, self.max_new_tokens, self.eos, stopped))

    def draft(self, program: DecodeProgram, room: int) -> DraftTree:
        """This step's tree, at most `room` nodes (what the program verifies: a chain if no trees)."""
        remaining = self.max_new_tokens - (len(self.tokens) - self.n_prompt)
        if not self.drafting.sessions:  # one-node trees
            return DraftTree((self.tokens[-1],), (-1,), (1.0,), (None,))
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
