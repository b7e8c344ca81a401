"""The target's choice after each verified token: greedy or sampled, after logits processors.

Speculation is lossless when the target's choice after a node depends only on that node's prefix. When
sampling, the choice at absolute position n is argmax_v(processed_logits[v] + G_n[v]), G_n Gumbel noise
keyed by (seed, n): an exact sample of softmax(processed_logits) (Gumbel-max), independent between
positions. The nodes of a tree at one depth predict one position and share its noise, so the accepted
tokens are those non-speculative sampling with the same seed picks. Acceptance is then sample-and-match;
drafts drawn from a known law are accepted by the multi-candidate rule (backends.runtime.multi_candidate)
unless `Sampling.acceptance="match"`. Logits processors (temperature, top-k, top-p, min-p, HF's own) are
applied to each node with its own prefix: nodes grouped by depth, each group processed as one batch.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

import torch

from ...common.errors import InvalidParameterError

_MASK64 = (1 << 64) - 1
ACCEPTANCE = ("auto", "match")


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of a generation (do_sample=False: greedy; the others must stay at their defaults).

    temperature > 0 divides the logits; top_k > 0 keeps the k likeliest tokens; top_p in (0, 1] keeps
    the smallest set whose probability reaches top_p; min_p in [0, 1) drops tokens below min_p times
    the likeliest one's probability (Hugging Face's warpers, in its order). seed keys the noise.
    acceptance: "auto" accepts drawn drafts by the multi-candidate rule and every other draft by
    sample-and-match; "match" uses sample-and-match everywhere, so the tokens equal non-speculative
    sampling with the same seed whatever the drafter (module docstring).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    acceptance: str = "auto"

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise InvalidParameterError(f"do_sample must be a bool, got {self.do_sample!r}")
        _check_number("temperature", self.temperature, lambda t: 0.0 < t < math.inf, "a finite float > 0")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidParameterError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        _check_number("top_p", self.top_p, lambda p: 0.0 < p <= 1.0, "a float in (0, 1]")
        _check_number("min_p", self.min_p, lambda p: 0.0 <= p < 1.0, "a float in [0, 1)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 1 << 63:
            raise InvalidParameterError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if self.acceptance not in ACCEPTANCE:
            raise InvalidParameterError(f"acceptance must be one of {ACCEPTANCE}, got {self.acceptance!r}")
        if not self.do_sample:
            fields = type(self).__dataclass_fields__
            changed = [f for f in ("temperature", "top_k", "top_p", "min_p", "acceptance")
                       if getattr(self, f) != fields[f].default]  # fmt: skip
            if changed:
                raise InvalidParameterError(
                    f"{', '.join(changed)}: only takes effect when sampling; pass do_sample=True, or drop it for greedy"
                )

    def processors(self) -> list[Callable]:
        """Hugging Face's warpers for these settings, in the order HF's generate applies them."""
        from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

        warpers: list[Callable] = []
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopP(self.top_p))
        if self.min_p > 0.0:
            warpers.append(MinPLogitsWarper(self.min_p))
        return warpers


class TopP:
    """Nucleus filtering as Hugging Face's TopPLogitsWarper defines it (keep the likeliest tokens until
    the mass before the next one reaches top_p; at least one token), computed on each row's top-K
    instead of a sort of the whole vocabulary (measured: docs/experiments.md, "Keyed-noise sampling").
    A row whose top-K holds less than top_p of the mass falls back to the full sort."""

    def __init__(self, top_p: float, candidates: int = 1024):
        self.top_p = top_p
        self.candidates = candidates

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.candidates, scores.shape[-1])
        probs = scores.softmax(dim=-1)  # [N, V]
        top, index = probs.topk(k, dim=-1)  # [N, K] descending
        before = top.cumsum(dim=-1) - top  # [N, K]: mass of the likelier tokens
        keep = before < self.top_p
        keep[:, 0] = True
        out = torch.full_like(scores, -math.inf).scatter(-1, index, scores.gather(-1, index).masked_fill(~keep, -math.inf))
        short = top.sum(dim=-1) < self.top_p  # [N]: the nucleus may reach past the top K
        if bool(short.any()):
            from transformers.generation.logits_process import TopPLogitsWarper

            out[short] = TopPLogitsWarper(self.top_p)(input_ids[short], scores[short])
        return out


def _check_number(name: str, value: object, ok: Callable[[float], bool], wanted: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(float(value)):
        raise InvalidParameterError(f"{name} must be {wanted}, got {value!r}")


GREEDY = Sampling()


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """[V] float32 Gumbel noise for absolute position `position`, keyed by (seed, position) alone."""
    key = _splitmix64(_splitmix64(seed) ^ position) & ((1 << 63) - 1)
    generator = torch.Generator().manual_seed(key)
    uniform = torch.rand(vocab_size, generator=generator, dtype=torch.float64)  # [V] in [0, 1)
    tiny = torch.finfo(torch.float64).tiny
    return (-torch.log(-torch.log(uniform.clamp_min(tiny)))).float()


class KeyedNoise:
    """position_noise of one seed, the most recent `keep` positions kept: a decode step asks for the
    positions its tree reaches, and the next step for most of them again (the cost of one:
    docs/experiments.md, "Keyed-noise sampling")."""

    def __init__(self, seed: int, keep: int = 64):
        self.seed = seed
        self.keep = keep
        self._cache: collections.OrderedDict[tuple[int, int], torch.Tensor] = collections.OrderedDict()

    def __call__(self, position: int, vocab_size: int) -> torch.Tensor:
        """[V] float32 on the CPU: position_noise(seed, position, vocab_size)."""
        key = (position, vocab_size)
        noise = self._cache.get(key)
        if noise is None:
            noise = self._cache[key] = position_noise(self.seed, position, vocab_size)
            if len(self._cache) > self.keep:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return noise


class TargetChoice:
    """Picks the target's next token after every verified token; see the module docstring.

    processors: callables `(input_ids [N, L], scores [N, V]) -> scores` applied in order (Hugging
    Face's LogitsProcessor interface); sampling: greedy or keyed-noise sampling after them.
    """

    def __init__(self, processors: Sequence[Callable] = (), sampling: Sampling = GREEDY):
        self.processors_source = processors  # rows sharing it (and their settings) are processed as one batch
        self.processors = list(processors) + (sampling.processors() if sampling.do_sample else [])
        self.sampling = sampling
        self.noise = KeyedNoise(sampling.seed)
        self.reads_ids = any(not isinstance(p, _warper_types()) for p in self.processors)

    @property
    def plain_greedy(self) -> bool:
        return not self.processors and not self.sampling.do_sample

    def __call__(self, logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int] = (-1,),
                 node_tokens: Sequence[int] | None = None) -> torch.Tensor:  # fmt: skip
        """logits [T, V] after the T nodes of a tree (parents, node_tokens; node 0 is tokens[-1]) or,
        by default, after the last token of `tokens` alone; returns the chosen tokens [T] int64 (CPU)."""
        if self.plain_greedy:
            return logits.argmax(dim=-1).cpu()
        node_tokens = node_tokens if node_tokens is not None else tokens[-1:]
        greedy = torch.zeros(1, len(parents), dtype=torch.long)  # [1, T]: every node is chosen below
        return choose_rows([self], [tokens], np.array([node_tokens], dtype=np.int64),
                           np.array([parents], dtype=np.int64), np.array([len(parents)]), logits[None], greedy)[0]

    def processed(self, logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int] = (-1,),
                  node_tokens: Sequence[int] | None = None) -> torch.Tensor:  # fmt: skip
        """The processed logits [T, V] (float32; -inf: excluded) that the choice samples from."""
        node_tokens = node_tokens if node_tokens is not None else tokens[-1:]
        depths = node_depths(np.array([parents], dtype=np.int64))[0].tolist()  # [T]
        by_depth: dict[int, list[int]] = {}
        for i, depth in enumerate(depths):
            by_depth.setdefault(depth, []).append(i)
        prefixes = node_prefixes(tokens, parents, node_tokens) if self.reads_ids else None
        scores = logits.float()  # [T, V]
        no_ids = torch.empty(len(parents), 0, dtype=torch.long, device=scores.device)
        for processor in self.processors:
            if isinstance(processor, _warper_types()):  # reads scores only: all nodes in one batch
                scores = processor(no_ids, scores)
                continue
            scores = scores.clone()
            for rows in by_depth.values():  # one batch per depth: equal prefix lengths
                ids = torch.tensor([prefixes[i] for i in rows], dtype=torch.long, device=scores.device)  # [n, L]
                scores[rows] = processor(ids, scores[rows])
        return scores


def choose_rows(
    choices: Sequence[TargetChoice], histories: Sequence[Sequence[int]], tokens: np.ndarray, parents: np.ndarray,
    sizes: np.ndarray, logits: torch.Tensor, greedy: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """[B, T] int64 (host): the target's choice after each node of every row's tree (tokens, parents
    [B, T] on the host as drafters.DraftTree holds them, sizes [B]; histories: each row's tokens up to
    its root; logits [B, T, V]; greedy [B, T]: plain greedy's choices). Rows sharing their settings
    whose processors read scores only are chosen together: one processed batch, each row's position
    noise, one argmax. A row whose processors read input_ids
    is chosen alone (its nodes' prefixes differ). Each row's choice equals its `TargetChoice` applied
    to that row alone (row-wise warpers; the noise is keyed by (seed, position))."""
    out = greedy.clone()
    groups: dict[tuple, list[int]] = {}
    for b, choice in enumerate(choices):
        if not choice.plain_greedy:
            shared = (id(choice.processors_source), replace(choice.sampling, seed=0))  # the seed only keys the noise
            key = (b,) if choice.reads_ids else shared
            groups.setdefault(key, []).append(b)
    if not groups:
        return out
    depths = node_depths(parents)  # [B, T]
    for rows in groups.values():
        first = choices[rows[0]]
        width = int(max(sizes[b] for b in rows))
        if first.reads_ids:  # one row: its nodes' prefixes go to the processors
            (b,) = rows
            scores = first.processed(logits[b, :width], histories[b], parents[b, :width].tolist(),
                                     tokens[b, :width].tolist())[None]  # fmt: skip  # [1, T, V]
        else:
            scores = logits[rows, :width].float().flatten(0, 1)  # [n * T, V]
            no_ids = torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
            for processor in first.processors:
                scores = processor(no_ids, scores)
            scores = scores.view(len(rows), width, -1)  # [n, T, V]
        if first.sampling.do_sample:
            vocab = scores.shape[-1]
            noise = torch.stack([_depth_noise(choices[b], len(histories[b]), depths[b, :width], vocab)
                                 for b in rows])  # fmt: skip  # [n, T, V]
            scores = scores + noise.to(scores.device)  # -inf stays -inf
        chosen = scores.argmax(dim=-1).cpu()  # [n, T]
        for i, b in enumerate(rows):
            n = int(sizes[b])
            out[b, :n] = chosen[i, :n]
    return out


def _depth_noise(choice: TargetChoice, root_position: int, depths: np.ndarray, vocab: int) -> torch.Tensor:
    """[T, V]: each node's position noise, one vector per depth (the nodes at a depth share a position)."""
    per_depth = torch.stack([choice.noise(root_position + d, vocab) for d in range(int(depths.max()) + 1)])  # [D, V]
    return per_depth[torch.from_numpy(depths)]


def node_depths(parents: np.ndarray) -> np.ndarray:
    """[B, T] int64: each node's depth below its row's root (parents before children; padding: 0)."""
    depths = np.zeros(parents.shape, dtype=np.int64)
    for i in range(1, parents.shape[1]):
        has = parents[:, i] >= 0
        depths[has, i] = depths[has, parents[has, i]] + 1
    return depths


@functools.cache
def _warper_types() -> tuple[type, ...]:
    """Processors that read only the scores, never input_ids (so all nodes go in one batch)."""
    from transformers.generation import logits_process

    names = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
             "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper",
             "InfNanRemoveLogitsProcessor", "LogitNormalization")  # fmt: skip
    return (TopP,) + tuple(getattr(logits_process, name) for name in names if hasattr(logits_process, name))


def node_prefixes(tokens: Sequence[int], parents: Sequence[int], node_tokens: Sequence[int]) -> list[list[int]]:
    """The prefix ending at each tree node: the committed tokens (ending with the root, node 0) and
    the drafted tokens on the path from the root to the node."""
    prefixes: list[list[int]] = [list(tokens)]
    for i in range(1, len(node_tokens)):
        prefixes.append(prefixes[parents[i]] + [node_tokens[i]])
    return prefixes
