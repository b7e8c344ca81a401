"""What a generation request is (prompts, checks) and what it returns (tokens, per-row stats)."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...common.errors import CacheCapacityError, InvalidParameterError


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
    """One prompt's result (specpass.generate with one row)."""

    sequences: torch.Tensor  # [1, P + new_tokens]
    stats: GenerationStats


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

    def alone(self) -> Generation:
        """A batch of one as a `Generation` (its sequences hold no padding)."""
        if len(self.stats) != 1:
            raise InvalidParameterError(f"a batch of {len(self.stats)} rows is not one generation")
        return Generation(self.sequences, self.stats[0])


def check_max_new_tokens(max_new_tokens: object) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise InvalidParameterError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")


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


def check_request(prompts: Sequence[Sequence[int]], max_new_tokens: int, program=None) -> None:
    """What can be wrong with a request: checked before anything is built, and again against the program
    (backends.runtime.program.DecodeProgram) once there is one: its rows, vocabulary and cache (an
    evicting cache takes a prompt of any length, in pieces)."""
    if not prompts:
        raise InvalidParameterError("the batch is empty: give at least one prompt")
    check_max_new_tokens(max_new_tokens)
    if program is not None:
        check_batch_size(program, len(prompts))
    for b, prompt in enumerate(prompts):
        row = "the prompt" if len(prompts) == 1 else f"row {b}'s prompt"
        if len(prompt) == 0:
            raise InvalidParameterError(f"{row} is empty: give at least one token")
        if program is None:
            continue
        bad = [t for t in prompt if not 0 <= t < program.vocab_size]
        if bad:
            raise InvalidParameterError(f"{row}: token id {bad[0]} is outside the model's vocabulary "
                                        f"[0, {program.vocab_size})")  # fmt: skip
        if len(prompt) > program.cache_size and program.hooks.max_step is None:
            raise CacheCapacityError(f"{row} has {len(prompt)} tokens but the KV cache holds {program.cache_size}; "
                                     "compile with a larger options['cache_size']")  # fmt: skip


def check_batch_size(program, rows: int) -> None:
    """Raise InvalidParameterError when a batch of `rows` sequences cannot run on `program`."""
    if rows > program.rows:
        raise InvalidParameterError(
            f"batch size {rows}: this {type(program).__name__} holds {program.rows} sequence(s); build it with "
            f"rows >= {rows} (specpass.compile_program(model, options, rows=...), load_onnx(directory, rows=...))"
        )


def padded_sequences(prompts: Sequence[Sequence[int]], new_tokens: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """[B, P + N]: prompts left-padded to the longest, new tokens, padding after (BatchGeneration)."""
    width = max(len(p) for p in prompts)
    inputs = torch.full((len(prompts), width), pad, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        inputs[b, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
    return with_new_tokens(inputs, new_tokens, pad)


def with_new_tokens(inputs: torch.Tensor, new_tokens: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """[B, W + N]: inputs [B, W] as they are, then each row's new tokens, then `pad` up to the longest row's N."""
    new = max(len(t) for t in new_tokens)
    out = torch.full((inputs.shape[0], inputs.shape[1] + new), pad, dtype=torch.long, device=inputs.device)
    out[:, : inputs.shape[1]] = inputs
    for b, tokens in enumerate(new_tokens):
        out[b, inputs.shape[1] : inputs.shape[1] + len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
    return out
