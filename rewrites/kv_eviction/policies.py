"""The eviction policies, each a KVEviction pass (base.py) saying which slots it protects, how an accepted
token's attention updates its scores and how it ranks slots when the cache is full. Defaults follow the
papers (H2O: half heavy hitters, half recent; SnapKV: pooling kernel 5); Keyformer's temperature is fixed.

| policy | keeps | ranks | paper |
| --- | --- | --- | --- |
| `SinksWindow` | the first `sinks` tokens and the most recent ones | by position only | StreamingLLM |
| `H2O` | a recent window, then the heavy hitters | accumulated attention, per KV head | H2O |
| `A2SF` | a recent window (none by default), then the best | attention with a forgetting factor, per KV head | A2SF |
| `TOVA` | the best | the last token's attention, averaged over the layer's heads | TOVA |
| `SnapKV` | the observation window, then the best | the window's attention, pooled, per KV head | SnapKV |
| `Keyformer` | a recent window, then the key tokens | accumulated Gumbel-softmax attention, per KV head | Keyformer |
| `TrimKV` | the best | learned log retention times age, per KV head | TRIM-KV |
| `EMS` | the observation window, then the best; the rest merged or dropped | accumulated + window attention, per KV head | EMS |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...common.errors import InvalidParameterError, SpecpassError
from ...ir import arch_of
from .base import KVEviction, check_int
from .scores import decayed_sum, pooled


def _recent(slots: int, count: int) -> torch.Tensor:
    """[slots] bool: the last `count` slots."""
    return torch.arange(slots) >= slots - count


@dataclass(frozen=True)
class SinksWindow(KVEviction):
    """StreamingLLM: the first `sinks` tokens (attention sinks) and the most recent window
    (budget - chunk - sinks tokens after an eviction). sinks=0 is the plain sliding window."""

    sinks: int = 4

    scored = False

    def __post_init__(self):
        check_int(self.name, "sinks", self.sinks, low=0)
        super().__post_init__()
        if self.sinks >= self.budget - self.chunk:
            raise InvalidParameterError(
                f"SinksWindow: {self.sinks} sinks leave no recent window in the {self.budget - self.chunk} slots kept"
            )

    def protected(self, slots: int) -> torch.Tensor:
        return (torch.arange(slots) < self.sinks) | _recent(slots, self.kept - self.sinks)


@dataclass(frozen=True)
class H2O(KVEviction):
    """Heavy hitters: a recent window of `recent` tokens (default half the kept tokens), the rest by
    the attention they received, summed over every later token."""

    recent: int | None = None

    def __post_init__(self):
        if self.recent is not None:
            check_int(self.name, "recent", self.recent, low=0)
        super().__post_init__()

    @property
    def recent_slots(self) -> int:
        return self.kept // 2 if self.recent is None else self.recent

    def protected(self, slots: int) -> torch.Tensor:
        return _recent(slots, self.recent_slots)

    def update(self, scores: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        return scores + attention.sum(2)


@dataclass(frozen=True)
class A2SF(H2O):
    """Accumulated attention with a forgetting factor: after each token, scores <- decay * scores +
    its attention, so old tokens' early attention fades. No recent window unless asked."""

    recent: int | None = 0
    decay: float = 0.95

    def __post_init__(self):
        if not isinstance(self.decay, float) or not 0.0 < self.decay <= 1.0:
            raise InvalidParameterError(f"A2SF.decay must be a float in (0, 1], got {self.decay!r}")
        super().__post_init__()

    def update(self, scores: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        return decayed_sum(scores, attention, self.decay)


@dataclass(frozen=True)
class TOVA(KVEviction):
    """Token omission via attention: keep the tokens the latest token attends to most, averaged over
    the layer's heads (one choice per layer)."""

    def update(self, scores: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        return attention[:, :, -1]  # the last accepted token's attention

    def priority(self, scores: torch.Tensor, slot_positions=None, local=None) -> torch.Tensor:
        return scores.mean(2, keepdim=True).expand_as(scores)  # [L, B, KV, S]: the same for every head


@dataclass(frozen=True)
class _ObservationWindow(KVEviction):
    """A policy that keeps the queries of the last `window` tokens, always keeps those tokens, and
    ranks at each eviction with the window's attention (SnapKV, EMS)."""

    window: int = 16

    window_queries = True

    def __post_init__(self):
        check_int(self.name, "window", self.window)
        super().__post_init__()

    def protected(self, slots: int) -> torch.Tensor:
        return _recent(slots, self.window)


@dataclass(frozen=True)
class SnapKV(_ObservationWindow):
    """SnapKV: the attention of an observation window of the last `window` tokens, pooled over
    `kernel` neighbouring slots, chooses what is kept; the window itself is always kept. Applied at
    every eviction (at the prompt's end that is SnapKV's prompt-time selection)."""

    kernel: int = 5

    scored = False

    def __post_init__(self):
        check_int(self.name, "kernel", self.kernel)
        if self.kernel % 2 == 0:
            raise InvalidParameterError(f"SnapKV.kernel must be odd (centred pooling), got {self.kernel}")
        super().__post_init__()

    def pool(self, scores: torch.Tensor) -> torch.Tensor:
        return pooled(scores, self.kernel)


@dataclass(frozen=True)
class Keyformer(H2O):
    """Keyformer: a recent window, then the key tokens by accumulated Gumbel-softmax attention (the
    logits plus Gumbel noise, at `temperature`)."""

    temperature: float = 1.0

    gumbel = True

    def __post_init__(self):
        if not isinstance(self.temperature, float) or self.temperature <= 0:
            raise InvalidParameterError(f"Keyformer.temperature must be a positive float, got {self.temperature!r}")
        super().__post_init__()


@dataclass(frozen=True)
class TrimKV(KVEviction):
    """TRIM-KV: a learned gate scores each token when it is created (log retention log beta, per KV
    head, from the layer's attention input); at an eviction the tokens of highest retention
    beta^(t - position) are kept, t the next position. gates_directory: gates trained for the model
    (specpass.research.retention_training; heads.retention)."""

    gates_directory: str = ""

    gated = True

    def __post_init__(self):
        if not isinstance(self.gates_directory, str) or not self.gates_directory:
            raise InvalidParameterError("TrimKV.gates_directory must name a directory of trained retention gates")
        super().__post_init__()

    def check(self, gm):
        from ...heads.io import model_mismatch
        from ...heads.retention import gates_config

        try:
            config = gates_config(self.gates_directory)
        except SpecpassError as exc:
            return str(exc)
        arch = arch_of(gm)
        if (config.num_layers, config.num_kv_heads) != (arch.num_layers, arch.num_kv_heads):
            return (f"the retention gates in {self.gates_directory} are for {config.num_layers} layers of "
                    f"{config.num_kv_heads} KV heads, not {arch.num_layers} of {arch.num_kv_heads}")  # fmt: skip
        return model_mismatch("retention gates", self.gates_directory, config.model, config.hidden_size,
                              arch.vocab_size, gm) or super().check(gm)  # fmt: skip

    def gates(self):
        from ...heads.retention import load_gates

        return load_gates(self.gates_directory)

    def priority(self, scores: torch.Tensor, slot_positions: torch.Tensor | None = None, local=None) -> torch.Tensor:
        ages = slot_positions.amax(-1, keepdim=True) + 1 - slot_positions  # [L, B, KV, S]: t - position
        return scores * ages  # log of beta^(t - position)

    def export_hook(self, gm, arch, dtype):
        """None: the export does not carry the retention gates' recorded state yet (refused by name)."""
        return None


@dataclass(frozen=True)
class EMS(_ObservationWindow):
    """EMS, evict-then-merge on a Global-Local score, per KV head. Global: the attention a slot received
    from every committed token, summed (H2O's); local: the attention of the last `window` tokens
    (SnapKV's observation window, always kept). Each is normalized to sum to one over the head's slots
    and the priority is their sum: the accumulated sum favours early tokens (more tokens saw them), the
    window recent ones. Of the slots not kept, each whose centred key has cosine similarity >=
    `similarity` with its nearest kept key merges into it (priority-weighted means of keys and values,
    scores summed); the rest fall to the zero class and are dropped (scores.merged_into_kept). A head
    with redundant keys merges many, a sparse one evicts: the split adapts per head. Built from the
    paper's abstract (its method text was not reachable): docs/design.md says which choices are ours."""

    similarity: float = 0.9

    merges = True

    def __post_init__(self):
        if not isinstance(self.similarity, float) or not -1.0 <= self.similarity <= 1.0:
            raise InvalidParameterError(f"EMS.similarity must be a float in [-1, 1] (a cosine), got {self.similarity!r}")
        super().__post_init__()

    def update(self, scores: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        return scores + attention.sum(2)

    def priority(self, scores: torch.Tensor, slot_positions=None, local=None) -> torch.Tensor:
        return scores / scores.sum(-1, keepdim=True) + local / local.sum(-1, keepdim=True)  # [L, B, KV, S]
