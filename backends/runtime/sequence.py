"""One sequence in the decode loop: its tokens, cache cursor, target choice, emission and counts.

The loop (backends.runtime.decode) drives one `SequenceState` per row; drafting (drafters.RowsDrafting),
the forward, acceptance (backends.runtime.acceptance) and the commit are the batch's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .generation import GenerationStats
from .multi_candidate import accept_drawn, node_laws
from .sampling import TargetChoice
from ...drafters import DraftTree, TargetForward
from ...ir.layout import SlotLayout


@dataclass
class CacheCursor:
    """Where a row's next step goes: `cached` slots hold committed tokens, `seen` tokens were committed
    (evicted ones included, so `seen` is the next token's rotary position)."""

    cached: int = 0
    seen: int = 0

    def layout(self, ancestors: torch.Tensor) -> SlotLayout:
        return SlotLayout.tree(self.cached, ancestors, evicted=self.seen - self.cached)

    def advance(self, cached: int, accepted: int) -> None:
        """After a commit of `accepted` tokens that left `cached` slots committed (fewer after an eviction)."""
        self.cached = cached
        self.seen += accepted


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

    def start(self, topk: torch.Tensor, hidden: torch.Tensor, last_logits: torch.Tensor, draws: bool) -> TargetForward:
        """After the prompt's forward(s): topk [P, k] (host), hidden [P, H], last_logits [1, V] after the
        prompt's last token. Chooses the first token; returns what the drafters learn from the prompt.
        draws: the drafter draws its drafts from draft laws (they are then accepted by the
        multi-candidate rule when this row samples)."""
        choices = topk[:, 0].clone()  # [P]: only the last row is a choice the loop makes
        if not self.choice.plain_greedy:
            choices[-1] = self.choice(last_logits, self.tokens)[0]
        self.tokens.append(int(choices[-1]))
        sampling = self.choice.sampling
        self.by_rule = draws and sampling.do_sample and sampling.acceptance == "auto"
        # the multi-candidate rule's uniforms and residual draws
        self.rng = np.random.default_rng([sampling.seed, 0x6D63]) if self.by_rule else None
        stopped = self.stop is not None and self.stop(self.tokens)
        self._set_finish(_finished(self.tokens, self.n_prompt, self.max_new_tokens, self.eos, stopped))
        return TargetForward(topk, hidden, choices)

    @property
    def remaining(self) -> int:
        """Tokens this row may still emit."""
        return self.max_new_tokens - (len(self.tokens) - self.n_prompt)

    def accept_drawn(self, tree: DraftTree, logits: torch.Tensor, greedy: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Drawn drafts by the multi-candidate rule: the accepted path and the choices [T] the drafters
        read (off the path the greedy tokens `greedy` [T])."""
        processed = self.choice.processed(logits, self.tokens, tree.parents.tolist(), tree.tokens.tolist())  # [T, V]
        path, last = accept_drawn(tree, node_laws(processed), self.rng)
        choices = greedy.clone()  # [T]
        choices[path[:-1]] = torch.from_numpy(tree.tokens[path[1:]])
        choices[path[-1]] = last
        return path, choices

    def advance(self, new: list[int], size: int) -> None:
        """After a step that verified `size` nodes and committed its path: emit `new` (the path's drafted
        tokens, then the target's choice after its last node)."""
        self.forwards += 1
        self.sizes.append(size)
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
